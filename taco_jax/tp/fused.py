"""The tensor-parallel layers' collectives inside their matmul kernels
(``parallel.tp_overlap = "kernel"``): ``pallas_kernels.ag_matmul`` and ``matmul_rs``.

Same math and custom VJPs as the ring version (`taco_jax.tp.overlap`), each direction
one fused kernel:

  gather_matmul(x_BSD, w_DF)   forward: all-gather + matmul, which also returns the
      gathered x for the weight gradient; backward: dx = matmul + reduce-scatter of
      dy @ w.T, dw = x_full.T @ dy.
  matmul_scatter(y_BTF, w_FD)  forward: matmul + reduce-scatter; backward: the all-gather +
      matmul of dout @ w.T, whose gathered dout gives dw = y.T @ dout_full.
  exchange_matmul(y_BTF, w_FD) ``parallel.tp_exchange``'s out-projection: the all-to-all
      [B, T, F/tp] -> [B, T/tp, F] (``pallas_kernels.exchange``), then the matmul by the
      gathered weight (or both in one kernel: ``EXCHANGE_FORWARD``); backward: dy = the
      matmul + all-to-all back of dout @ w.T (``pallas_kernels.matmul_all_to_all``),
      dw = y_exchanged.T @ dout.

The backward kernels read w as it is stored and multiply by its transpose
(``transpose_w``), so no step copies its weights transposed. With ``model.mlp_gelu="fused"``
the MLP's two layers run as one custom VJP (``models.gelu_mlp`` on ``KernelMatmuls``), the
all-gather kernels with the GELU GEMMs' epilogues (``gelu_gemm.BiasGelu``, ``GeluGrad``);
with ``model.qkv_split="fused"`` the QKV projection's all-gather kernel writes q, k and v
apart (``models.split_qkv``, ``qkv_gemm.SplitHeads``).

Each kernel is compressed when the codec of its direction pays there: where the FP8 kernel
beat the plain one on that link, by message size and by the matmul's FLOPs per message byte
(`collectives.decide` with ``kernel=True``, measured by
`benchmarks/bench_collective_matmul.py`: FP8 pays where the link bounds the kernel); the FP8
kernels take the codec's codes (the same codes as `taco_jax.codec`). A collective that falls back
to XLA is compressed as the XLA collective would be (decided once, for that collective).

Where a kernel cannot run (no Hopper GPU; ``NCCL_P2P_DISABLE=1``, which marks runs without
peer access; a mesh of more than ``MEASURED_GPUS`` GPUs unless
``TACO_JAX_KERNELS_ANY_MESH=1``; shapes its tiles do not divide; a codec with the Hadamard
transform, which the kernels do not apply), that collective runs as the XLA collective
(`taco_jax.collectives`, compressed alike) plus the matmul, and the reason is logged once.
That path is also how the CPU tests check the custom VJPs.

Under `collectives.free_communication` (``benchmarks.bench_train``'s ``ideal_cm``), a
kernel that would run is replaced by its stand-in: the same stand-in collective as the XLA
path's, with the matmul on our GEMM core (``gemm.matmul``, the kernel's tiles) where the
XLA path has cuBLAS. So that step differs from the plain ideal only in whose matmuls run:
what our kernels could reach if their communication cost nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from taco_jax.pallas_kernels import (ag_matmul, all_to_all_matmul as all_to_all_matmul_kernel,
                                     exchange as exchange_kernel, gelu_gemm, gemm,
                                     matmul_all_to_all as matmul_all_to_all_kernel,
                                     matmul_rs, qkv_gemm)
from taco_jax.pallas_kernels.common import hopper_problem, warn_once, warned
from taco_jax.pallas_kernels.encode import encode
from taco_jax import collectives
from taco_jax.mappings import TP_OUTPUT
from taco_jax.tp.overlap import SEQ, weight_gradient
from taco_jax.codec import CompressionConfig
from taco_jax.collectives import Decided


_FALLBACK = ("parallel.tp_overlap='kernel': %s runs as XLA's collective (and so does every "
             "collective for the same reason): %s")


def _say_once(problem: str, what: str) -> None:
  """Logs, once per reason, that a collective runs as XLA's instead of in a kernel."""
  warn_once(problem, _FALLBACK, what, problem)


