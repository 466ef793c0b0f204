"""The MLP's GELU in the GEMMs' epilogues (``pallas_kernels.gelu_gemm``) against what XLA
runs (cuBLAS, then the activation as a fusion of its own), at the 1.3B model's MLP shapes
(M = 16384 tokens, D = 2048, F = 8192 / tp), device time (CUPTI), each result checked
against an fp32 reference of the same math:

  forward   xla:   y = x @ w (cuBLAS), a = gelu(y + b)          -> y, a (the step keeps y)
            fused: h, a = matmul_bias_gelu(x, w, b)
  backward  xla:   g = dout @ w2.T (cuBLAS), dh = g * gelu'(y + b), db = sum(dh)
            fused: dh, db = matmul_gelu_grad(dout, w2, h)   (db summed in the epilogue;
                   ``[..+db=xla]``: by XLA from dh, as before the epilogue summed it)

plus cuBLAS and our GEMM core alone on the same product (what the epilogue costs on top);
``[unfactored]``: the backward kernel with the GELU's derivative as written before it was
factored into fewer operations (``unfactored_grad``).
With ``--all-gather`` (tp > 1), the same two passes through the kernel layers' all-gather
kernel (``ag_matmul``) in local mode on one GPU, rank 0 of tp: the peers' chunks read from
a pre-gathered input, what goes to rank r - 1 written locally; its plain store then XLA's
activation (``ag_*_xla``) against the GELU epilogues (``ag_*_fused``: what
``fused.KernelMatmuls`` runs); ``[pulled]``: on the pulled schedule (clusters of 2),
``[fp8]``: the compressed kernel, checked against the same math on the decoded codes and not
timed (its call encodes the whole gathered input, local mode's stand-in for the peers').
Rounds of calls take turns on the same inputs.

GPU: python benchmarks/probe_gelu_gemm.py --out-dir $OUT
CPU: python benchmarks/probe_gelu_gemm.py --smoke   (tiny shapes, interpret mode, untimed)
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import epilogue_probe  # noqa: E402

TOL = 2e-2


def _gelu(y):
  return jax.nn.gelu(y, approximate=True)


@functools.cache
def unfactored_grad():
  """``gelu_gemm.GeluGrad`` with the GELU's derivative as written before it was factored
  (2026-11-29): a registered subclass."""
  from taco_jax.pallas_kernels import gelu_gemm
  c, k = gelu_gemm._C, gelu_gemm._K

  def gelu_grad(h):
    t = jnp.tanh(c * (h + k * h * h * h))
    return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * k * h * h)

  class Unfactored(gelu_gemm.GeluGrad):
    name, derivative = "_gelu_grad_unfactored", staticmethod(gelu_grad)
  return jax.tree_util.register_pytree_node_class(Unfactored)


def variants(sms: int, tiling=None) -> dict:
  """name -> (pass, function of the pass's inputs); ``[approx]``: the kernel with the GPU's
  fast tanh, ``[stages=3]`` with three pipeline stages."""
  from taco_jax.pallas_kernels import gelu_gemm, gemm
  kw = dict(num_sms=sms, **({"tiling": tiling} if tiling else {}))
  core_tiling = tiling or gemm.Tiling()

  def xla_fwd(x, w, b, dout, w2, h):
    y = x @ w
    return y, _gelu(y + b.astype(y.dtype))

  def fused_fwd(x, w, b, dout, w2, h, **opts):
    return gelu_gemm.matmul_bias_gelu(x, w, b, **{**kw, **opts})

  def xla_bwd(x, w, b, dout, w2, h):
    g = dout @ w2.T
    _, vjp = jax.vjp(lambda y: _gelu(y + b.astype(y.dtype)), h)
    dh, = vjp(g)
    return dh, jnp.sum(dh, axis=0, dtype=jnp.float32)

  def fused_bwd(x, w, b, dout, w2, h, **opts):
    return gelu_gemm.matmul_gelu_grad(dout, w2, h, **{**kw, **opts})

  def unfactored_bwd(x, w, b, dout, w2, h):
    epilogue = unfactored_grad()(h, approx_math=True)
    outs = gemm.matmul_epilogue(dout, w2, epilogue, num_sms=sms, transpose_w=True,
                                tiling=tiling or gelu_gemm.TILING)
    return outs[0], epilogue.bias_gradient(outs)

  approx = functools.partial(fused_fwd, approx_math=True)
  three = functools.partial(fused_fwd, tiling=tiling or gelu_gemm.TILING)
  # wider epilogue sub-tiles: half as many stores a tile (three stages leave room for them)
  wide = functools.partial(fused_fwd, approx_math=True, tiling=tiling or dataclasses.replace(
      gelu_gemm.TILING, epi_n=128))
  return {
      "forward_xla": ("forward", xla_fwd), "forward_fused": ("forward", fused_fwd),
      "forward_fused[approx]": ("forward", approx), "forward_fused[stages=3]": ("forward", three),
      "forward_fused[approx+stages=3+epi_n=128]": ("forward", wide),
      "backward_xla": ("backward", xla_bwd), "backward_fused": ("backward", fused_bwd),
      "backward_fused[approx]": ("backward", functools.partial(fused_bwd, approx_math=True)),
      "backward_fused[approx+db=xla]": ("backward", functools.partial(
          fused_bwd, approx_math=True, bias_grad=False)),
      "backward_fused[approx+unfactored]": ("backward", unfactored_bwd),
      "cublas": ("matmul", lambda x, w, *_: (x @ w,)),
      "core": ("matmul", lambda x, w, *_: (gemm.matmul(x, w, num_sms=sms,
                                                        tiling=core_tiling),)),
  }


BATCH = 8  # sequences of the all-gather variants' [B, T, D] activations
FP8 = epilogue_probe.FP8


def all_gather_variants(sms: int, tp: int, tiling=None, fp8: bool = True) -> dict:
  """name -> (pass, function of the all-gather inputs ``(x shard, gathered x, w, b, dout
  shard, gathered dout, w2, h)``): the kernel in local mode as rank 0 of ``tp``; its rows
  come out ``[M, .]`` as the one-GPU variants'. ``fp8``: with the compressed kernel's (which
  jax's interpreter does not run: its decoded operand is a register one)."""
  from taco_jax.pallas_kernels import gelu_gemm

  def kernel(x, x_full, w, epilogue=None, transpose_w=False, pulled=False, fp8=False):
    return epilogue_probe.rank0_all_gather(x, x_full, w, tp=tp, sms=sms, tiling=tiling,
                                           epilogue=epilogue, transpose_w=transpose_w,
                                           pulled=pulled, fp8=fp8)

  def xla_fwd(x, x_full, w, b, dout, dout_full, w2, h):
    y, = kernel(x, x_full, w)
    return y, _gelu(y + b.astype(y.dtype))

  def fused_fwd(x, x_full, w, b, dout, dout_full, w2, h, **opts):
    return kernel(x, x_full, w, gelu_gemm.BiasGelu(b, approx_math=True), **opts)

  def xla_bwd(x, x_full, w, b, dout, dout_full, w2, h):
    g, = kernel(dout, dout_full, w2, transpose_w=True)
    _, vjp = jax.vjp(lambda y: _gelu(y + b.astype(y.dtype)), h.reshape(g.shape))
    dh, = vjp(g)
    return dh, jnp.sum(dh, axis=0, dtype=jnp.float32)

  def fused_bwd(x, x_full, w, b, dout, dout_full, w2, h, bias_grad=True, **opts):
    epilogue = gelu_gemm.GeluGrad(h, approx_math=True, bias_grad=bias_grad)
    outs = kernel(dout, dout_full, w2, epilogue, True, **opts)
    return outs[0], epilogue.bias_gradient(outs)
  out = {"ag_forward_xla": ("forward", xla_fwd), "ag_forward_fused": ("forward", fused_fwd),
         "ag_backward_xla": ("backward", xla_bwd), "ag_backward_fused": ("backward", fused_bwd),
         "ag_backward_fused[db=xla]": ("backward", functools.partial(fused_bwd,
                                                                     bias_grad=False))}
  for kind, fn in (("forward", fused_fwd), ("backward", fused_bwd)):
    out[f"ag_{kind}_fused[pulled]"] = (kind, functools.partial(fn, pulled=True))
    if fp8:
      out[f"ag_{kind}_fused[fp8]"] = (f"{kind}_fp8", functools.partial(fn, fp8=True))
  return out


def _all_gather_args(tp: int, batch: int, x, w, b, dout, w2, h):
  """The all-gather variants' inputs from the one-GPU variants' ``[M, .]`` ones, as
  ``batch`` sequences."""
  def seq(a):
    return a.reshape(batch, -1, a.shape[-1])

  def shard(a):
    return seq(a)[:, :seq(a).shape[1] // tp]
  return shard(x), seq(x), w, b, shard(dout), seq(dout), w2, seq(h)


def _references(x, w, b, dout, w2, h):
  """fp32 math of each pass: (y or h, a), (dh, db), (x @ w,)."""
  f32 = jnp.float32
  y = jnp.dot(x, w, preferred_element_type=f32)
  hh = y + b
  g = jnp.dot(dout, w2.T, preferred_element_type=f32)
  from taco_jax.pallas_kernels.gelu_gemm import gelu, gelu_grad
  h32 = h.astype(f32)
  dh = g * gelu_grad(h32 + b)
  return {"forward": (hh, gelu(hh)), "backward": (dh, dh.sum(0)), "matmul": (y,)}


def probe(m: int, d: int, f: int, sms: int, iters: int, rounds: int, timed: bool,
          tiling=None, all_gather_tp: int = 0, batch: int = BATCH) -> dict:
  from benchmarks.bench_collective_matmul import rel_err
  ks = jax.random.split(jax.random.key(m + d + f), 5)
  bf16 = jnp.bfloat16
  x = jax.random.normal(ks[0], (m, d), jnp.float32).astype(bf16)
  w = (jax.random.normal(ks[1], (d, f), jnp.float32) / math.sqrt(d)).astype(bf16)
  b = 0.1 * jax.random.normal(ks[2], (f,), jnp.float32)
  dout = (1e-2 * jax.random.normal(ks[3], (m, d), jnp.float32)).astype(bf16)
  w2 = (jax.random.normal(ks[4], (f, d), jnp.float32) / math.sqrt(f)).astype(bf16)
  # the backward's pre-activation: what the forward saved (y for XLA, which adds b again)
  y = jnp.dot(x, w, preferred_element_type=jnp.float32)
  args = dict(xla=(x, w, b, dout, w2, y.astype(bf16)),
              fused=(x, w, b, dout, w2, (y + b).astype(bf16)))
  refs = _references(x, w, b, dout, w2, y.astype(bf16))
  if all_gather_tp:  # the compressed kernels' inputs: the codec's decoded codes
    from taco_jax.pallas_kernels.decode import decode_reference
    from taco_jax.pallas_kernels.encode import encode
    dec = [decode_reference(*encode(a, hadamard=False, **FP8), group_size=FP8["group_size"],
                            hadamard=False) for a in (x, dout)]
    fp8_refs = _references(dec[0], w, b, dec[1], w2, y.astype(bf16))
    refs.update(forward_fp8=fp8_refs["forward"], backward_fp8=fp8_refs["backward"])
  case = dict(m=m, d=d, f=f, sms=sms, variants={})
  fns = variants(sms, tiling)
  if all_gather_tp:
    fns.update(all_gather_variants(sms, all_gather_tp, tiling, fp8=tiling is None))
    for kind in ("xla", "fused"):
      args[f"ag_{kind}"] = _all_gather_args(all_gather_tp, batch, *args[kind])
    case["all_gather_tp"] = all_gather_tp

  def inputs(name):
    return args[("ag_" if name.startswith("ag_") else "") + (
        "fused" if "fused" in name else "xla")]
  for name, (kind, fn) in fns.items():
    fargs = inputs(name)
    got = jax.jit(fn)(*fargs)
    want = refs[kind]
    if name.endswith("forward_xla"):  # XLA's first output is y, without the bias
      want = (want[0] - b, want[1])
    errs = [rel_err(g, r) for g, r in zip(got, want)]
    case["variants"][name] = dict(kind=kind, rel_err=errs, ok=max(errs) < TOL, ms=[])
  if timed:
    pairs = {f"{kind}_fused_over_xla": (f"{kind}_fused", f"{kind}_xla")
             for kind in ("forward", "backward", "ag_forward", "ag_backward")}
    pairs.update(backward_db_fused_over_xla_sum=(
                     "backward_fused[approx]", "backward_fused[approx+db=xla]"),
                 ag_backward_db_fused_over_xla_sum=(
                     "ag_backward_fused", "ag_backward_fused[db=xla]"),
                 backward_factored_over_unfactored=(
                     "backward_fused[approx]", "backward_fused[approx+unfactored]"))
    epilogue_probe.time_and_compare(
        case, {name: (fn, inputs(name)) for name, (_, fn) in fns.items()}, iters, rounds,
        pairs)
  return case


def main(argv=None):
  args = epilogue_probe.parse_args(argv, __doc__.splitlines()[0], "8192")
  if args.smoke:
    with epilogue_probe.smoke_run() as tiling:
      case = probe(256, 128, 256, 2, 1, 1, timed=False, tiling=tiling,
                   all_gather_tp=2 if args.all_gather else 0, batch=1)
    return epilogue_probe.smoke_verdict(case)
  from taco_jax.pallas_kernels import gemm
  sms = gemm.num_sms()
  cases = [probe(16384, 2048, 8192 // int(tp), sms, args.iters, args.rounds, timed=True,
                 all_gather_tp=int(tp) if args.all_gather and int(tp) > 1 else 0)
           for tp in args.tp.split(",")]
  epilogue_probe.report("probe_gelu_gemm", cases, "f", args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
