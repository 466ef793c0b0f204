"""Fused collective matmuls (``pallas_kernels.ag_matmul`` / ``matmul_rs``) against XLA's
collective + cuBLAS, at the GPT layer shapes of tensor parallelism, device-timed.

For each model (1.3B, 2.7B) and TP layer, on a 1-D mesh over all local GPUs (TP = their
count), the same random inputs go through:

* ``xla``: the plain collective, then the matmul (``*_reference``: what the layers do today);
* ``fused``: the plain kernel, on the tiles the layers take (the all-gather's
  ``ag_matmul.plain_tiling``: pulled where a cluster covers the row, else the ring, its tiles
  narrowed where a step would leave a wave half empty; ``[cluster_n=1]``: the ring);
  ``fused_fp8``: the codec's encode kernel, then the compressed kernel (its own time
  is reported apart as ``fp8_kernel``); ``fused[phases=P]`` and ``fused_fp8[phases=P]``
  (``--rs-phases``): the reduce-scatter kernels with P row-tile phases instead of
  ``matmul_rs.default_phases``; ``fused[pull=D]`` and ``fused_fp8[pull=D]`` (``--rs-pull-depth``):
  with D of the peers' partial blocks in flight per warpgroup instead of
  ``matmul_rs.PULL_DEPTH``;
  ``fused[probe=...]`` (``--rs-probe``): every sent tile also reads partials as an own tile
  does, unread (``matmul_rs``'s ``_probe``);
* ``gemm``: our kernel's GEMM with no communication (one rank, the full matmul);
  ``core[...]``: the GEMM core alone (``gemm.matmul``: no copies, plain epilogue), per
  ``--core-tilings``: what the kernels' hooks cost on top of it; ``core[default][w_t]`` and
  ``cublas[w_t]``: both on the weight stored ``[N, K]``, as the backward passes read it;
* ``cublas``: XLA's bf16 matmul of the same full shape on one GPU (cuBLAS): the ideal;
  ``xla_f32_dot``: the same accumulated to fp32 then converted, which XLA runs as a Triton
  GEMM (the ``cublas`` of results before 2026-11-24);
* ``cublas_cold``, ``core[...]_cold`` (``--cold``): the same, each call after an XLA fusion
  that streams ``COLD_MIB`` through memory, so that the matmul finds none of its operands in
  L2 and follows a kernel of another kind, as in a training step; only the matmul's own
  kernels are timed (does the core's in-step gap to cuBLAS come from that?);
  ``cublas_hot``, ``core[...]_hot`` (``--hot``): each call after ~60 ms of fp32 matmuls, at
  the clocks of a GPU under sustained load; ``cublas_fresh``, ``core[...]_fresh``
  (``--fresh``): each call on an x that an XLA fusion has just written, as a step's
  LayerNorm or stand-in collective writes the matmul's input (its tail still in L2);
* ``jax_gemm``: jax's own Hopper matmul example (``hopper_matmul_mgpu``) on that shape, with
  the same tiles as ours, alone and in CTA pairs (``[cluster=m]`` / ``[cluster=n]``: one
  operand's blocks multicast to both): a yardstick for our GEMM core.

With fewer GPUs than ``--tp`` (e.g. one H200 and ``--tp 2``), only the one-GPU variants run
(``gemm``, ``cublas``, ``jax_gemm``) at the TP shapes: the GEMM core's own speed.

Column layers (``qkv``, ``up``) are all-gather + matmul, row layers (``proj``, ``down``)
matmul + reduce-scatter; ``qkv_dx`` and ``proj_dx`` are backward kernels (``layer_shapes``).
Every kernel's result is first checked against its reference (relative Frobenius error,
and the gathered x bit for bit; with ``--check-calls N`` in N calls); a kernel that fails its check
is reported, not timed. Times: CUPTI kernel durations (``mosaic.gpu.profiler.measure``) per
call; per kernel name the minimum over devices (the device that waited least, as jax's
collective-matmul example measures), summed over kernels; median over ``--iters`` calls.
Results (and every check) go to the JSON as each case finishes, so a hang loses nothing.

GPU: ``python3 -m benchmarks.bench_collective_matmul --out-dir $OUT`` (2 or 4 GPUs; one GPU
with ``--tp 2``).
CPU (--smoke): the references and the checks' plumbing only; the kernels lower but need
a GPU to run (``tests/test_collective_matmul.py`` runs their per-device parts on CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import statistics
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import (add_output_args, parse_with_smoke, spec_fields,  # noqa: E402
                             start_watchdog, write_results)

MODELS = {"1.3b": dict(d=2048, f=8192), "2.7b": dict(d=2560, f=10240),
          "tiny": dict(d=256, f=512)}  # tiny: --smoke
FP8 = dict(group_size=128, fmt="e4m3", dual_scale=True, lam=1e-6)
COLD_MIB = 512  # ``--cold``'s flush: ten times an H200's L2
HOT_MATMULS, HOT_SIZE = 24, 8192  # ``--hot``'s fp32 matmuls


def _ag_fp8() -> dict:
  """The all-gather kernels' codec settings with the encode they run: the codec's kernel on
  the GPU (its sums run in another order than the reference's, so a few codes differ), the
  reference elsewhere. The compressed references encode alike, so they hold the same codes."""
  import jax
  return dict(FP8, implementation="pallas" if jax.default_backend() == "gpu" else "xla")
TOL = 1e-2  # relative error of a bf16 result against its reference
# the reduce-scatter options (``kernel_options``) timed on the FP8 kernel too
RS_FP8_OPTIONS = {"phases", "pull_depth", "_skip"}
DIAGNOSTIC = "[skip="  # in the names of variants timed though wrong by design (--*-skip)
# in the names of the kernels that take the weight as the layers' backward passes hold it,
# [N, K] (``transpose_w``): they run on the same weight, stored transposed
TRANSPOSED = "[w_t]"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="1.3b,2.7b")
  p.add_argument("--layers", default="qkv,up,proj,down,qkv_dx,proj_dx")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--tp", type=int, default=0,
                 help="the TP the layer shapes are for (default: the local GPU count); with "
                      "fewer GPUs, only the one-GPU variants run")
  p.add_argument("--tilings", default="default",
                 help="comma-separated Tiling overrides per kernel, e.g. "
                      "'default,stages=3,tile_n=64' (each 'k=v+k=v'; 'sms=N': on N SMs); "
                      "with cluster_n > 1 the all-gather kernel pulls")
  p.add_argument("--rs-phases", default="",
                 help="comma-separated phase counts to time the reduce-scatter kernels, plain "
                      "and FP8, with besides their default (matmul_rs.default_phases): "
                      "fused[phases=P], fused_fp8[phases=P]")
  p.add_argument("--rs-pull-depth", default="",
                 help="comma-separated pull depths to time the reduce-scatter kernels, plain "
                      "and FP8, with besides their default (matmul_rs.PULL_DEPTH): "
                      "fused[pull=D], fused_fp8[pull=D]")
  p.add_argument("--rs-probe", default="",
                 help="comma-separated probes of the plain reduce-scatter kernel "
                      "('sent_reads', 'sent_local_reads', 'sent_all_reads': matmul_rs's "
                      "_probe), each timed and checked as fused[probe=...]: what remote "
                      "reads cost the tiles beside them")
  p.add_argument("--check-calls", type=int, default=1,
                 help="check every multi-GPU kernel in this many calls, counting the wrong "
                      "ones (wrong_calls): a race shows in some calls only")
  p.add_argument("--rs-skip", default="",
                 help="comma-separated parts of the reduce-scatter kernels, plain and FP8, to "
                      "leave out ('waits', 'release', 'signals', 'remote', or several joined "
                      "by '+': matmul_rs's _skip), each timed unchecked, as fused[skip=...] "
                      "and fused_fp8[skip=...]: what each costs (the result is wrong)")
  p.add_argument("--ag-skip", default="",
                 help="the same for the plain all-gather kernel, fused and alone ('copy': "
                      "the own chunk's copy into the gathered x): fused[skip=copy]")
  p.add_argument("--ag-chunk-waits", action="store_true",
                 help="also time the plain all-gather kernel with its ring's steps waiting for "
                      "whole chunks (ag_matmul's _chunk_waits; the default below "
                      "ag_matmul.ROW_WAITS_FROM ranks): fused[chunk_waits]")
  p.add_argument("--core-tilings", default="default",
                 help="Tiling overrides of the GEMM core alone (gemm.matmul), as --tilings")
  p.add_argument("--cold", action="store_true",
                 help="also time cublas and each core[...] after an L2 flush: *_cold")
  p.add_argument("--hot", action="store_true",
                 help="... and after ~60 ms of fp32 matmuls (a GPU under load): *_hot")
  p.add_argument("--fresh", action="store_true",
                 help="... and on an x an XLA fusion has just written: *_fresh")
  add_output_args(p, label="nvlink", smoke="CPU: 8 fake devices, tiny shapes, no kernels")
  return parse_with_smoke(p, argv, dict(models="tiny", batch=2, seq=512, iters=2))


def layer_shapes(model: str, tp: int, batch: int, seq: int) -> dict:
  """Per layer: (kind, x or y global shape, w global shape). The ``_dx`` layers are the
  backward passes' kernels whose shapes no forward kernel has: the QKV input's gradient
  (a reduce-scatter over 3d features) and the out-projection's (an all-gather into d / tp
  columns); the MLP's backward kernels have the forward shapes of the other MLP layer."""
  d, f = MODELS[model]["d"], MODELS[model]["f"]
  return {"qkv": ("ag", (batch, seq, d), (d, 3 * d)),
          "up": ("ag", (batch, seq, d), (d, f)),
          "proj": ("rs", (batch, seq, d), (d, d)),
          "down": ("rs", (batch, seq, f), (f, d)),
          "qkv_dx": ("rs", (batch, seq, 3 * d), (3 * d, d)),
          "proj_dx": ("ag", (batch, seq, d), (d, d))}