def fallbacks() -> list[str]:
  """Every reason for which a kernel layer ran XLA's collective so far in this process
  (what `_say_once` said), so that a benchmark can tell whether its kernels ran."""
  return warned(_FALLBACK)


# The most GPUs a step with the kernel layers was compiled and run on: 4xH200, TP=4
# (2026-11-26; it compiles in ~140 s, the Mosaic kernels' LLVM passes, and its earlier
# "hangs" were a benchmark's HLO parser). A Mosaic GPU kernel's peer clique spans every
# device of the program, whatever the TP (jaxlib's custom call, as published).
MEASURED_GPUS = 4
ANY_MESH_ENV = "TACO_JAX_KERNELS_ANY_MESH"  # "1": run the kernels on any mesh (to measure)
# The backward kernels multiply by w.T reading w as the forward pass holds it (the wgmma
# takes B transposed, at the same speed), not a copy of w.T that XLA makes per weight and
# step: 163.19 against 163.79 ms a 1.3B TP=2 step, in one process
# (bench_train_nvlink_cm_wt_2gpu_20261127). False (bench_train's ``_wcopy``): the copies.
WEIGHTS_READ_TRANSPOSED = True
# How the exchange-matmul's input gradient (the out-projection's, ``dout @ w.T`` then the
# all-to-all back) runs. "fused": one kernel that pushes each product tile to its owner
# from the epilogue (``pallas_kernels.matmul_all_to_all``): 0.0775 ms against 0.1020 for
# cuBLAS then our exchange kernel at the 1.3B TP=4 shapes, 0.1116 against 0.1532 at TP=2
# (4 and 2 H200s, bench_exchange_nvlink_mx_*_20261128), and a 1.3B step 92.99 ms against
# 93.34 at TP=4, 160.02 against 162.54 at TP=2 (bench_train_nvlink_mx_tp4 / _tp2).
# "kernel": the two apart, as before (bench_train's ``_bsplit``). "xla": cuBLAS then XLA's
# all-to-all, an asynchronous collective its scheduler may overlap with the weight
# gradient's matmul (``_bxla``; a wash against "kernel" at TP=2: 164.09 ms a 1.3B step
# against 164.57, bench_train_nvlink_bxla_xchg_kernel_2gpu_20261128).
EXCHANGE_GRADIENTS = ("fused", "kernel", "xla")
EXCHANGE_GRADIENT = "fused"
# How its forward runs: "kernel", our exchange kernel then cuBLAS's matmul (measured: the
# numbers above); "fused", one kernel whose mover SMs pull the exchanged rows while the
# others multiply the rows that have landed (``pallas_kernels.all_to_all_matmul``): 1.05-1.10x
# faster alone, a wash in the step at TP=4 (92.57 ms against 92.54,
# bench_train_nvlink_ffused24_tp4_4gpu_20261128) and slower at TP=2 (163.01 against 160.83,
# bench_train_nvlink_ffused_tp2_2gpu_20261128). "xla": XLA's all-to-all then cuBLAS, an
# asynchronous collective its scheduler may run beside independent work: what the batch
# slices of ``layers.EXCHANGE_PARTS`` ask for, whatever this says.
EXCHANGE_FORWARDS = ("kernel", "fused", "xla")
EXCHANGE_FORWARD = "kernel"


def platform_problem(devices: int) -> str | None:
  """Why no kernel can run in this process, in a program over ``devices`` GPUs, or None."""
  if problem := hopper_problem():
    return problem
  if os.environ.get("NCCL_P2P_DISABLE") == "1":
    return "NCCL_P2P_DISABLE=1: no peer access between the GPUs"
  if devices > MEASURED_GPUS and os.environ.get(ANY_MESH_ENV) != "1":
    return (f"a mesh of {devices} GPUs: the kernel step was run on up to {MEASURED_GPUS} "
            f"only; {ANY_MESH_ENV}=1 runs the kernels anyway")
  return None


