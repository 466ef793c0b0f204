"""Our GEMM kernels and cuBLAS in sequences of kernels against each alone, on one GPU: why
the kernels run slower in a training step than in a kernel benchmark.

In a step's traces our GEMM core and GELU GEMMs took 5-13% more than their benchmark times,
cuBLAS's GEMMs 0-4% (docs/measurements.md). This runs, at the 1.3B MLP shapes (M = 16384
tokens, D = 2048, F = 8192), ``--layers`` of each variant in one jitted function:

* ``alone[k]``: kernel k (``ours``: the MLP-in with its GELU epilogue, ``core``: our GEMM
  core, ``core.<name>``: the core on ``CORE_TILINGS[name]``, ``cublas``: XLA's dot,
  ``clocked``: the core stamping each tile, ``tile_clocks`` in the results) on one input
  and each layer's weight, back to back;
* ``layers[in=.+out=.]``: LayerNorm, the MLP-in (``ours``, or ``core`` / ``cublas`` then
  XLA's GELU), the MLP-out (``cublas`` or ``core``) and the residual add, as a step's
  forward pass runs them;
* ``a>b[dep]`` / ``a>b[indep]``: kernel a then kernel b, b on a's output or on an unrelated
  input; ``+gap``: ~0.5 ms of launches that move no data between them; ``+copy``: a pass
  over 1 GiB of memory; ``+fma``: a fused chain of fp32 multiply-adds, no memory traffic.

Every output is kept. Per variant and round (``--rounds``, taking turns) it records each
kernel's median and first time per launch by CUPTI, NVML's SM clock, power and clock-event
reasons sampled every 2 ms (``nvml.ClockSampler``), and, with ``--clock`` (the default),
the GPU's own view (``sm_clock``): a stamp kernel between every two GEMMs (``stamps``,
``clock_mhz``, beside ``launches``: the last call's GEMMs in order), and the same calls
issued back to back without a profiler, timed by the host and by the stamps
(``host_ms_per_call``, ``gpu_timer_ms``, ``back_to_back``: each call's span, the time
between calls, and the ``clocked`` core's SM clock and tile time). CUPTI's times can
exceed the GPU's under back-to-back load; the host's and the stamps' agree. ``--sleep-ms``
leaves the GPU idle after each call instead, ``--pad-mib`` moves the buffers.

GPU: python benchmarks/probe_sequences.py --out-dir $OUT
CPU: python benchmarks/probe_sequences.py --smoke   (tiny shapes, the kernels' jnp
     references, untimed)
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import nvml  # noqa: E402
from benchmarks.args import (add_output_args, one_device_report,  # noqa: E402
                             parse_with_smoke, spec_fields, write_report)

VARIANTS = ("alone[ours]", "alone[core]", "alone[cublas]",
            "layers[in=ours+out=cublas]", "layers[in=cublas+out=cublas]",
            "layers[in=core+out=cublas]", "layers[in=ours+out=core]",
            "ours>core[dep]", "ours>core[indep]", "ours>core[dep]+gap",
            "ours>cublas[dep]", "core>ours[indep]", "core>ours[indep]+gap",
            "cublas>ours[indep]", "cublas>core[indep]", "core>cublas[indep]",
            "ours>core[dep]+copy", "ours>core[dep]+fma",
            "alone[clocked]", "ours>clocked[dep]", "ours>clocked[dep]+gap",
            "ours>core.w4[dep]", "ours>core.w16[dep]", "ours>core.n8[dep]",
            "ours>core.split_m[dep]")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--iters", type=int, default=6, help="calls per variant and round")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--pad-mib", default="",
                 help="comma-separated MiB: round i first allocates (and keeps) an array of "
                      "the i-th size, so that the round's buffers land elsewhere in memory "
                      "(sets --rounds)")
  p.add_argument("--sleep-ms", type=float, default=0,
                 help="wait for each call, then leave the GPU idle this long")
  p.add_argument("--clock", action=argparse.BooleanOptionalAction, default=True,
                 help="stamp the SM clock between the GEMMs (sm_clock)")
  add_output_args(p, label="h200", smoke="CPU, tiny, the kernels' jnp references, untimed")
  args = parse_with_smoke(p, argv, dict(layers=2, rounds=1, label="smoke"))
  args.pads = [float(x) for x in args.pad_mib.split(",")] if args.pad_mib else []
  if args.pads:
    args.rounds = len(args.pads)
  return args


def kernels(on_gpu: bool):
  """name -> matmul ``(x, w, b) -> (kept outputs, what the next kernel reads)``;
  ``clocked``: the core stamping each tile's start and end (``sm_clock.clocked_store``);
  ``core.<name>``: the core on ``CORE_TILINGS[name]``."""
  import jax
  import jax.numpy as jnp
  from benchmarks import sm_clock
  from taco_jax.pallas_kernels import gelu_gemm, gemm
  if on_gpu:
    sms = gemm.num_sms()
    bias_gelu = functools.partial(gelu_gemm.matmul_bias_gelu, num_sms=sms, approx_math=True)
    core = functools.partial(gemm.matmul, num_sms=sms)
    clocked_core = functools.partial(gemm.matmul_epilogue, epilogue=sm_clock.clocked_store(),
                                     num_sms=sms)
  else:
    bias_gelu = gelu_gemm.matmul_bias_gelu_reference
    core = jnp.dot

    def clocked_core(x, w):  # the core's stand-in, its stamps zeros
      n_tiles = w.shape[1] // gemm.Tiling().tile_n
      return x @ w, jnp.zeros((x.shape[0], n_tiles * 6), jnp.int32)

  def clocked(x, w, b):
    y, stamps = clocked_core(x, w)
    return [y, stamps], y

  def core_on(tiling):  # the core on other tiles (the stand-in off the GPU)
    run = functools.partial(gemm.matmul, num_sms=sms, tiling=tiling) if on_gpu else jnp.dot
    return lambda x, w, b: ([y := run(x, w)], y)
  others = {f"core.{name}": core_on(tiling) for name, tiling in CORE_TILINGS.items()}

  def ours(x, w, b):
    h, a = bias_gelu(x, w, b)
    return [h, a], a

  def xla_gelu(y, b):
    return jax.nn.gelu(y + b.astype(y.dtype), approximate=True)
  return dict(ours=ours, core=lambda x, w, b: ([y := core(x, w)], y), clocked=clocked,
              cublas=lambda x, w, b: ([y := x @ w], y), xla_gelu=xla_gelu, **others)


def _core_tilings() -> dict:
  """``core.<name>``: the GEMM core on other tile orders and shapes than its default's."""
  import dataclasses
  from taco_jax.pallas_kernels import gemm
  t = gemm.Tiling()
  return dict(w4=dataclasses.replace(t, grid_width=4), w16=dataclasses.replace(t, grid_width=16),
              n8=dataclasses.replace(t, grid_minor="n"), split_m=dataclasses.replace(t, split="m"))


