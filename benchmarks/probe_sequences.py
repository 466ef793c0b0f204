"""Our GEMM kernels and cuBLAS in sequences of kernels against each alone, on one GPU: why
the kernels run slower in a training step than in a kernel benchmark.

In a step our GEMM core and GELU GEMMs take 5-13% more than their benchmark times, cuBLAS's
GEMMs 0-4% (docs/measurements.md). This runs, at the 1.3B MLP shapes (M = 16384 tokens,
D = 2048, F = 8192), ``--layers`` of each variant in one jitted function:

* ``alone[k]``: kernel k (``ours``: the MLP-in with its GELU epilogue, ``core``: our GEMM
  core, ``cublas``: XLA's dot) on one input and each layer's weight, back to back;
* ``layers[in=.+out=.]``: LayerNorm, the MLP-in (``ours``, or ``core`` / ``cublas`` then
  XLA's GELU), the MLP-out (``cublas`` or ``core``) and the residual add, as a step's
  forward pass runs them;
* ``a>b[dep]`` / ``a>b[indep]``: kernel a then kernel b, b on a's output or on an unrelated
  input; ``+gap``: ~0.5 ms of launches that move no data between them.

Every output is kept. Per variant it records each kernel's median time per launch (CUPTI)
and its first launch's, and NVML's SM clock, power and clock-event reasons, sampled every
2 ms while the variant's calls ran (``nvml.ClockSampler``), in ``--rounds`` rounds that take
turns.

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
            "cublas>ours[indep]", "cublas>core[indep]", "core>cublas[indep]")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--iters", type=int, default=6, help="calls per variant and round")
  p.add_argument("--rounds", type=int, default=2)
  add_output_args(p, label="h200", smoke="CPU, tiny, the kernels' jnp references, untimed")
  return parse_with_smoke(p, argv, dict(layers=2, rounds=1, label="smoke"))


def kernels(on_gpu: bool):
  """name -> matmul ``(x, w, b) -> (kept outputs, what the next kernel reads)``."""
  import jax
  import jax.numpy as jnp
  from taco_jax.pallas_kernels import gelu_gemm, gemm
  if on_gpu:
    sms = gemm.num_sms()
    bias_gelu = functools.partial(gelu_gemm.matmul_bias_gelu, num_sms=sms, approx_math=True)
    core = functools.partial(gemm.matmul, num_sms=sms)
  else:
    bias_gelu = gelu_gemm.matmul_bias_gelu_reference
    core = jnp.dot

  def ours(x, w, b):
    h, a = bias_gelu(x, w, b)
    return [h, a], a

  def xla_gelu(y, b):
    return jax.nn.gelu(y + b.astype(y.dtype), approximate=True)
  return dict(ours=ours, core=lambda x, w, b: ([y := core(x, w)], y),
              cublas=lambda x, w, b: ([y := x @ w], y), xla_gelu=xla_gelu)


def _layernorm(r):
  import jax
  r32 = r.astype("float32")
  mu = r32.mean(-1, keepdims=True)
  var = ((r32 - mu) ** 2).mean(-1, keepdims=True)
  return ((r32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(r.dtype)


def _gap(v):
  """~0.5 ms of small launches (150 loop steps) that read one element of v."""
  import jax
  import jax.numpy as jnp
  z = jnp.zeros((256,), jnp.float32) + v.reshape(-1)[0].astype(jnp.float32)
  return jax.lax.fori_loop(0, 150, lambda i, z: jnp.sin(z) + 1e-3, z)


def variant_fn(name: str, ks: dict, layers: int):
  """The jitted function of ``r, w_in [L, D, F], b [L, F], w_out [L, F, D]`` for ``name``."""
  import jax
  kind, _, spec = name.partition("[")

  def fn(r, w_in, b, w_out):
    kept, x0 = [], _layernorm(r)
    for l in range(layers):
      if kind == "alone":
        kept += ks[spec.rstrip("]")](x0, w_in[l], b[l])[0]
      elif kind == "layers":
        opts = spec_fields(spec.rstrip("]"))
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
        if name.endswith("+gap"):
          kept.append(_gap(a))
        if spec.startswith("dep"):
          more, _ = ks[second](a, w_out[l], b[l] if second == "ours" else None)
        else:
          more, _ = ks[second](x0, w_in[(l + 1) % layers], b[(l + 1) % layers])
        kept += more
    return kept
  if kind not in ("alone", "layers") and ">" not in kind:
    raise ValueError(f"unknown variant {name!r}")
  return jax.jit(fn)


def measure(fn, args, iters: int, gpus) -> dict:
  """Per kernel name (launched at least once a layer): its launches' median and first time
  in ms, and the clocks while the calls ran; plus the median call's summed kernel time."""
  from jax.experimental.mosaic.gpu import profiler
  with nvml.ClockSampler(gpus, 0.002) as clocks:
    _, runs = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
  per: dict[str, list[float]] = {}
  for launches in runs:
    for kname, ms in launches:
      per.setdefault(kname, []).append(ms)
  return dict(total_ms=statistics.median(sum(ms for _, ms in ls) for ls in runs),
              kernels={k: dict(median_ms=statistics.median(v), first_ms=v[0], launches=len(v))
                       for k, v in per.items()},
              clocks=(clocks.summary() or {}).get(gpus[0].index) if gpus else None)


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
              (jax.random.normal(k[3], (L, f, d)) / f ** 0.5).astype(bf16))
  ks = kernels(on_gpu)
  fns = {name: variant_fn(name, ks, L) for name in args.variants.split(",")}
  gpus = nvml.gpus()[:1]
  results = {name: [] for name in fns}
  for rnd in range(args.rounds):
    for name, fn in fns.items():
      jax.block_until_ready(fn(*operands))
      if not on_gpu:
        continue
      got = measure(fn, operands, args.iters, gpus)
      results[name].append(got)
      clocks = got["clocks"] or {}
      mains = {n[:40]: round(v["median_ms"], 3) for n, v in got["kernels"].items()
               if v["launches"] >= L * args.iters and v["median_ms"] > 0.3}
      print(f"round {rnd} {name:28s} {got['total_ms']:7.3f} ms  clock mean "
            f"{clocks.get('mean_mhz', 0):.0f} min {clocks.get('min_mhz')}  {mains}", flush=True)
  report = one_device_report("probe_sequences", args, results)
  report["shapes"] = dict(m=m, d=d, f=f)
  return write_report("probe_sequences", args, report,
                      f"{len(fns)} variants, {args.rounds} round(s)")


if __name__ == "__main__":
  main()