def _mesh_devices(n: int) -> int:
  """The devices of the mesh being traced (at least the ``n`` of the TP axis)."""
  return max(n, jax.sharding.get_abstract_mesh().size)


def _fp8(codec: CompressionConfig) -> dict:
  return dict(group_size=codec.group_size, fmt=codec.format, dual_scale=codec.dual_scale,
              lam=codec.lam)


def _kernel_or_xla(collective: str, message, codec, n: int, misfit, flops: int):
  """``(codec, None)`` where the fused kernel of `collective` runs, else ``(codec, why
  not)`` for the XLA collective: the codec decided once for the transport that sends
  `message` (`collectives.decide`: the kernel's thresholds, given its matmul's ``flops``,
  or the collective's). Off a
  platform that runs kernels only the collective is asked; on one where the chosen kernel
  cannot take the shapes (``misfit(kernel codec)``: why not, or None) or the codec,
  the XLA collective is asked again, as it is then a different transport."""
  problem = platform_problem(_mesh_devices(n))
  if problem is None:
    kcodec = collectives.decide(collective, message, codec, n, kernel=True, flops=flops)
    if kcodec is not None and kcodec.hadamard:
      problem = "the kernels do not apply the codec's Hadamard transform"
    else:
      problem = misfit(kcodec)
    if problem is None:
      return kcodec, None
  return collectives.decide(collective, message, codec, n), problem


def all_gather_matmul(x_BSD, w_DF, axis_name, codec: CompressionConfig | None,
                      transpose_w: bool = False, epilogue: gemm.Store | None = None):
  """``(all_gather(x) @ w, all_gather(x))`` along the sequence: the fused kernel where it
  runs, else the XLA collective (the module docstring). ``transpose_w``: w is given ``[F,
  D]`` and multiplied transposed, as a backward pass holds it (no transposed copy).
  ``epilogue``: the kernel's in place of the plain store (``gelu_gemm``'s, ``qkv_gemm``'s),
  its outputs in place of the product; where no kernel runs, its ``reference`` of XLA's fp32
  product."""
  n = collectives.axis_size(axis_name, "gather_matmul", x_BSD.shape)
  w_shape = gemm.weight_kn(w_DF.shape, transpose_w)
  sms = gemm.num_sms()
  store = epilogue or gemm.Store()
  tiling = store.fit(ag_matmul.plain_tiling(x_BSD.shape, w_shape, n, sms))

  def tiles(kcodec):
    if kcodec is None:
      return tiling
    return store.fit(ag_matmul.fp8_tiling(x_BSD.shape, w_shape, kcodec.group_size))

  def misfit(kcodec):  # why the plain or the FP8 kernel cannot take these shapes, or None
    return (ag_matmul.misfit(x_BSD.shape, w_shape, tiles(kcodec), kcodec and kcodec.group_size,
                             num_sms=sms) or store.misfit(w_shape[1], tiles(kcodec)))
  b, s, d = x_BSD.shape
  flops = 2 * b * n * s * d * w_shape[1]
  codec, problem = _kernel_or_xla("all_gather", x_BSD, codec, n, misfit, flops)
  if problem is None and collectives.communication_is_free(axis_name):
    x_full = collectives.all_gather(x_BSD, axis_name, axis=SEQ, tiled=True)
    return *_core_matmul(x_full, w_DF, tiles(codec), transpose_w, store), x_full
  if problem is None and codec is None:
    return ag_matmul.all_gather_matmul(x_BSD, w_DF, axis_name, tiling=tiling, num_sms=sms,
                                       transpose_w=transpose_w, epilogue=store)
  if problem is None:
    codes, alpha, scale = encode(x_BSD.reshape(b * s, d), hadamard=False, **_fp8(codec),
                                 **codec.kernel_kwargs())
    return ag_matmul.all_gather_matmul_fp8(
        codes.reshape(b, s, d), ag_matmul.multipliers(alpha, scale), w_DF, axis_name,
        group_size=codec.group_size, dtype=x_BSD.dtype, tiling=tiles(codec), num_sms=sms,
        transpose_w=transpose_w, epilogue=store)
  _say_once(problem, f"all-gather + matmul {x_BSD.shape} @ {w_shape}")
  x_full = collectives.all_gather(x_BSD, axis_name, axis=SEQ, tiled=True,
                                  compression=Decided(codec))
  if epilogue is None:
    return xla_matmul(x_full, w_DF, transpose_w), x_full
  acc = xla_matmul(x_full, w_DF, transpose_w, preferred_element_type=jnp.float32)
  return *epilogue.reference(acc, x_BSD.dtype), x_full


