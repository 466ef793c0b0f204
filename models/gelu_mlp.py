"""GPT's MLP with the GELU inside its GEMMs (``model.mlp_gelu='fused'``).

``gelu(x @ w_in + b_in) @ w_out``, the local part of the MLP (each rank's columns of the
hidden layer under tensor parallelism), as one custom VJP:

* forward: ``h, a = matmul_bias_gelu(x, w_in, b_in)`` (the bias and the GELU applied in the
  GEMM's epilogue), then ``a @ w_out``;
* backward: ``dh, db_in = matmul_gelu_grad(dy, w_out, h)`` (the GELU's derivative applied
  in the epilogue of the GEMM that makes the gradient at ``a``, which also sums the bias's
  gradient), then the weight and input gradients as XLA's dots (the weights' as the TP
  layers' are: ``overlap.weight_gradient``).

XLA runs the activation as passes over ``[tokens, d_ff]`` of their own, forward and backward;
at the 1.3B model on one H200 the kernels take 0.91x (forward) and 0.90x (backward) the time
of cuBLAS plus XLA's fusions (``benchmarks/probe_gelu_gemm.py``), and a training step 0.977x
(256.10 ms against 261.94, 2.2 GiB more at its peak: bench_train's ``_gelu``). Their tanh is
the GPU's approximation (``tanh.approx``, relative error ~2^-11, under bf16's rounding of the
result).

Where the four matmuls run is the layers' to say (``fused_operands``): ``LocalMatmuls`` on
this device's operands (TP = 1, or after XLA's all-gather), or with the kernel layers
(``parallel.tp_overlap="kernel"``) ``taco_jax.tp.fused.KernelMatmuls``, whose all-gather
kernels apply the bias and GELU, and the GELU's derivative, in their epilogues, the
collectives inside the matmuls as the layers' are (on one H200, as rank 0 of TP=2 in local
mode: 0.87x and 0.88x the all-gather kernel plus XLA's activation,
``probe_gelu_gemm --all-gather``).

Under remat the backward needs ``h`` and ``a``: they are named ``MLP_GELU``, as is the
product, and ``parallel.save_dots`` keeps them (in place of the MLP-in's matmul output).
Where the kernels cannot run (no Hopper GPU, tiles that do not divide the shapes) the MLP
runs XLA's way, said once; the ring layers (``tp_overlap="ring"``) keep XLA's GELU.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from taco_jax.pallas_kernels.common import hopper_problem, warn_once
from taco_jax.tp.overlap import weight_gradient

MLP_GELU = "mlp_gelu"
MLP_GELUS = ("xla", "fused")
_FALLBACK = "model.mlp_gelu='fused': the MLP runs XLA's GELU (%s)"
# Where the kernels cannot run, the same math in jnp instead of XLA's GELU (CPU tests)
STAND_IN = False


def kernel_problem(x_shape, w_in_shape) -> str | None:
  """Why the GELU GEMMs cannot run ``[..., D] @ [D, F]`` here, or None."""
  from taco_jax.pallas_kernels import gelu_gemm
  m, (d, f) = math.prod(x_shape[:-1]), w_in_shape
  return hopper_problem() or (gelu_gemm.misfit(m, d, f, gelu_gemm.FORWARD_TILING)
                              or gelu_gemm.misfit(m, d, f, gelu_gemm.TILING))


@dataclasses.dataclass(frozen=True)
class LocalMatmuls:
  """Where ``gelu_mlp``'s four matmuls, and ``split_qkv``'s, run: here, on this device's
  operands (TP = 1, or after XLA's all-gather), on our GEMMs with epilogues (``kernels``;
  the GPU's fast tanh) or their jnp references, and XLA's dots. The kernel layers'
  (``taco_jax.tp.fused.KernelMatmuls``) run them with the TP collectives inside."""
  kernels: bool = True

  def problem(self, x_shape, w_in_shape) -> str | None:
    """Why the GELU GEMMs cannot run here (``kernel_problem``), or None."""
    return kernel_problem(x_shape, w_in_shape)

  def split_problem(self, x_shape, w_shape, head_dim: int) -> str | None:
    """Why the split QKV GEMM (``qkv_gemm``) cannot run here, or None."""
    from taco_jax.pallas_kernels import qkv_gemm
    (d, f), m = w_shape, math.prod(x_shape[:-1])
    return hopper_problem() or qkv_gemm.misfit(m, d, f, head_dim, qkv_gemm.FORWARD_TILING)

  def stand_in(self) -> LocalMatmuls:
    """The same math in jnp (the kernels' references)."""
    return LocalMatmuls(kernels=False)

  def _gelu_gemm(self, name: str):
    from taco_jax.pallas_kernels import gelu_gemm, gemm
    if not self.kernels:
      return getattr(gelu_gemm, f"{name}_reference")
    return functools.partial(getattr(gelu_gemm, name), num_sms=gemm.num_sms(),
                             approx_math=True)

  def in_gelu(self, x, w_in, b_in):
    """``(h, gelu(h), x as the weight gradient takes it)``, ``h = x @ w_in + b_in``."""
    return *self._gelu_gemm("matmul_bias_gelu")(x, w_in, b_in), x

  def in_split(self, x, w, b, head_dim: int):
    """``(q, k, v, x as the weight gradient takes it)`` of ``x @ w + b``
    (``split_qkv``)."""
    from taco_jax.pallas_kernels import gemm, qkv_gemm
    if not self.kernels:
      return *qkv_gemm.matmul_bias_split_reference(x, w, b, head_dim=head_dim), x
    return *qkv_gemm.matmul_bias_split(x, w, b, head_dim=head_dim, num_sms=gemm.num_sms()), x

  def out(self, a, w_out):
    """The MLP's output from the activation."""
    return jnp.einsum("...f,fd->...d", a, w_out)

  def grad_gelu(self, dy, w_out, h):
    """``(dh, db, dy as the weight gradient takes it)``: the gradients at h and at the
    MLP-in's bias (fp32), from the output's."""
    return *self._gelu_gemm("matmul_gelu_grad")(dy, w_out, h), dy

  def in_grad(self, dh, w_in):
    """The gradient at x from the gradient at h (or at the QKV projection's output)."""
    return jnp.einsum("...f,df->...d", dh, w_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gelu_mlp(x_BTD, w_DF, b_F, w_FD, matmuls=LocalMatmuls()):
  """``gelu(x @ w_in + b_in) @ w_out`` (tanh GELU) in x's dtype, its matmuls where
  ``matmuls`` runs them (``LocalMatmuls(kernels=False)``: the same math in jnp, as the
  kernels' references compute it: the CPU tests' stand-in)."""
  return _gelu_mlp_fwd(x_BTD, w_DF, b_F, w_FD, matmuls)[0]


def _gelu_mlp_fwd(x, w_in, b_in, w_out, matmuls):
  h, a, x_w = matmuls.in_gelu(x, w_in, b_in)
  h, a = checkpoint_name(h, MLP_GELU), checkpoint_name(a, MLP_GELU)
  return matmuls.out(a, w_out), (x_w, w_in, b_in, h, a, w_out)


def _gelu_mlp_bwd(matmuls, res, dy):
  x_w, w_in, b_in, h, a, w_out = res
  dh, db_in, dy_w = matmuls.grad_gelu(dy.astype(x_w.dtype), w_out, h)
  dw_out = weight_gradient("...f,...d->fd", a, dy_w, w_out.dtype)
  dw_in = weight_gradient("...d,...f->df", x_w, dh, w_in.dtype)
  return (matmuls.in_grad(dh, w_in).astype(x_w.dtype), dw_in, db_in.astype(b_in.dtype),
          dw_out)


gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)


def fused_mlp(mlp_in, mlp_out, x_BTD):
  """The block's MLP through ``gelu_mlp``, its matmuls where the layers say
  (``fused_operands``), or None where it cannot run (said once): where a layer cannot give
  its matmul (``fused_operands`` None or ``fused_takes`` False: the ring layers, whose
  collectives run inside their matmuls), or where the kernels cannot run (with
  ``STAND_IN``, the jnp stand-in runs there instead)."""
  operands = mlp_in.fused_operands(x_BTD)
  if operands is None or not mlp_out.fused_takes():
    warn_once("tp_overlap", _FALLBACK, "the ring layers' collectives run inside their matmuls")
    return None
  x, w_in, b_in, matmuls = operands
  w_out = mlp_out.kernel[...].astype(x.dtype)
  problem = matmuls.problem(x.shape, w_in.shape)
  if problem is not None:
    if not STAND_IN:
      warn_once(problem, _FALLBACK, problem)
      return None
    matmuls = matmuls.stand_in()
  y = checkpoint_name(gelu_mlp(x, w_in, b_in, w_out, matmuls), MLP_GELU)
  return mlp_out.fused_output(y)
