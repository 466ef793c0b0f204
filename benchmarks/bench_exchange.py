"""``parallel.tp_exchange``'s all-to-all: our kernel (``pallas_kernels.exchange``) against
XLA's (NCCL, ``NCCL_NVLS_ENABLE=0``), at the attention's input of the GPT configs, both ways.

Per model (``--models``), on all local GPUs as one TP group, the exchange of the attention's
input ``[batch, seq, d_model / tp]`` (``forward``: rows to columns) and of its gradient
``[batch, seq / tp, d_model]`` (``backward``: back). Each variant's result is first checked
against ``lax.all_to_all`` bit for bit; one that fails is reported, not timed. Times: CUPTI
kernel durations as ``bench_collective_matmul`` measures them (median of ``--iters``), with
the cross-GPU barrier XLA runs before our kernel; ``gb_s``: the bytes a rank receives from
its peers over that time.

``matmul_backward``: the out-projection's input gradient under the exchange, ``dout [batch,
seq / tp, d_model] @ w.T`` (w ``[d_model, d_model]``, gathered, read transposed) then the
exchange back, as one kernel (``fused``: ``pallas_kernels.matmul_all_to_all``, each tile
pushed to its owner from the epilogue) against the two apart: ``cublas+kernel`` (the
layers before it, bench_train's ``_bsplit``), ``cublas+xla``, ``core+kernel`` (our GEMM core
with the fused kernel's tiles, then the exchange kernel: the fused kernel's result bit for
bit), and the matmuls alone (``cublas``, the ideal; ``core``). The variants with an exchange
are checked bit for bit, the cuBLAS ones against ``cublas+xla``, the core's against the
core then XLA's all-to-all; the matmuls alone against the product accumulated in fp32 and
rounded to bf16 (``max_rel_err`` <= 1e-2). ``fused x8``: eight calls in one program, each
output summed at once (`_chained`), against the core then XLA's all-to-all chained alike,
bit for bit, in 16 calls of the program (``wrong_calls``): the fused kernel's stores have
all landed when it ends.

``matmul_forward``: its forward, the exchange of ``y [batch, seq, d_model / tp]`` then ``@
w``, as one kernel (``fused[movers=M,depth=D]``: ``pallas_kernels.all_to_all_matmul``, M SMs
pulling the exchanged rows, D blocks in flight each, while the others multiply) against
``xla+cublas``, ``kernel+cublas`` (the layers) and ``kernel+core`` (the fused kernel's
result bit for bit), and the matmuls alone on the same number of elements; checked alike
(``fused x8`` too), and the kernel's exchanged x (``fused: x``) against XLA's all-to-all.

GPU: ``python3 benchmarks/bench_exchange.py --out-dir $OUT`` (2 or more GPUs).
CPU (--smoke): XLA's side and the checks' plumbing on fake devices.
"""
from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import (add_output_args, parse_with_smoke, run_on_devices,  # noqa: E402
                             write_results)
from benchmarks.bench_peer_copy import MIB, checked_then_timed, one_group  # noqa: E402