def _spec(spec: str) -> dict:
  """A ``--tilings`` entry's overrides: ``{}`` for ``default``, else ``k=v+k=v``."""
  return {} if spec == "default" else spec_fields(spec)


def _tiling(base, spec: str):
  """``base`` with a ``--tilings`` entry's Tiling fields (all its keys but ``sms``)."""
  kw = {k: v for k, v in _spec(spec).items() if k != "sms"}
  return dataclasses.replace(base, **kw) if kw else base


def _sms(spec: str, default: int) -> int:
  """The SMs a ``--tilings`` entry runs the kernel on: its ``sms=N``, else ``default`` (e.g.
  ``cluster_n=4+sms=104``: whether the pulled kernel's time follows its SMs or the link)."""
  return _spec(spec).get("sms", default)


def best_of_rounds(timed: dict, iters: int, rounds: int) -> dict:
  """``name -> (fn, args)`` on one device, timed in ``rounds`` rounds that take turns
  (`timed_or_error`'s median of ``iters`` calls each): ``name -> {"ms": each round's (None
  where it failed), "best_ms": the least, if any}``."""
  ms = {name: [] for name in timed}
  for _ in range(rounds):
    for name, (fn, args) in timed.items():
      ms[name].append(timed_or_error(fn, args, iters, 1).get("ms"))
  out = {}
  for name, times in ms.items():
    good = [t for t in times if t is not None]
    out[name] = dict(ms=times, **({"best_ms": min(good)} if good else {}))
  return out