def matmul_reduce_scatter(y_BTF, w_FD, axis_name, codec: CompressionConfig | None,
                          transpose_w: bool = False):
  """``reduce_scatter(y @ w)`` along the sequence: the fused kernel where it runs, else
  the matmul then the XLA collective. ``transpose_w``: w is given ``[D, F]`` (as
  `all_gather_matmul`'s)."""
  n = collectives.axis_size(axis_name, "matmul_scatter", y_BTF.shape)
  if y_BTF.shape[SEQ] % n:
    raise ValueError(f"matmul_scatter: sequence length {y_BTF.shape[SEQ]} of {y_BTF.shape} "
                     f"is not divisible by the size {n} of axis {axis_name!r}")
  w_shape = gemm.weight_kn(w_FD.shape, transpose_w)
  partial = jax.ShapeDtypeStruct((*y_BTF.shape[:-1], w_shape[1]),
                                 jnp.result_type(y_BTF, w_FD))  # y @ w, the message

  def tiling(kcodec):
    return matmul_rs.TILING if kcodec is None else matmul_rs.FP8_TILING

  def misfit(kcodec):  # why the plain or the FP8 kernel cannot take these shapes, or None
    return matmul_rs.misfit(y_BTF.shape, w_shape, n, tiling(kcodec),
                            kcodec and kcodec.group_size)
  flops = 2 * math.prod(y_BTF.shape) * w_shape[1]
  codec, problem = _kernel_or_xla("reduce_scatter", partial, codec, n, misfit, flops)
  if problem is None and collectives.communication_is_free(axis_name):
    return collectives.reduce_scatter(_core_matmul(y_BTF, w_FD, tiling(codec), transpose_w),
                                      axis_name, scatter_dimension=SEQ)
  if problem is None:
    return matmul_rs.matmul_reduce_scatter(y_BTF, w_FD, axis_name, tiling=tiling(codec),
                                           num_sms=gemm.num_sms(), transpose_w=transpose_w,
                                           fp8=codec and _fp8(codec))
  _say_once(problem, f"matmul + reduce-scatter {y_BTF.shape} @ {w_shape}")
  return collectives.reduce_scatter(xla_matmul(y_BTF, w_FD, transpose_w), axis_name,
                                    scatter_dimension=SEQ, compression=Decided(codec))


def xla_matmul(a_BTK, w, transpose_w: bool = False, preferred_element_type=None):
  """``a @ w`` (or ``a @ w.T``) by XLA, which reads a transposed weight in place: the
  layers' matmul where no kernel runs it (a bf16 dot, which XLA gives to cuBLAS on an H200;
  bench_collective_matmul's ``cublas`` baseline)."""
  return jnp.einsum("btk,nk->btn" if transpose_w else "btk,kn->btn", a_BTK, w,
                    preferred_element_type=preferred_element_type)


def _core_matmul(a_BTK, w, tiling: gemm.Tiling, transpose_w: bool,
                 epilogue: gemm.Store | None = None):
  """``a @ w`` (or ``a @ w.T``) on our GEMM core with a kernel's tiles (one CTA per
  cluster: the core in clusters is slower, and only the pulled all-gather needs them): the
  matmul of a kernel whose communication is free (the module docstring). With
  ``epilogue``: its outputs, a tuple."""
  outs = gemm.matmul_epilogue(a_BTK, w, epilogue or gemm.Store(), num_sms=gemm.num_sms(),
                              transpose_w=transpose_w, name="taco_gemm",
                              tiling=dataclasses.replace(tiling, cluster_n=1))
  return outs if epilogue else outs[0]


