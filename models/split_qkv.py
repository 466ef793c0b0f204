"""GPT's attention inputs q, k, v straight out of the QKV projection's GEMM
(``model.qkv_split='fused'``).

The projection's columns are laid out head-major, ``[heads, 3 (q|k|v), head_dim]``, and
the attention takes q, k and v dense, so XLA adds the bias and slices them out of the
projection's output in a pass of its own (1.3B on one H200: 0.096 ms a layer). Here the
GEMM's epilogue adds the bias and writes each sub-tile into q, k or v
(``pallas_kernels.qkv_gemm``): 0.915x cuBLAS plus that pass at the 1.3B QKV (0.546 against
0.596 ms), and 0.88x in the kernel layers' all-gather kernel at TP=2 and 4
(``benchmarks/probe_qkv_gemm.py``). One custom VJP:

* forward: ``q, k, v = matmul_bias_split(x, w, b)``;
* backward: q's, k's and v's gradients interleaved back into the projection's layout and
  the bias's summed, as autodiff of XLA's slices gives them (``slices``; XLA runs both as one
  fusion), then the input's gradient (in the kernel layers the matmul + reduce-scatter
  kernel) and the weight's (``overlap.weight_gradient``).

Where the matmuls run is the layers' to say (``fused_operands``, as for ``gelu_mlp``):
``gelu_mlp.LocalMatmuls`` (TP = 1, or after XLA's all-gather) or the kernel layers'
``taco_jax.tp.fused.KernelMatmuls``. Under remat q, k and v are named ``QKV_SPLIT`` and
``parallel.save_dots`` keeps them (in place of the projection's matmul output). Where the
kernel cannot run (no Hopper GPU, shapes its tiles do not divide) or the layers give no
matmul (the ring layers), the projection runs XLA's way, said once.
"""
from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from taco_jax.pallas_kernels.common import warn_once
from taco_jax.tp.overlap import weight_gradient

QKV_SPLIT = "qkv_split"
QKV_SPLITS = ("xla", "fused")
_FALLBACK = "model.qkv_split='fused': XLA slices q, k, v out of the QKV projection (%s)"
# Where the kernel cannot run, the same math in jnp instead of XLA's slices (CPU tests)
STAND_IN = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def split_qkv(x_BTD, w_DF, b_F, head_dim: int, matmuls):
  """``(q, k, v)`` of ``y = x @ w + b``, y's columns ``[heads, 3, head_dim]``: each
  ``[..., heads * head_dim]`` in x's dtype, the matmul where ``matmuls`` runs it."""
  return _split_qkv_fwd(x_BTD, w_DF, b_F, head_dim, matmuls)[0]


def _split_qkv_fwd(x, w, b, head_dim, matmuls):
  *qkv, x_w = matmuls.in_split(x, w, b, head_dim)
  return tuple(checkpoint_name(a, QKV_SPLIT) for a in qkv), (x_w, w, b)


def split_heads(y, head_dim: int):
  """q, k, v sliced out of the QKV projection's output y, its columns ``[heads, 3,
  head_dim]``: each ``[..., heads * head_dim]`` (XLA's pass over y)."""
  y = y.reshape(*y.shape[:-1], -1, 3, head_dim)
  return tuple(y[..., p, :].reshape(*y.shape[:-3], -1) for p in range(3))


def slices(y, b, head_dim: int):
  """XLA's way: ``y + b`` (b rounded to y's dtype), then ``split_heads``."""
  return split_heads(y + b.astype(y.dtype), head_dim)


def _split_qkv_bwd(head_dim, matmuls, res, grads):
  x_w, w, b = res
  y = jax.ShapeDtypeStruct((*grads[0].shape[:-1], w.shape[1]), x_w.dtype)
  # the gradients at y and b as autodiff of XLA's slices gives them (q's, k's and v's
  # interleaved and the bias's sum in one fusion; summed apart they took 1.8x as long)
  dy, db = jax.linear_transpose(functools.partial(slices, head_dim=head_dim), y, b)(grads)
  return (matmuls.in_grad(dy, w).astype(x_w.dtype),
          weight_gradient("...d,...f->df", x_w, dy, w.dtype), db)


split_qkv.defvjp(_split_qkv_fwd, _split_qkv_bwd)


def fused_qkv(qkv, x_BTD, head_dim: int):
  """The block's q, k, v ``[..., heads * head_dim]`` through ``split_qkv``, the matmul where
  the QKV layer says (``fused_operands``), or None where it cannot run (said once): the
  ring layers, or where the kernel cannot run (with ``STAND_IN``, the jnp stand-in runs
  there instead)."""
  operands = qkv.fused_operands(x_BTD)
  if operands is None:
    warn_once("tp_overlap", _FALLBACK, "the ring layers' collectives run inside their "
              "matmuls")
    return None
  x, w, b, matmuls = operands
  problem = matmuls.split_problem(x.shape, w.shape, head_dim)
  if problem is not None:
    if not STAND_IN:
      warn_once(problem, _FALLBACK, problem)
      return None
    matmuls = matmuls.stand_in()
  return split_qkv(x, w, b, head_dim, matmuls)