def timed_or_error(fn, args, iters: int, n_devices: int, tries: int = 2,
                   skip: frozenset = frozenset()) -> dict:
  """``device_time_ms``, tried again once if the profiler fails (it once saw other kernel
  names in one of the calls than in the others), then its error: one variant's failed
  timing is reported and the run goes on."""
  for _ in range(tries):
    try:
      return device_time_ms(fn, args, iters, n_devices, skip=skip)
    except RuntimeError as e:
      error = f"{type(e).__name__}: {e}"[:2000]
  return {"timing_error": error}


def device_time_ms(fn, args, iters: int, n_devices: int,
                   skip: frozenset = frozenset()) -> dict:
  """Median over ``iters`` calls of the summed kernel durations (per kernel name, the
  minimum over devices), with the per-kernel breakdown of the median call; kernels named in
  ``skip`` are left out."""
  from jax.experimental.mosaic.gpu import profiler
  _, runs = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
  if iters == 1:
    runs = [runs]
  totals, breakdowns = [], []
  for kernels in runs:
    by_name: dict[str, list[float]] = {}
    for name, ms in kernels:
      if name not in skip:
        by_name.setdefault(name, []).append(ms)
    # names repeated more often than there are devices are separate launches: keep each
    # launch's minimum over devices
    per = {name: sum(sorted(v)[:max(1, len(v) // n_devices)]) for name, v in by_name.items()}
    totals.append(sum(per.values()))
    breakdowns.append(per)
  mid = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
  return dict(ms=statistics.median(totals), min_ms=min(totals), max_ms=max(totals),
              kernels=breakdowns[mid])


def wrong_calls(fn, args, want, calls: int) -> int:
  """How many of ``calls`` more calls of ``fn(*args)`` miss ``want`` (the first output's
  ``rel_err`` at ``TOL`` or more)."""
  return sum(rel_err(fn(*args)[0], want) >= TOL for _ in range(calls))


def rel_err(a, b) -> float:
  import jax.numpy as jnp
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from taco_jax.pallas_kernels import ag_matmul, gemm, matmul_rs
  from taco_jax.pallas_kernels.encode import encode

  on_gpu = jax.default_backend() == "gpu"
  devs = jax.devices()
  tp = args.tp or len(devs)
  mesh = jax.make_mesh((tp,), ("tensor",), devices=devs[:tp]) if tp <= len(devs) else None
  one = jax.make_mesh((1,), ("tensor",), devices=devs[:1])
  sms = gemm.num_sms()
  smap = functools.partial(jax.shard_map, check_vma=False)
  results = dict(tp=tp, gpus=min(tp, len(devs)), device=devs[0].device_kind, num_sms=sms,
                 batch=args.batch, seq=args.seq, iters=args.iters, fp8=FP8, cases=[])

  def put(a, spec, m=mesh):
    return jax.device_put(a, NamedSharding(m, spec))

  for model in args.models.split(","):
    for layer in args.layers.split(","):
      kind, a_shape, w_shape = layer_shapes(model, tp, args.batch, args.seq)[layer]
      key = jax.random.key(hash((model, layer)) % 2**31)
      ka, kw = jax.random.split(key)
      a = jax.random.normal(ka, a_shape, jnp.bfloat16)
      w = (jax.random.normal(kw, w_shape, jnp.float32) * w_shape[0] ** -0.5
           ).astype(jnp.bfloat16)
      if kind == "ag":
        a_spec, w_spec, out_spec = P(None, "tensor"), P(None, "tensor"), P(None, None, "tensor")
      else:
        a_spec, w_spec, out_spec = P(None, None, "tensor"), P("tensor"), P(None, "tensor")
      rs_options, ag_options = kernel_options(args)
      variants = _variants(kind, smap, mesh, one, a_spec, w_spec, out_spec, sms,
                           args.tilings, ag_matmul, matmul_rs, encode, rs_options, ag_options)
      case = dict(model=model, layer=layer, kind=kind, a_shape=a_shape, w_shape=w_shape,
                  tp=tp, variants={})
      results["cases"].append(case)
      # one rank's matmul: the gathered x times its weight columns (column layers), its
      # feature slice of y times its weight rows (row layers)
      if kind == "ag":
        full_a, full_w = a, w[:, :w.shape[1] // tp]
      else:
        full_a, full_w = a[..., :a.shape[-1] // tp], w[:w.shape[0] // tp]
      full_a, full_w, full_w_t = put(full_a, P(), one), put(full_w, P(), one), put(
          full_w.T, P(), one)
      timed = {"cublas": (ref_full, (full_a, full_w)),
               "cublas" + TRANSPOSED: (functools.partial(ref_full, transpose_w=True),
                                       (full_a, full_w_t)),
               "xla_f32_dot": (ref_f32_dot, (full_a, full_w))}
      if mesh is not None:
        a_s, w_s = put(a, a_spec), put(w, w_spec)
        w_t_s = put(w.T, transposed(w_spec))
        reference, ref_fp8 = variants.pop("xla"), variants.pop("xla_fp8")
        ref = jax.jit(reference)(a_s, w_s)
        ref8 = jax.jit(ref_fp8)(a_s, w_s)
        case["fp8_vs_plain_rel_err"] = rel_err(ref8[0], ref[0])
        timed["xla"] = (reference, (a_s, w_s))
      else:
        variants = {k: v for k, v in variants.items() if isinstance(v, tuple) and v[1]}
      if on_gpu and mesh is None and tp > 1:
        for name, (fn, fargs, want) in _rank0(kind, a, w, tp, sms, ag_matmul, matmul_rs,
                                              encode).items():
          got = jax.jit(fn)(*fargs)
          check = case["variants"][name] = dict(rel_err=rel_err(got, want))
          check["ok"] = check["rel_err"] < TOL
          if check["ok"]:
            timed[name] = (fn, fargs)
      if on_gpu:
        for spec in args.core_tilings.split(","):
          variants[f"core[{spec}]"] = (functools.partial(
              _core, tiling=_tiling(gemm.Tiling(), spec), sms=_sms(spec, sms)), True)
        variants["core[default]" + TRANSPOSED] = (functools.partial(
            _core, tiling=gemm.Tiling(), sms=sms, transpose_w=True), True)
        for cluster in (None, "m", "n"):
          variants["jax_gemm" + (f"[cluster={cluster}]" if cluster else "")] = (
              functools.partial(_jax_gemm, cluster=cluster), True)
        # what the one-GPU variants must compute: plain, and (once asked for) compressed
        want_one = {False: ref_full(full_a, full_w)}
      for name, (fn, alone) in variants.items():
        check = dict()
        case["variants"][name] = check
        if not on_gpu:
          check["skipped"] = "the kernels run on a GPU only"
          continue
        if alone:
          fargs = (full_a, full_w_t if TRANSPOSED in name else full_w)
        else:
          fargs = (a_s, w_t_s if TRANSPOSED in name else w_s)
        try:
          out = jax.jit(fn)(*fargs)
          if alone:  # our GEMM, no communication: the full matmul on one rank
            fp8 = "fp8" in name
            if fp8 and fp8 not in want_one:
              want_one[fp8] = _one_rank_fp8_reference(kind, smap, one)(full_a, full_w)
            got, want = out[0], want_one[fp8]
            if fp8:
              check["rel_err_vs_plain"] = rel_err(got, want_one[False])
          else:
            want_all = ref8 if "fp8" in name else ref
            got, want = out[0], want_all[0]
            if kind == "ag":
              check["gathered_equal"] = bool(jnp.array_equal(out[1], want_all[1]))
          check["rel_err"] = rel_err(got, want)
          check["ok"] = check["rel_err"] < TOL and check.get("gathered_equal", True)
          if args.check_calls > 1 and not alone:  # a race shows in some calls only
            wrong = wrong_calls(jax.jit(fn), fargs, want, args.check_calls - 1)
            check.update(calls=args.check_calls, wrong_calls=wrong + (not check["ok"]))
            check["ok"] = check["ok"] and not wrong
        except Exception as e:  # noqa: BLE001 (reported, not timed)
          check.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        if DIAGNOSTIC in name and "rel_err" in check:
          check["diagnostic"] = "timed though its result is wrong by design"
        if check["ok"] or "diagnostic" in check:
          timed[name] = (fn, fargs)
        _write(args, results)
      neighbours = [kind for kind in NEIGHBOURS if getattr(args, kind)]
      if on_gpu and neighbours:
        timed.update(_neighboured_variants(timed, neighbours))
      for name, (fn, fargs) in timed.items():
        if not on_gpu:
          continue
        kind = name.rpartition("_")[2]
        skip = _neighbour_kernels(kind) if kind in neighbours else frozenset()
        case["variants"].setdefault(name, {}).update(timed_or_error(
            jax.jit(fn), fargs, args.iters, 1 if fargs[0] is full_a else tp, skip=skip))
        _write(args, results)
      _ratios(case)
      _write(args, results)
      print(_line(case), flush=True)
  return results


def _flush(junk):
  """``--cold``'s neighbour: one pass over ``COLD_MIB`` (read and written once)."""
  return junk + 1


def _heat(m):
  """``--hot``'s neighbour: ``HOT_MATMULS`` chained fp32 matmuls (~60 ms of tensor-core
  work on an H200), so that the timed matmul runs at the clocks of a GPU under sustained
  load, as in a training step."""
  x = m
  for _ in range(HOT_MATMULS):
    x = x @ m
  return x


def _rewrite(x, one):
  """``--fresh``'s neighbour: x written anew by an XLA fusion (times a traced 1), which the
  barrier keeps out of the matmul that reads it."""
  from jax import lax
  return lax.optimization_barrier(x * one.astype(x.dtype))


NEIGHBOURS = ("cold", "hot", "fresh")  # the kinds of neighboured variants, as flags


@functools.cache
def _neighbour(kind: str):
  """(function, argument) of ``--cold``, ``--hot`` or ``--fresh``'s neighbour (``fresh``'s
  also takes the matmul's x, before its argument)."""
  import jax.numpy as jnp
  if kind == "cold":
    return _flush, jnp.zeros((COLD_MIB * 2**20 // 4,), jnp.float32)
  if kind == "fresh":
    return _rewrite, jnp.ones((), jnp.float32)
  return _heat, jnp.full((HOT_SIZE, HOT_SIZE), 1 / HOT_SIZE, jnp.float32)


@functools.cache
def _neighbour_kernels(kind: str) -> frozenset:
  """The names of the neighbour's kernels, which the variants after it leave out."""
  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler
  fn, arg = _neighbour(kind)
  args = (jnp.ones((1024, 1024), jnp.bfloat16), arg) if kind == "fresh" else (arg,)
  _, kernels = profiler.measure(jax.jit(fn), aggregate=False, iterations=1)(*args)
  return frozenset(name for name, _ in kernels)


def _neighboured_variants(timed: dict, kinds) -> dict:
  """``cublas`` and each ``core[...]`` once more per neighbour kind (``NEIGHBOURS``), on its
  own arguments, each call with the neighbour: ``cublas_cold``, ``core[default]_hot``, ...
  (``fresh``: each call on its x as the neighbour rewrote it)."""
  out = {}
  for kind in kinds:
    before, arg = _neighbour(kind)
    for name, (fn, fargs) in timed.items():
      if name == "cublas" or name.startswith("core["):
        if kind == "fresh":
          variant = lambda x, *a, fn=fn: fn(_rewrite(x, a[-1]), *a[:-1])  # noqa: E731
        else:
          variant = lambda *a, fn=fn, before=before: (fn(*a[:-1]), before(a[-1]))  # noqa: E731
        out[f"{name}_{kind}"] = (variant, (*fargs, arg))
  return out


def ref_full(a, w, transpose_w: bool = False):
  """One rank's matmul as the layers' XLA step runs it (``fused.xla_matmul``: a bf16 dot,
  cuBLAS's ``nvjet`` kernels on an H200), with ``transpose_w`` on a weight stored ``[N,
  K]``, which cuBLAS reads transposed in place (as in the backward passes)."""
  from taco_jax.tp.fused import xla_matmul
  return xla_matmul(a, w, transpose_w)


def ref_f32_dot(a, w):
  """The same with an fp32 result converted to bf16, which XLA fuses into a Triton GEMM
  (``gemm_fusion_dot``): the ``cublas`` baseline of the results before 2026-11-24, which
  was up to ~15% slower than cuBLAS at these shapes."""
  import jax.numpy as jnp
  return jnp.einsum("btk,kn->btn", a, w, preferred_element_type=jnp.float32).astype(a.dtype)


def _one_rank_fp8_reference(kind, smap, one):
  """The compressed reference at n = 1 (encode, decode, matmul): what ``gemm_fp8`` computes.
  Compiled without excess precision: with no collective between the encode and the decode,
  XLA would otherwise fold the FP8 round trip away (on the GPU it did, for the
  reduce-scatter's, and the reference came out uncompressed)."""
  import jax
  from jax.sharding import PartitionSpec as P
  from taco_jax.pallas_kernels import ag_matmul, matmul_rs
  if kind == "ag":
    f = lambda x, w: ag_matmul.all_gather_matmul_reference(x, w, "tensor", fp8=_ag_fp8())[0]
  else:
    f = lambda y, w: matmul_rs.matmul_reduce_scatter_reference(y, w, "tensor", fp8=FP8)
  fn = jax.jit(smap(f, mesh=one, in_specs=(P(), P()), out_specs=P()))
  return lambda a, w: fn.lower(a, w).compile(
      compiler_options={"xla_allow_excess_precision": False})(a, w)


def _core(a, w, *, tiling, sms, transpose_w=False):
  """Our GEMM core alone (``gemm.matmul``): no hooks, no copies; ``transpose_w``: w stored
  ``[N, K]``, as the backward kernels read it."""
  from taco_jax.pallas_kernels import gemm
  return (gemm.matmul(a, w, tiling=tiling, num_sms=sms, transpose_w=transpose_w),)


def _jax_gemm(a, w, cluster=None):
  """jax's Hopper matmul example on one rank's full matmul, with our default tiles (a
  ``[128, 256]`` CTA tile, strips of 8 row tiles); ``cluster`` "m" or "n": pairs of CTAs
  along M (sharing the weight's block by TMA multicast) or N (sharing x's)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  dim = {None: None, "m": hm.MatmulDimension.M, "n": hm.MatmulDimension.N}[cluster]
  cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                        grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=8,
                        cluster_dimension=dim)
  b, t, k = a.shape
  return (hm.matmul(a.reshape(b * t, k), w, None, cfg).reshape(b, t, -1),)


def _rank0(kind, a, w, tp: int, sms: int, ag, rs, encode) -> dict:
  """name -> (function, its args, what it must compute): rank 0's kernels (plain and FP8)
  in local mode at the TP shapes, for one GPU: all of that rank's tiles, epilogues and
  copies, the copies landing in a local buffer instead of on a peer, and no waiting for
  peers. The compressed kernel gets its codes made beforehand (the encode is not timed);
  the reduce-scatter's receive slots hold what ranks 1 .. tp - 1 sent it, made by running
  their kernels the same way."""
  import jax.numpy as jnp
  from taco_jax.pallas_kernels.decode import decode_reference
  from taco_jax.pallas_kernels.encode import encode_reference
  g = FP8["group_size"]
  b, t, k = a.shape
  s = t // tp
  if kind == "ag":
    w0 = w[:, :w.shape[1] // tp]
    codes, alpha, scale = encode(a.reshape(b * t, k), hadamard=False, **_ag_fp8())
    mult = ag.multipliers(alpha, scale)
    decoded = decode_reference(codes, alpha, scale, group_size=g, hadamard=False,
                               out_dtype=a.dtype)  # op by op: no fused round trip
    codes = codes.reshape(b, t, k)
    codes0 = codes[:, :s]
    mult0 = mult.reshape(-1, b, t)[:, :, :s].reshape(-1, b * s)
    plain = lambda x, v, full: ag.all_gather_matmul(
        x, v, "tensor", num_sms=sms, rank=0, local_gathered=full)[0]
    fp8 = lambda c, m, v, cf, mf: ag.all_gather_matmul_fp8(
        c, m, v, "tensor", group_size=g, num_sms=sms, rank=0, local_gathered=(cf, mf))[0]
    return {"rank0": (plain, (a[:, :s], w0, a), ref_full(a, w0)),
            "rank0_fp8": (fp8, (codes0, mult0, w0, codes, mult),
                          ref_full(decoded.reshape(b, t, k), w0))}
  f = k // tp
  ys, ws = [a[..., p * f:(p + 1) * f] for p in range(tp)], [w[p * f:(p + 1) * f]
                                                            for p in range(tp)]
  chunks = [ref_full(y, v)[:, :s].reshape(b * s, -1) for y, v in zip(ys, ws)]
  d = w.shape[1]
  out = {}
  for name, cfg in (("rank0", None), ("rank0_fp8", FP8)):
    def run(y, v, *received, p=0, cfg=cfg):
      return rs.matmul_reduce_scatter(y, v, "tensor", num_sms=sms, fp8=cfg, rank=p, n=tp,
                                      received=received)
    empty = [jnp.zeros(x.shape, x.dtype) for x in rs.slot_shapes(tp, b * s, d, a.dtype, cfg)]
    sent = [run(ys[p], ws[p], *empty, p=p)[1] for p in range(1, tp)]
    received = [e.at[1:].set(jnp.stack([got[i][0] for got in sent]))
                for i, e in enumerate(empty)]
    if cfg is None:
      want = sum(c.astype(jnp.float32) for c in chunks)
    else:  # op by op, so that no FP8 round trip is folded away
      want = sum(decode_reference(*encode_reference(c, group_size=g, hadamard=False),
                                  group_size=g, hadamard=False, out_dtype=jnp.float32)
                 for c in chunks)
    out[name] = (lambda y, v, *rec, run=run: run(y, v, *rec)[0], (ys[0], ws[0], *received),
                 want.astype(a.dtype).reshape(b, s, d))
  return out


def _variants(kind, smap, mesh, one, a_spec, w_spec, out_spec, sms, tilings, ag, rs,
              encode, rs_options=(), ag_options=()):
  """name -> (function of (a, w), runs on the one-GPU mesh). ``rs_options`` and
  ``ag_options``: (label, keyword arguments) pairs (``kernel_options``), each timed as one
  more plain kernel of its kind, ``fused[label]`` (and the all-gather's ``gemm[label]``,
  alone). The ``TRANSPOSED`` kernels take w stored ``[N, K]`` (``transposed``)."""
  from jax import lax
  from jax.sharding import PartitionSpec as P
  from taco_jax.pallas_kernels import gemm
  t = "tensor"
  out = {}

  def fused(plain, fp8, spec, out_specs):
    """``fused`` and ``fused_fp8`` (suffixed with a ``spec`` other than the default) on the
    mesh; at the default tiles also on w stored transposed (``TRANSPOSED``)."""
    sfx = "" if spec == "default" else f"[{spec}]"
    kernels = (("fused", plain), ("fused_fp8", fp8))
    for name, fn in kernels:
      out[name + sfx] = (smap(fn, mesh=mesh, in_specs=(a_spec, w_spec), out_specs=out_specs),
                         False)
    for name, fn in kernels if spec == "default" else ():
      out[name + TRANSPOSED] = (smap(functools.partial(fn, transpose_w=True), mesh=mesh,
                                     in_specs=(a_spec, transposed(w_spec)),
                                     out_specs=out_specs), False)
  if kind == "ag":
    gathered = P(None, None)
    out["xla"] = smap(lambda x, w: ag.all_gather_matmul_reference(x, w, t), mesh=mesh,
                      in_specs=(a_spec, w_spec), out_specs=(out_spec, P()))
    out["xla_fp8"] = smap(lambda x, w: ag.all_gather_matmul_reference(x, w, t, fp8=_ag_fp8()),
                          mesh=mesh, in_specs=(a_spec, w_spec), out_specs=(out_spec, P()))
    for spec in tilings.split(","):
      sfx = "" if spec == "default" else f"[{spec}]"

      def plain(x, w, spec=spec, sms=_sms(spec, sms), transpose_w=False, **options):
        w_shape = gemm.weight_kn(w.shape, transpose_w)  # the layers' tiles
        tl = _tiling(ag.plain_tiling(x.shape, w_shape, lax.axis_size(t), sms), spec)
        return ag.all_gather_matmul(x, w, t, tiling=tl, num_sms=sms, transpose_w=transpose_w,
                                    **options)

      def fp8(x, w, spec=spec, sms=_sms(spec, sms), transpose_w=False):
        w_shape = gemm.weight_kn(w.shape, transpose_w)
        tl = _tiling(ag.fp8_tiling(x.shape, w_shape, FP8["group_size"]), spec)
        b, s, k = x.shape
        codes, alpha, scale = encode(x.reshape(b * s, k), hadamard=False, **_ag_fp8())
        return ag.all_gather_matmul_fp8(
            codes.reshape(b, s, k), ag.multipliers(alpha, scale), w, t,
            group_size=FP8["group_size"], tiling=tl, num_sms=sms, transpose_w=transpose_w)

      fused(plain, fp8, spec, (out_spec, P()))
      out["gemm" + sfx] = (smap(plain, mesh=one, in_specs=(P(), P()),
                                out_specs=(P(), gathered)), True)
      out["gemm_fp8" + sfx] = (smap(fp8, mesh=one, in_specs=(P(), P()),
                                    out_specs=(P(), gathered)), True)
      for kwargs, name in _options(ag_options, spec):
        fn = functools.partial(plain, **kwargs)
        out[f"fused[{name}]"] = (smap(fn, mesh=mesh, in_specs=(a_spec, w_spec),
                                      out_specs=(out_spec, P())), False)
        out[f"gemm[{name}]"] = (smap(fn, mesh=one, in_specs=(P(), P()),
                                     out_specs=(P(), gathered)), True)
  else:
    out["xla"] = smap(lambda y, w: (rs.matmul_reduce_scatter_reference(y, w, t),), mesh=mesh,
                      in_specs=(a_spec, w_spec), out_specs=(out_spec,))
    out["xla_fp8"] = smap(lambda y, w: (rs.matmul_reduce_scatter_reference(y, w, t, fp8=FP8),),
                          mesh=mesh, in_specs=(a_spec, w_spec), out_specs=(out_spec,))
    for spec in tilings.split(","):
      sfx = "" if spec == "default" else f"[{spec}]"
      tl = _tiling(rs.TILING, spec)
      tl8 = _tiling(rs.FP8_TILING, spec)

      def plain(y, w, tl=tl, sms=_sms(spec, sms), **options):
        return (rs.matmul_reduce_scatter(y, w, t, tiling=tl, num_sms=sms, **options),)

      def fp8(y, w, tl=tl8, sms=_sms(spec, sms), **options):
        return (rs.matmul_reduce_scatter(y, w, t, tiling=tl, num_sms=sms, fp8=FP8,
                                         **options),)

      fused(plain, fp8, spec, (out_spec,))
      for kwargs, name in _options(rs_options, spec):
        out[f"fused[{name}]"] = (smap(functools.partial(plain, **kwargs),
                                      mesh=mesh, in_specs=(a_spec, w_spec),
                                      out_specs=(out_spec,)), False)
        if kwargs.keys() & RS_FP8_OPTIONS:  # the FP8 kernel's too
          out[f"fused_fp8[{name}]"] = (smap(functools.partial(fp8, **kwargs), mesh=mesh,
                                            in_specs=(a_spec, w_spec),
                                            out_specs=(out_spec,)), False)
      out["gemm" + sfx] = (smap(plain, mesh=one, in_specs=(P(), P()), out_specs=(P(),)), True)
      out["gemm_fp8" + sfx] = (smap(fp8, mesh=one, in_specs=(P(), P()), out_specs=(P(),)),
                               True)
  return out


def transposed(w_spec):
  """The partition spec of a weight stored transposed."""
  from jax.sharding import PartitionSpec as P
  return P(*reversed((*w_spec, None)[:2]))


def kernel_options(args) -> tuple[list, list]:
  """The reduce-scatter's and the all-gather's options to time beside each ``--tilings``
  entry: ``(label, keyword arguments)`` pairs, e.g. ``("pull=3", {"pull_depth": 3})``."""
  def listed(flag):
    return [x for x in getattr(args, flag).split(",") if x]

  def skips(flag):  # parts left out, joined by '+'
    return [(f"skip={x}", dict(_skip=tuple(x.split("+")))) for x in listed(flag)]
  rs = ([(f"phases={x}", dict(phases=int(x))) for x in listed("rs_phases")]
        + [(f"pull={x}", dict(pull_depth=int(x))) for x in listed("rs_pull_depth")]
        + [(f"probe={x}", dict(_probe=(x,))) for x in listed("rs_probe")]
        + skips("rs_skip"))
  return rs, skips("ag_skip") + [("chunk_waits", dict(_chunk_waits=True))] * args.ag_chunk_waits


def _options(options, spec: str):
  """(keyword arguments, the variant's bracketed name) of each kernel option to time
  beside a ``--tilings`` entry: the option's label after the entry's."""
  for label, kwargs in options:
    yield kwargs, ("" if spec == "default" else spec + "+") + label


def _ratios(case):
  v = case["variants"]
  base = v.get("cublas", {}).get("ms")
  xla = v.get("xla", {}).get("ms")
  for name, r in v.items():
    if "ms" in r and base:
      r["vs_cublas"] = r["ms"] / base
    if "ms" in r and xla:
      r["speedup_vs_xla"] = xla / r["ms"]
    if name.startswith("fused_fp8") and "kernels" in r:
      r["fp8_kernel_ms"] = sum(ms for k, ms in r["kernels"].items()
                               if "taco_all_gather_matmul" in k or "taco_matmul_reduce" in k)


def _line(case) -> str:
  parts = [f"{case['model']} {case['layer']:4s} {case['kind']}"]
  for name, r in case["variants"].items():
    if "ms" in r:
      parts.append(f"{name} {r['ms']:.3f}ms" + (f" ({r['vs_cublas']:.2f}x)" if "vs_cublas" in r
                                                  else ""))
    elif r.get("ok") is False:
      parts.append(f"{name} FAILED {r.get('error', r.get('rel_err'))}"[:200])
    elif "timing_error" in r:
      parts.append(f"{name} NOT TIMED {r['timing_error']}"[:200])
  return " | ".join(parts)


def _write(args, results):
  return write_results("bench_collective_matmul", args, results)


def main(argv=None):
  args = parse_args(argv)
  if args.smoke:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  start_watchdog()
  results = run(args)
  print(f"wrote {_write(args, results)}")


if __name__ == "__main__":
  main()