@dataclasses.dataclass(frozen=True)
class KernelMatmuls:
  """Where ``models.gelu_mlp`` runs the MLP's matmuls in the kernel layers, the TP
  collectives inside them: forward, the MLP-in's all-gather + matmul with the bias and the
  GELU in its epilogue (``gelu_gemm.BiasGelu``) and the MLP-out's matmul + reduce-scatter;
  backward, the MLP-out's all-gather + matmul of the output's gradient with the GELU's
  derivative in its epilogue (``gelu_gemm.GeluGrad``) and the MLP-in's matmul +
  reduce-scatter. Each falls back as the layers' kernels do (said once), the epilogues to
  their references after XLA's matmul. ``gather`` and ``scatter``: the (forward, backward)
  codecs of the MLP-in's and of the MLP-out's collectives. The kernels' outputs, and the
  gathered input the weight gradient takes, are ``TP_OUTPUT``s, as the layers' are."""
  axis_name: str
  gather: tuple
  scatter: tuple

  def problem(self, x_shape, w_in_shape) -> str | None:
    """Why no GELU epilogue can run in this process, or None (shapes that one kernel's
    tiles do not divide make that kernel fall back alone)."""
    return hopper_problem()

  def split_problem(self, x_shape, w_shape, head_dim: int) -> str | None:
    """Why no split QKV epilogue can run in this process, or None (as ``problem``)."""
    return hopper_problem()

  def stand_in(self) -> KernelMatmuls:
    """Where no kernel runs, these run XLA's collectives and the epilogues' references."""
    return self

  def in_split(self, x, w, b, head_dim: int):
    """``models.split_qkv``'s forward: the QKV projection's all-gather + matmul, with the
    bias and the split into q, k, v in its epilogue (``qkv_gemm.SplitHeads``)."""
    outs = all_gather_matmul(x, w, self.axis_name, self.gather[0],
                             epilogue=qkv_gemm.SplitHeads(b, head_dim))
    return tuple(checkpoint_name(v, TP_OUTPUT) for v in outs)  # q, k, v, the gathered x

  def in_gelu(self, x, w_in, b_in):
    outs = all_gather_matmul(x, w_in, self.axis_name, self.gather[0],
                             epilogue=gelu_gemm.BiasGelu(b_in, approx_math=True))
    return tuple(checkpoint_name(v, TP_OUTPUT) for v in outs)  # h, gelu(h), the gathered x

  def out(self, a, w_out):
    return matmul_reduce_scatter(a, w_out, self.axis_name, self.scatter[0])

  def grad_gelu(self, dy, w_out, h):
    w_t, read_transposed = _transposed(w_out)
    epilogue = gelu_gemm.GeluGrad(h, approx_math=True)
    *outs, dy_full = all_gather_matmul(dy, w_t, self.axis_name, self.scatter[1],
                                       transpose_w=read_transposed, epilogue=epilogue)
    return outs[0], epilogue.bias_gradient(outs), dy_full

  def in_grad(self, dh, w_in):
    w_t, read_transposed = _transposed(w_in)
    return matmul_reduce_scatter(dh, w_t, self.axis_name, self.gather[1],
                                 transpose_w=read_transposed)


# --- all-gather -> matmul ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_matmul(x_BSD, w_DF, axis_name, fwd: CompressionConfig | None = None,
                  bwd: CompressionConfig | None = None):
  """all_gather(x_BSD along the sequence) @ w_DF; ``fwd`` / ``bwd``: the codecs of the
  forward all-gather and of the backward reduce-scatter."""
  return all_gather_matmul(x_BSD, w_DF, axis_name, fwd)[0]


def _gather_matmul_fwd(x, w, axis_name, fwd, bwd):
  y, x_full = all_gather_matmul(x, w, axis_name, fwd)
  return y, (checkpoint_name(x_full, TP_OUTPUT), w)