CORE_TILINGS = _core_tilings()


def _layernorm(r):
  import jax
  r32 = r.astype("float32")
  mu = r32.mean(-1, keepdims=True)
  var = ((r32 - mu) ** 2).mean(-1, keepdims=True)
  return ((r32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(r.dtype)


def _gap(kind: str, v, buf):
  """What runs between two kernels for the ``+kind`` variants (each ~0.5 ms on an H200):
  ``gap``, 150 small launches that read one element of v; ``copy``, buf scaled (one read
  and one write of it); ``fma``, a chain of multiply-adds on a 16M-element slice of v."""
  import jax
  import jax.numpy as jnp
  if kind == "gap":
    z = jnp.zeros((256,), jnp.float32) + v.reshape(-1)[0].astype(jnp.float32)
    return jax.lax.fori_loop(0, 150, lambda i, z: jnp.sin(z) + 1e-3, z)
  if kind == "copy":
    return buf * jnp.asarray(1.5, buf.dtype)  # (x 1.0001 rounds to x 1 in bf16: no pass)
  if kind == "fma":
    z = v.reshape(-1)[:1 << 24].astype(jnp.float32)
    for _ in range(FMA_CHAIN):
      z = z * 0.999 + 1e-3
    return z.sum()
  raise ValueError(f"unknown gap {kind!r}")


# multiply-adds per element of the fma gap: 16M elements x 1000 ~ 0.5 ms of an H200's
# fp32 CUDA cores
FMA_CHAIN = 1000


def stamped(ks: dict, between) -> tuple[dict, list]:
  """``ks`` with a clock stamp (``between(last output, inputs)``) before every GEMM but the
  first and after the last (``finish``), and the list the stamps go into."""
  stamps, last = [], []

  def wrap(k):
    def run(x, w, b):
      if last:
        (x, w), s = between(last.pop(), (x, w))
        stamps.append(s)
      outs, y = k(x, w, b)
      last.append(y)
      return outs, y
    return run

  def finish():
    if last:
      _, s = between(last.pop(), ())
      stamps.append(s)
    return stamps
  return {n: (k if n == "xla_gelu" else wrap(k)) for n, k in ks.items()}, finish


def variant_fn(name: str, ks: dict, layers: int, between=None):
  """The jitted function of ``r, w_in [L, D, F], b [L, F], w_out [L, F, D], buf`` (what the
  ``+copy`` gap scales) for ``name``;
  with ``between`` (``sm_clock.between`` or a stand-in) the stack of its clock stamps is
  its last output."""
  import jax
  import jax.numpy as jnp
  kind, _, spec = name.partition("[")
  spec, _, gap = spec.partition("]")
  gap = gap.lstrip("+")

  def fn(r, w_in, b, w_out, buf):
    ks_, finish = stamped(ks, between) if between else (ks, None)
    kept = _sequence(r, w_in, b, w_out, buf, ks_)
    return kept + [jnp.stack(finish())] if finish else kept

  def _sequence(r, w_in, b, w_out, buf, ks):
    kept, x0 = [], _layernorm(r)
    for l in range(layers):
      if kind == "alone":
        kept += ks[spec](x0, w_in[l], b[l])[0]
      elif kind == "layers":
        opts = spec_fields(spec)
        x = _layernorm(r)
        outs, y = ks[opts["in"]](x, w_in[l], b[l])
        a = y if opts["in"] == "ours" else ks["xla_gelu"](y, b[l])
        kept += outs
        more, y = ks[opts["out"]](a, w_out[l], None)
        kept += more
        r = r + y
      else:
        first, second = kind.split(">")
        outs, a = ks[first](x0, w_in[l], b[l])
        kept += outs
        if gap:
          kept.append(_gap(gap, a, buf))
        if spec.startswith("dep"):
          more, _ = ks[second](a, w_out[l], b[l] if second == "ours" else None)
        else:
          more, _ = ks[second](x0, w_in[(l + 1) % layers], b[(l + 1) % layers])
        kept += more
    return kept
  if kind not in ("alone", "layers") and ">" not in kind:
    raise ValueError(f"unknown variant {name!r}")
  return jax.jit(fn)


def measure(fn, args, iters: int, gpus, clock: bool, sleep_ms: float = 0) -> dict:
  """Per kernel name (launched at least once a layer): its launches' median and first time
  in ms, and the clocks while the calls ran; plus the median call's summed kernel time, and
  with ``clock`` the last call's GEMMs in order and the SM clock after each. With
  ``sleep_ms`` each call is waited for, then the GPU left idle that long; without, the
  calls are also timed back to back by the host (``host_ms_per_call``), which CUPTI's
  summed kernel times can exceed (docs/measurements.md)."""
  import time
  import jax
  from jax.experimental.mosaic.gpu import profiler
  from benchmarks import sm_clock
  with nvml.ClockSampler(gpus, 0.002) as clocks:
    if sleep_ms:
      runs = []
      for _ in range(iters):
        outs, launches = profiler.measure(fn, aggregate=False, iterations=1)(*args)
        runs.append(launches)
        time.sleep(sleep_ms / 1e3)
    else:
      outs, runs = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
  per: dict[str, list[float]] = {}
  for launches in runs:
    for kname, ms in launches:
      per.setdefault(kname, []).append(ms)
  wall_ms = gpu_timer_ms = back_to_back = None
  if not sleep_ms:  # the same calls back to back, timed by the host (and the GPU's timer)
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    stamps, tiles = [], []  # each call's clock stamps and clocked tiles' (the rest freed)
    for _ in range(iters):
      out = fn(*args)
      last = out[-1]
      stamps.append(last if clock else None)
      tiles.append([o for o in out if _tile_stamps(o)])
    jax.block_until_ready(last)
    wall_ms = (time.perf_counter() - t0) * 1e3 / iters
    if clock:  # from the first call's first stamp to the last call's last stamp's end
      calls = [_rows(s) for s in stamps]
      clocked = [[sm_clock.tile_clocks(t) for t in ts] for ts in tiles if ts]
      start, end = calls[0][0][2], calls[-1][-1][2] + calls[-1][-1][1]
      gpu_timer_ms = (end - start) % 2**32 / 1e6
      back_to_back = dict(  # per call: its stamps' span; between calls: last end to first
          span_ms=[round((c[-1][2] + c[-1][1] - c[0][2]) % 2**32 / 1e6, 3) for c in calls],
          between_ms=[round((b[0][2] - a[-1][2] - a[-1][1]) % 2**32 / 1e6, 3)
                      for a, b in zip(calls, calls[1:])],
          # the clocked core's SM clock (median over its GEMMs) and tile time, per call
          core_mhz=[round(statistics.median(c["median_mhz"] for c in cs), 1) for cs in clocked],
          tile_us=[round(statistics.median(c["tile_us"] for c in cs), 2) for cs in clocked])
  got = dict(total_ms=statistics.median(sum(ms for _, ms in ls) for ls in runs),
             host_ms_per_call=wall_ms, host_ms=None if wall_ms is None else wall_ms * iters,
             gpu_timer_ms=gpu_timer_ms, back_to_back=back_to_back,
             kernels={k: dict(median_ms=statistics.median(v), first_ms=v[0], launches=len(v))
                      for k, v in per.items()},
             clocks=(clocks.summary() or {}).get(gpus[0].index) if gpus else None)
  got["tile_clocks"] = [sm_clock.tile_clocks(o) for o in outs if _tile_stamps(o)]
  if clock:
    got["clock_mhz"] = sm_clock.mhz(outs[-1])
    got["stamps"] = _rows(outs[-1])  # [cycles, ns, start ns]
    got["launches"] = [(kname[:40], round(ms, 4)) for kname, ms in runs[-1]
                       if ms > 0.05 and "sm_clock" not in kname]
  return got


def _rows(stamps) -> list[list[int]]:
  """A call's clock stamps (``sm_clock.stamp``'s, stacked) as lists of ints."""
  return [[int(v) for v in row] for row in stamps]


def _tile_stamps(a) -> bool:
  """Whether an output is the clocked core's tile stamps (``[M, column tiles x 6]`` int32;
  the stamps between GEMMs are ``[n, 3]``)."""
  return a.dtype == "int32" and a.ndim == 2 and a.shape[1] % 6 == 0 and a.shape[0] > 128


def _between(on_gpu: bool):
  """``sm_clock.between`` on the GPU; off it, a stand-in with the same dependencies that
  stamps zeros (the smoke run checks the stamps' places, not their values)."""
  import jax
  import jax.numpy as jnp
  if on_gpu:
    from benchmarks import sm_clock
    return sm_clock.between

  def stand_in(before, after):
    s = jnp.zeros((3,), jnp.int32) + (before.reshape(-1)[0] * 0).astype(jnp.int32)
    return jax.lax.optimization_barrier((after, s))
  return stand_in


def main(argv=None):
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  on_gpu = jax.default_backend() == "gpu" and not args.smoke
  m, d, f = (16384, 2048, 8192) if on_gpu else (128, 64, 128)
  L = args.layers
  k = jax.random.split(jax.random.key(0), 4)
  bf16 = jnp.bfloat16
  operands = (jax.random.normal(k[0], (m, d)).astype(bf16),
              (jax.random.normal(k[1], (L, d, f)) / d ** 0.5).astype(bf16),
              0.1 * jax.random.normal(k[2], (L, f)),
              (jax.random.normal(k[3], (L, f, d)) / f ** 0.5).astype(bf16),
              jnp.ones((1 << 29,) if on_gpu else (1024,), bf16))  # the copy gap's 1 GiB
  ks = kernels(on_gpu)
  fns = {name: variant_fn(name, ks, L, _between(on_gpu) if args.clock else None)
         for name in args.variants.split(",")}
  gpus = nvml.gpus()[:1]
  results = {name: [] for name in fns}
  held = []  # the round's pad, kept while its variants run
  for rnd in range(args.rounds):
    pad_mib = args.pads[rnd] if args.pads else 0
    held[:] = [jnp.zeros((int(pad_mib * 2**20),), jnp.uint8).block_until_ready()]
    for name, fn in fns.items():
      out = jax.block_until_ready(fn(*operands))
      if not on_gpu:
        if args.clock:
          results[name].append(dict(stamps=len(out[-1])))
        continue
      got = measure(fn, operands, args.iters, gpus, args.clock, args.sleep_ms)
      got["pad_mib"] = pad_mib
      results[name].append(got)
      clocks = got["clocks"] or {}
      mains = {n[:40]: round(v["median_ms"], 3) for n, v in got["kernels"].items()
               if v["launches"] >= L * args.iters and v["median_ms"] > 0.3}
      print(f"round {rnd} pad {pad_mib:g} MiB {name:28s} {got['total_ms']:7.3f} ms "
            f"(host {got['host_ms_per_call'] or 0:.3f}; {args.iters} calls: host "
            f"{got['host_ms'] or 0:.2f}, GPU timer {got['gpu_timer_ms'] or 0:.2f})  clock mean "
            f"{clocks.get('mean_mhz', 0):.0f} min {clocks.get('min_mhz')}  {mains}"
            f"  launches {[round(ms, 3) for _, ms in got.get('launches', [])][:8]}"
            f"  stamps {[round(c) for c in got.get('clock_mhz', [])][:8]}"
            f"  in-kernel MHz, tile us, span us "
            f"{[(c['median_mhz'], c['tile_us'], c['span_us']) for c in got['tile_clocks']][:6]}",
            flush=True)
  report = one_device_report("probe_sequences", args, results)
  report["shapes"] = dict(m=m, d=d, f=f)
  return write_report("probe_sequences", args, report,
                      f"{len(fns)} variants, {args.rounds} round(s)")


if __name__ == "__main__":
  main()
