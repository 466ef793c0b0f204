"""The attention's q, k, v split out of the QKV projection in its GEMM's epilogue
(``pallas_kernels.qkv_gemm``) against what XLA runs (cuBLAS, then the bias and the slices
as a fusion of their own), at the 1.3B model's QKV shapes (M = 16384 tokens, D = 2048,
N = 3 D / tp, heads of 128), device time (CUPTI), each result checked against an fp32
reference:

  xla:    y = x @ w (cuBLAS); q, k, v = (y + b) sliced per head      -> q, k, v
  fused:  q, k, v = matmul_bias_split(x, w, b)
  core:   our GEMM core, then XLA's bias and slices (what the epilogue alone saves)
  cublas: x @ w alone (the floor: no bias, no split)

With ``--all-gather`` (tp > 1), the kernel layers' all-gather kernel (``ag_matmul``, the
layers' tiles) in local mode on one GPU, rank 0 of tp: its plain store then XLA's bias and
slices (``ag_xla``) against the ``SplitHeads`` epilogue (``ag_fused``, what
``fused.KernelMatmuls`` runs); ``ag_fused[fp8]``: the compressed kernel, checked against the
same math on the decoded codes and not timed. Rounds of calls take turns on the same inputs.

GPU: python benchmarks/probe_qkv_gemm.py --all-gather --out-dir $OUT
CPU: python benchmarks/probe_qkv_gemm.py --smoke   (tiny shapes, interpret mode, untimed)
"""
from __future__ import annotations

import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import epilogue_probe  # noqa: E402
from taco_jax.models.split_qkv import slices  # noqa: E402  (XLA's bias and slices)

TOL = 2e-2
BATCH = 8  # sequences of the all-gather variants' [B, T, D] activations
FP8 = epilogue_probe.FP8


def variants(sms: int, head_dim: int, tiling=None) -> dict:
  """name -> function of ``(x, w, b)`` on one GPU."""
  from taco_jax.pallas_kernels import gemm, qkv_gemm
  kw = dict(num_sms=sms, **({"tiling": tiling} if tiling else {}))
  return {
      "xla": lambda x, w, b: slices(x @ w, b, head_dim),
      "fused": lambda x, w, b: qkv_gemm.matmul_bias_split(x, w, b, head_dim=head_dim, **kw),
      "core": lambda x, w, b: slices(gemm.matmul(x, w, **kw), b, head_dim),
      "cublas": lambda x, w, b: (x @ w,),
  }


def all_gather_variants(sms: int, tp: int, head_dim: int, tiling=None,
                        fp8: bool = True) -> dict:
  """name -> function of ``(x shard, gathered x, w, b)``: the all-gather kernel in local
  mode as rank 0 of ``tp``, its outputs ``[M, .]`` as the one-GPU variants'."""
  from taco_jax.pallas_kernels import qkv_gemm

  def kernel(x, x_full, w, b, split: bool, fp8: bool = False):
    epilogue = qkv_gemm.SplitHeads(b, head_dim) if split else None
    outs = epilogue_probe.rank0_all_gather(x, x_full, w, tp=tp, sms=sms, tiling=tiling,
                                           epilogue=epilogue, fp8=fp8)
    return tuple(outs) if split else slices(outs[0], b, head_dim)

  out = {"ag_xla": lambda *a: kernel(*a, split=False),
         "ag_fused": lambda *a: kernel(*a, split=True)}
  if fp8:
    out["ag_fused[fp8]"] = lambda *a: kernel(*a, split=True, fp8=True)
  return out


def probe(m: int, d: int, n: int, head_dim: int, sms: int, iters: int, rounds: int,
          timed: bool, tiling=None, all_gather_tp: int = 0, batch: int = BATCH) -> dict:
  from benchmarks.bench_collective_matmul import rel_err
  ks = jax.random.split(jax.random.key(m + d + n), 3)
  bf16 = jnp.bfloat16
  x = jax.random.normal(ks[0], (m, d), jnp.float32).astype(bf16)
  w = (jax.random.normal(ks[1], (d, n), jnp.float32) / math.sqrt(d)).astype(bf16)
  b = 0.1 * jax.random.normal(ks[2], (n,), jnp.float32)

  def reference(x):
    return slices(jnp.dot(x, w, preferred_element_type=jnp.float32), b, head_dim)
  refs = {"split": reference(x), "matmul": (jnp.dot(x, w, preferred_element_type=jnp.float32),)}
  fns = {name: (fn, (x, w, b)) for name, fn in variants(sms, head_dim, tiling).items()}
  if all_gather_tp:
    from taco_jax.pallas_kernels.decode import decode_reference
    from taco_jax.pallas_kernels.encode import encode
    x_full = x.reshape(batch, -1, d)
    ag_args = (x_full[:, :x_full.shape[1] // all_gather_tp], x_full, w, b)
    fns.update({name: (fn, ag_args) for name, fn in all_gather_variants(
        sms, all_gather_tp, head_dim, tiling, fp8=tiling is None).items()})
    refs["split_fp8"] = reference(decode_reference(
        *encode(x, hadamard=False, **FP8), group_size=FP8["group_size"], hadamard=False))
  case = dict(m=m, d=d, n=n, head_dim=head_dim, sms=sms, all_gather_tp=all_gather_tp,
              variants={})
  for name, (fn, args) in fns.items():
    want = refs["matmul" if name == "cublas" else "split_fp8" if "[fp8]" in name else "split"]
    errs = [rel_err(g, r) for g, r in zip(jax.jit(fn)(*args), want)]
    case["variants"][name] = dict(rel_err=errs, ok=max(errs) < TOL)
  if timed:
    epilogue_probe.time_and_compare(case, fns, iters, rounds, dict(
        fused_over_xla=("fused", "xla"), fused_over_core=("fused", "core"),
        core_over_cublas=("core", "cublas"), ag_fused_over_xla=("ag_fused", "ag_xla")))
  return case


def main(argv=None):
  args = epilogue_probe.parse_args(argv, __doc__.splitlines()[0], "6144")
  if args.smoke:
    with epilogue_probe.smoke_run() as tiling:
      case = probe(256, 128, 192, 32, 2, 1, 1, timed=False, tiling=tiling,
                   all_gather_tp=2 if args.all_gather else 0, batch=1)
    return epilogue_probe.smoke_verdict(case)
  from taco_jax.pallas_kernels import gemm
  sms = gemm.num_sms()
  cases = [probe(16384, 2048, 6144 // int(tp), 128, sms, args.iters, args.rounds, timed=True,
                 all_gather_tp=int(tp) if args.all_gather and int(tp) > 1 else 0)
           for tp in args.tp.split(",")]
  epilogue_probe.report("probe_qkv_gemm", cases, "n", args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