AXIS = "tensor"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="1.3b,2.7b")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--iters", type=int, default=20)
  add_output_args(p, label="nvlink", smoke="CPU: 8 fake devices, XLA's side only")
  return parse_with_smoke(p, argv, dict(models="tiny", batch=2, seq=512))


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from taco_jax.pallas_kernels import exchange, gemm
  from benchmarks.train_parallel import SIZES

  mesh, smap, results = one_group(AXIS)
  n, on_gpu = results["n"], results["platform"] == "gpu"
  results.update(batch=args.batch, seq=args.seq, iters=args.iters)
  for model in args.models.split(","):
    d = SIZES[model][1]  # d_model
    for way, split, shape in (("forward", 1, (args.batch, args.seq, d // n)),
                              ("backward", 2, (args.batch, args.seq // n, d))):
      x = jax.device_put(jax.random.normal(jax.random.key(split), (n * shape[0], *shape[1:]),
                                           jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
      received = (n - 1) * shape[0] * shape[1] * shape[2] * 2 // n
      case = dict(model=model, way=way, shape=list(shape), received_mib=received / MIB,
                  misfit=exchange.misfit(shape, n, split), variants={})
      results["cases"].append(case)
      xla = jax.jit(smap(lambda x, s=split: lax.all_to_all(x, AXIS, s, 3 - s, tiled=True)))
      want = xla(x)
      variants = {"xla_all_to_all": xla}
      if case["misfit"] is None:
        variants["kernel"] = jax.jit(smap(lambda x, s=split: exchange.all_to_all(
            x, AXIS, n=n, split_axis=s, num_sms=gemm.num_sms())))
      for name, fn in variants.items():
        if not on_gpu and name == "kernel":
          case["variants"][name] = dict(skipped="the kernel runs on a GPU only")
          continue
        check = case["variants"][name] = checked_then_timed(fn, (x,), want, args.iters, n,
                                                            on_gpu)
        if "ms" in check:
          check["gb_s"] = received / (check["ms"] * 1e-3) / 1e9
        write_results("bench_exchange", args, results)
      _print(case)
    _matmul_case(args, model, d, n, mesh, smap, on_gpu, results)
    _forward_case(args, model, d, n, mesh, smap, on_gpu, results)
  return results


def _matmul_case(args, model: str, d: int, n: int, mesh, smap, on_gpu: bool, results) -> None:
  """The ``matmul_backward`` case (module docstring) of one model, into ``results``."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import PartitionSpec as P
  from taco_jax.pallas_kernels import exchange, gemm, matmul_all_to_all
  from taco_jax.tp.fused import xla_matmul
  shape, w_shape = (args.batch, args.seq // n, d), (d, d)  # w [F, D], read transposed
  tiling = matmul_all_to_all.default_tiling(shape, w_shape, n)
  sms = gemm.num_sms()
  a, w = _inputs(mesh, n, shape, w_shape, seed=3)
  case = dict(model=model, way="matmul_backward", shape=list(shape), w_shape=list(w_shape),
              tiling=str(tiling), variants={},
              misfit=matmul_all_to_all.misfit(shape, w_shape, n, tiling, sms))
  results["cases"].append(case)

  def cublas(a, w):  # the layers' matmul by the weight read transposed
    return xla_matmul(a, w, transpose_w=True)

  def core(a, w):
    return gemm.matmul(a, w, tiling=tiling, num_sms=sms, transpose_w=True)

  def xla_back(y):
    return lax.all_to_all(y, AXIS, 2, 1, tiled=True)

  def kernel_back(y):
    return exchange.all_to_all(y, AXIS, n=n, split_axis=2, num_sms=sms)

  both = functools.partial(smap, in_specs=(P(AXIS), P()))
  variants = {"cublas+xla": lambda a, w: xla_back(cublas(a, w)),
              "cublas+kernel": lambda a, w: kernel_back(cublas(a, w)),
              "core+kernel": lambda a, w: kernel_back(core(a, w)),
              "fused": lambda a, w: matmul_all_to_all.matmul_all_to_all(
                  a, w, AXIS, n=n, num_sms=sms, tiling=tiling, transpose_w=True),
              "cublas": cublas, "core": core}
  variants["fused x8"] = _chained(variants["fused"])
  wants = {"cublas+xla": "cublas+xla", "cublas+kernel": "cublas+xla", "cublas": "fp32",
           "core+kernel": "core+xla", "fused": "core+xla", "core": "fp32",
           "fused x8": "core+xla x8"}
  fns = {k: jax.jit(both(f)) for k, f in variants.items()}
  ours_run = on_gpu and case["misfit"] is None
  refs = {"cublas+xla": fns["cublas+xla"](a, w), "fp32": jax.jit(both(
      lambda a, w: jnp.einsum("bsk,nk->bsn", a, w, preferred_element_type=jnp.float32)
      .astype(a.dtype)))(a, w)}
  if ours_run:
    refs["core+xla"] = jax.jit(both(lambda a, w: xla_back(core(a, w))))(a, w)
    refs["core+xla x8"] = jax.jit(both(_chained(lambda a, w: xla_back(core(a, w)))))(a, w)
  _check_and_time(args, results, case, fns, refs, wants, (a, w), n, on_gpu, ours_run,
                  xla_only=("cublas+xla", "cublas"))


def _forward_case(args, model: str, d: int, n: int, mesh, smap, on_gpu: bool, results):
  """The ``matmul_forward`` case (module docstring) of one model, into ``results``."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import PartitionSpec as P
  from taco_jax.pallas_kernels import all_to_all_matmul, exchange, gemm
  from taco_jax.tp.fused import xla_matmul as cublas  # the layers' matmul
  shape, w_shape = (args.batch, args.seq, d // n), (d, d)
  tiling = all_to_all_matmul.default_tiling(shape, w_shape, n)
  sms = gemm.num_sms()
  y, w = _inputs(mesh, n, shape, w_shape, seed=5)
  case = dict(model=model, way="matmul_forward", shape=list(shape), w_shape=list(w_shape),
              tiling=str(tiling), variants={},
              misfit=all_to_all_matmul.misfit(shape, w_shape, n, tiling, num_sms=sms))
  results["cases"].append(case)

  def exchanged_shape(y):  # y's elements as the exchanged x [B, S, D] (for the matmuls alone)
    b, t, c = y.shape
    return y.reshape(b, t // n, c * n)

  def core(x, w):
    return gemm.matmul(x, w, tiling=tiling, num_sms=sms)

  def xla_fwd(y):
    return lax.all_to_all(y, AXIS, 1, 2, tiled=True)

  def kernel_fwd(y):
    return exchange.all_to_all(y, AXIS, n=n, split_axis=1, num_sms=sms)

  def fused(movers=all_to_all_matmul.MOVERS, depth=all_to_all_matmul.DEPTH, output=0):
    return lambda y, w: all_to_all_matmul.all_to_all_matmul(
        y, w, AXIS, n=n, num_sms=sms, movers=movers, depth=depth, tiling=tiling)[output]

  tried = [(12, 4), (16, 4), (24, 4), (32, 4), (16, 6), (24, 6)]  # (movers, depth)
  variants = {"xla+cublas": lambda y, w: cublas(xla_fwd(y), w),
              "kernel+cublas": lambda y, w: cublas(kernel_fwd(y), w),
              "kernel+core": lambda y, w: core(kernel_fwd(y), w),
              **{f"fused[movers={m},depth={d}]": fused(m, d) for m, d in tried},
              "fused: x": fused(output=1),
              "fused x8": _chained(fused()),
              "cublas": lambda y, w: cublas(exchanged_shape(y), w),
              "core": lambda y, w: core(exchanged_shape(y), w)}
  wants = {k: "xla+core" for k in variants if k.startswith(("fused[", "kernel+core"))}
  wants.update({"xla+cublas": "xla+cublas", "kernel+cublas": "xla+cublas",
                "fused: x": "xla", "fused x8": "xla+core x8", "cublas": "fp32", "core": "fp32"})
  both = functools.partial(smap, in_specs=(P(AXIS), P()))
  fns = {k: jax.jit(both(f)) for k, f in variants.items()}
  ours_run = on_gpu and case["misfit"] is None
  refs = {"xla+cublas": fns["xla+cublas"](y, w), "fp32": jax.jit(both(
      lambda y, w: jnp.einsum("bsf,fd->bsd", exchanged_shape(y), w,
                              preferred_element_type=jnp.float32).astype(y.dtype)))(y, w)}
  if ours_run:
    refs["xla"] = jax.jit(both(lambda y, w: xla_fwd(y)))(y, w)
    refs["xla+core"] = jax.jit(both(lambda y, w: core(xla_fwd(y), w)))(y, w)
    refs["xla+core x8"] = jax.jit(both(_chained(lambda y, w: core(xla_fwd(y), w))))(y, w)
  _check_and_time(args, results, case, fns, refs, wants, (y, w), n, on_gpu, ours_run,
                  xla_only=("xla+cublas", "cublas"))


def _inputs(mesh, n: int, shape, w_shape, seed: int):
  """Random bf16 inputs: each rank's ``shape`` sharded over the group, and a square weight
  of ``w_shape`` (scaled by one over the square root of its width) on every rank."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  ka, kw = jax.random.split(jax.random.key(seed))
  a = jax.device_put(jax.random.normal(ka, (n * shape[0], *shape[1:]), jnp.bfloat16),
                     NamedSharding(mesh, P(AXIS)))
  w = jax.device_put(jax.random.normal(kw, w_shape, jnp.bfloat16) * w_shape[1] ** -0.5,
                     NamedSharding(mesh, P()))
  return a, w


def _check_and_time(args, results, case, fns, refs, wants, inputs, n: int, on_gpu: bool,
                    ours_run: bool, xla_only: tuple[str, ...]) -> None:
  """Each of ``fns`` checked against ``refs[wants[name]]`` (bit for bit; to bf16 rounding
  against "fp32") and timed, into ``case``; those with our kernels (all but ``xla_only``)
  only where they run."""
  for name, fn in fns.items():
    if name not in xla_only and not ours_run:
      case["variants"][name] = dict(skipped=case["misfit"] if on_gpu else
                                    "the kernels run on a GPU only")
      continue
    rtol = 1e-2 if wants[name] == "fp32" else None  # the matmuls alone: bf16 rounding
    case["variants"][name] = checked_then_timed(fn, inputs, refs[wants[name]], args.iters, n,
                                                on_gpu, rtol=rtol,
                                                repeats=16 if name.endswith(" x8") else 1)
    write_results("bench_exchange", args, results)
  _print(case)


def _chained(fn, times: int = 8):
  """``fn`` called ``times`` times in one program, each output read at once by the sum that
  follows (w scaled by 1, 2, ...): a kernel whose stores landed after it returned, or whose
  peers' did, would leave the sum wrong."""
  import jax.numpy as jnp

  def chained(a, w):
    total = 0.0
    for i in range(times):
      total = total + fn(a, w * (i + 1)).astype(jnp.float32)
    return total
  return chained


def _print(case) -> None:
  timed = {k: v["ms"] for k, v in case["variants"].items() if "ms" in v}
  print(f"{case['model']} {case['way']} {tuple(case['shape'])}: "
        + ", ".join(f"{k} {ms:.4f} ms" for k, ms in timed.items())
        + "".join(f" {k} FAILED: {v.get('error', 'wrong result')[:300]}"
                  for k, v in case["variants"].items() if v.get("ok") is False), flush=True)


def main(argv=None):
  return run_on_devices("bench_exchange", parse_args(argv), run)


if __name__ == "__main__":
  main()