def _transposed(w):
  """The backward kernels' weight and whether it is stored transposed: ``w`` itself, read
  transposed in the kernel (``WEIGHTS_READ_TRANSPOSED``), or ``w.T``, which XLA copies."""
  return (w, True) if WEIGHTS_READ_TRANSPOSED else (w.T, False)


def _gather_matmul_bwd(axis_name, fwd, bwd, res, dy):
  x_full, w = res
  w_t, read_transposed = _transposed(w)
  dx = matmul_reduce_scatter(dy.astype(x_full.dtype), w_t, axis_name, bwd,
                             transpose_w=read_transposed)
  return dx.astype(x_full.dtype), weight_gradient("btd,btf->df", x_full, dy, w.dtype)


gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


# --- matmul -> reduce-scatter --------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_scatter(y_BTF, w_FD, axis_name, fwd: CompressionConfig | None = None,
                   bwd: CompressionConfig | None = None):
  """reduce_scatter(y_BTF @ w_FD along the sequence); ``fwd`` / ``bwd``: the codecs of the
  forward reduce-scatter and of the backward all-gather."""
  return matmul_reduce_scatter(y_BTF, w_FD, axis_name, fwd)


def _matmul_scatter_fwd(y, w, axis_name, fwd, bwd):
  return matmul_reduce_scatter(y, w, axis_name, fwd), (y, w)


def _matmul_scatter_bwd(axis_name, fwd, bwd, res, dout):
  y, w = res
  w_t, read_transposed = _transposed(w)
  dy, dout_full = all_gather_matmul(dout.astype(y.dtype), w_t, axis_name, bwd,
                                    transpose_w=read_transposed)
  return dy.astype(y.dtype), weight_gradient("btf,btd->fd", y, dout_full, w.dtype)


matmul_scatter.defvjp(_matmul_scatter_fwd, _matmul_scatter_bwd)


# --- the exchange of parallel.tp_exchange --------------------------------------------------


def _all_to_all(x, axis_name, split_axis: int):
  """The exchange one way (split along 1: rows to columns; 2: back): the kernel where it
  runs, else XLA's all-to-all (the reason said once); a stand-in under free communication."""
  n = collectives.axis_size(axis_name, "exchange", x.shape)
  problem = (platform_problem(_mesh_devices(n))
             or exchange_kernel.misfit(x.shape, n, split_axis))
  if problem is None and not collectives.communication_is_free(axis_name):
    return exchange_kernel.all_to_all(x, axis_name, n=n, split_axis=split_axis,
                                      num_sms=gemm.num_sms())
  if problem is not None:
    _say_once(problem, f"all-to-all {x.shape}")
  return _xla_all_to_all(x, axis_name, split_axis)


