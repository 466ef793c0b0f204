"""GPT's MLP with the GELU inside its GEMMs (``model.mlp_gelu='fused'``).

``gelu(x @ w_in + b_in) @ w_out``, the local part of the MLP (each rank's columns of the
hidden layer under tensor parallelism), as one custom VJP:

* forward: ``h, a = matmul_bias_gelu(x, w_in, b_in)`` (the bias and the GELU applied in the
  GEMM's epilogue), then ``a @ w_out``;
* backward: ``dh = matmul_gelu_grad(dy, w_out, h)`` (the GELU's derivative applied in the
  epilogue of the GEMM that makes the gradient at ``a``), then the weight and input
  gradients as XLA's dots.

XLA runs the activation as passes over ``[tokens, d_ff]`` of their own, forward and backward;
at the 1.3B model on one H200 the kernels take 0.91x (forward) and 0.90x (backward) the time
of cuBLAS plus XLA's fusions (``benchmarks/probe_gelu_gemm.py``), and a training step 0.977x
(256.10 ms against 261.94, 2.2 GiB more at its peak: bench_train's ``_gelu``). Their tanh is
the GPU's approximation (``tanh.approx``, relative error ~2^-11, under bf16's rounding of the
result).

Under remat the backward needs ``h`` and ``a``: they are named ``MLP_GELU``, as is the
product, and ``parallel.save_dots`` keeps them (in place of the MLP-in's matmul output).
Where the kernels cannot run (no Hopper GPU, tiles that do not divide the shapes) the MLP
runs XLA's way, said once.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from taco_jax.pallas_kernels.common import hopper_problem, warn_once

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gelu_mlp(x_BTD, w_DF, b_F, w_FD, kernels: bool = True):
  """``gelu(x @ w_in + b_in) @ w_out`` (tanh GELU) in x's dtype; ``kernels``: on the GELU
  GEMMs (else the same math in jnp, as the kernels' references compute it: the CPU
  tests' stand-in)."""
  return _gelu_mlp_fwd(x_BTD, w_DF, b_F, w_FD, kernels)[0]


def _kernel_or_reference(kernels: bool, name: str):
  """``gelu_gemm``'s kernel ``name`` on this GPU (fast tanh), or its jnp reference."""
  from taco_jax.pallas_kernels import gelu_gemm, gemm
  if not kernels:
    return getattr(gelu_gemm, f"{name}_reference")
  return functools.partial(getattr(gelu_gemm, name), num_sms=gemm.num_sms(), approx_math=True)


def _gelu_mlp_fwd(x, w_in, b_in, w_out, kernels):
  h, a = _kernel_or_reference(kernels, "matmul_bias_gelu")(x, w_in, b_in)
  h, a = checkpoint_name(h, MLP_GELU), checkpoint_name(a, MLP_GELU)
  y = jnp.einsum("...f,fd->...d", a, w_out)
  return y, (x, w_in, b_in, h, a, w_out)


def _gelu_mlp_bwd(kernels, res, dy):
  x, w_in, b_in, h, a, w_out = res
  dy = dy.astype(x.dtype)
  dh = _kernel_or_reference(kernels, "matmul_gelu_grad")(dy, w_out, h)
  dw_out = jnp.einsum("...f,...d->fd", a, dy).astype(w_out.dtype)
  dw_in = jnp.einsum("...d,...f->df", x, dh).astype(w_in.dtype)
  db_in = jnp.sum(dh, axis=tuple(range(dh.ndim - 1)), dtype=jnp.float32).astype(b_in.dtype)
  dx = jnp.einsum("...f,df->...d", dh, w_in)
  return dx, dw_in, db_in, dw_out


gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)


def fused_mlp(mlp_in, mlp_out, x_BTD):
  """The block's MLP through ``gelu_mlp``, or None where it cannot run (said once): where a
  layer has no local matmul to give (``fused_operands`` None or ``fused_takes`` False: the
  TP layers whose collectives run inside their matmuls), or where the kernels cannot run
  (with ``STAND_IN``, the jnp stand-in runs there instead)."""
  operands = mlp_in.fused_operands(x_BTD)
  if operands is None or not mlp_out.fused_takes():
    warn_once("tp_overlap", _FALLBACK, "the TP layers' collectives run inside their matmuls")
    return None
  x, w_in, b_in = operands
  w_out = mlp_out.kernel[...].astype(x.dtype)
  problem = kernel_problem(x.shape, w_in.shape)
  if problem is not None and not STAND_IN:
    warn_once(problem, _FALLBACK, problem)
    return None
  y = checkpoint_name(gelu_mlp(x, w_in, b_in, w_out, problem is None), MLP_GELU)
  return mlp_out.fused_output(y)