def _xla_all_to_all(x, axis_name, split_axis: int):
  return collectives.all_to_all(x, axis_name, split_axis=split_axis, concat_axis=3 - split_axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def exchange_matmul(y_BTF, w_FD, axis_name, forward: str | None = None):
  """``all_to_all(y, split_axis=1, concat_axis=2) @ w`` over ``axis_name``: this rank's
  sequence shard of the product from every rank's columns of y, times the whole (gathered)
  weight; plain; the forward as ``forward`` says (None: ``EXCHANGE_FORWARD``). Backward:
  the input's gradient by `matmul_all_to_all`, the weight's from the exchanged y, which the
  forward keeps (``TP_OUTPUT``)."""
  return _exchange_matmul_fwd(y_BTF, w_FD, axis_name, forward)[0]


def _exchange_matmul_fwd(y, w, axis_name, forward):
  out, y_BSF = all_to_all_matmul(y, w, axis_name, forward)
  return out, (checkpoint_name(y_BSF, TP_OUTPUT), w)


def all_to_all_matmul(y_BTF, w_FD, axis_name, forward: str | None = None):
  """``(all_to_all(y, split_axis=1, concat_axis=2) @ w, the exchanged y)`` over
  ``axis_name``: as ``forward`` (None: ``EXCHANGE_FORWARD``) says, our exchange kernel then
  cuBLAS, one kernel where it runs (else the two apart, the reason said once), or XLA's
  all-to-all then cuBLAS; under free communication the stand-in all-to-all and the
  kernel's matmul on our GEMM core (XLA's for "xla")."""
  forward = EXCHANGE_FORWARD if forward is None else forward
  if forward not in EXCHANGE_FORWARDS:
    raise ValueError(f"fused.EXCHANGE_FORWARD={forward!r}: expected one of "
                     f"{EXCHANGE_FORWARDS}")
  if forward == "xla":
    y_BSF = _xla_all_to_all(y_BTF, axis_name, 1)
    return xla_matmul(y_BSF, w_FD, False), y_BSF
  if forward == "fused":
    n = collectives.axis_size(axis_name, "exchange_matmul", y_BTF.shape)
    tiling = all_to_all_matmul_kernel.default_tiling(y_BTF.shape, w_FD.shape, n)
    problem = (platform_problem(_mesh_devices(n)) or all_to_all_matmul_kernel.misfit(
        y_BTF.shape, w_FD.shape, n, tiling, num_sms=gemm.num_sms()))
    if problem is None and collectives.communication_is_free(axis_name):
      y_BSF = _xla_all_to_all(y_BTF, axis_name, 1)
      return _core_matmul(y_BSF, w_FD, tiling, False), y_BSF
    if problem is None:
      return all_to_all_matmul_kernel.all_to_all_matmul(y_BTF, w_FD, axis_name, n=n,
                                                        tiling=tiling, num_sms=gemm.num_sms())
    _say_once(problem, f"all-to-all + matmul {y_BTF.shape} @ {w_FD.shape}")
  y_BSF = _all_to_all(y_BTF, axis_name, 1)
  return xla_matmul(y_BSF, w_FD, False), y_BSF


def _exchange_matmul_bwd(axis_name, forward, res, dout):
  y_BSF, w = res
  dy = matmul_all_to_all(dout.astype(y_BSF.dtype), w, axis_name)
  return dy.astype(y_BSF.dtype), weight_gradient("bsf,bsd->fd", y_BSF, dout, w.dtype)


exchange_matmul.defvjp(_exchange_matmul_fwd, _exchange_matmul_bwd)


def matmul_all_to_all(a_BSD, w_FD, axis_name):
  """``all_to_all(a @ w.T, split_axis=2, concat_axis=1)`` over ``axis_name``, w read as
  stored: as ``EXCHANGE_GRADIENT`` says, one kernel where it runs (else the two apart, the
  reason said once); under free communication the kernel's matmul on our GEMM core and
  the stand-in all-to-all."""
  if EXCHANGE_GRADIENT not in EXCHANGE_GRADIENTS:
    raise ValueError(f"fused.EXCHANGE_GRADIENT={EXCHANGE_GRADIENT!r}: expected one of "
                     f"{EXCHANGE_GRADIENTS}")
  if EXCHANGE_GRADIENT == "xla":
    return _xla_all_to_all(xla_matmul(a_BSD, w_FD, True), axis_name, 2)
  if EXCHANGE_GRADIENT == "fused":
    n = collectives.axis_size(axis_name, "exchange_matmul", a_BSD.shape)
    w_shape = gemm.weight_kn(w_FD.shape, True)
    tiling = matmul_all_to_all_kernel.default_tiling(a_BSD.shape, w_shape, n)
    problem = (platform_problem(_mesh_devices(n)) or matmul_all_to_all_kernel.misfit(
        a_BSD.shape, w_shape, n, tiling, gemm.num_sms()))
    if problem is None and collectives.communication_is_free(axis_name):
      return _xla_all_to_all(_core_matmul(a_BSD, w_FD, tiling, True), axis_name, 2)
    if problem is None:
      return matmul_all_to_all_kernel.matmul_all_to_all(
          a_BSD, w_FD, axis_name, n=n, tiling=tiling, num_sms=gemm.num_sms(), transpose_w=True)
    _say_once(problem, f"matmul + all-to-all {a_BSD.shape} @ {w_shape}")
  return _all_to_all(xla_matmul(a_BSD, w_FD, True), axis_name, 2)
