"""The attention's q, k and v split out of the QKV projection inside its GEMM's epilogue
(Pallas Mosaic GPU, Hopper).

GPT's QKV projection ``y = x @ w + b`` lays its columns out head-major, ``[heads, 3 (q|k|v),
head_dim]``, so that a tensor-parallel shard is whole heads. The attention takes q, k and v
as dense arrays ``[..., heads, head_dim]``, so XLA slices them out of y: a pass that reads
and writes all of it (1.3B on one H200: 0.096 ms a layer, 2.3 ms a step). Here the epilogue
adds the bias and stores each ``[epi_m, epi_n]`` sub-tile of y straight into q, k or v,
whichever its columns belong to: the same values, and no pass.

* ``matmul_bias_split(x, w, b, head_dim=...)``: ``(q, k, v)``, each ``[..., heads *
  head_dim]``, on the GEMM core (``gemm.matmul_epilogue``); the all-gather kernels take the
  same epilogue (``SplitHeads``) with the TP collective inside
  (``taco_jax.tp.fused.KernelMatmuls``).
* ``matmul_bias_split_reference``: the same in jnp.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm

PARTS = 3  # q, k, v
FORWARD_TILING = gemm.Tiling()


@jax.tree_util.register_pytree_node_class
class SplitHeads(gemm.AddBias):
  """The epilogue of ``y = acc + b``, y's columns ``[heads, PARTS, head_dim]``: y written as
  ``PARTS`` outputs ``[rows, heads * head_dim]`` (q, k, v), in the output dtype. Each
  sub-tile's columns lie in one head's part (``misfit``), so that one TMA store puts it in
  place."""
  name = "_bias_split"
  setting_fields = ("head_dim",)

  def __init__(self, bias_N, head_dim: int):
    super().__init__(bias_N)
    self.head_dim = head_dim

  def misfit(self, n: int, tiling: gemm.Tiling) -> str | None:
    return heads_misfit(n, self.head_dim, tiling)

  def outputs(self, m, n, dtype):
    self.check_width(n, "matmul_bias_split")
    return (jax.ShapeDtypeStruct((m, n // PARTS), dtype),) * PARTS

  def reference(self, acc, dtype):
    y, = super().reference(acc, dtype)
    *lead, n = y.shape
    y = y.reshape(*lead, n // (PARTS * self.head_dim), PARTS, self.head_dim)
    return tuple(y[..., p, :].reshape(*lead, n // PARTS) for p in range(PARTS))

  def store(self, t, ins, outs, scratch, acc, row, col, wg):
    hd, out_smem = self.head_dim, scratch["out_smem"]
    for k, (rows, cols, y) in enumerate(self.biased(t, scratch, acc, wg, outs[0].dtype)):
      c = col + cols.start
      part, out_col = c // hd % PARTS, c // (PARTS * hd) * hd + c % hd
      dest = (pl.ds(row + rows.start, t.epi_m), pl.ds(out_col, t.epi_n))
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      out_smem[wg, k % 2] = y
      plgpu.commit_smem()
      for p, out_ref in enumerate(outs):
        @pl.when(part == p)
        def _store(out_ref=out_ref):
          plgpu.copy_smem_to_gmem(out_smem.at[wg, k % 2], out_ref.at[dest])


def matmul_bias_split_reference(x, w_KN, b_N, *, head_dim: int):
  """``(q, k, v)`` of ``y = x @ w + b`` (fp32 accumulation, then x's dtype), x ``[..., K]``,
  y's columns ``[heads, 3, head_dim]``: each ``[..., heads * head_dim]``."""
  acc = jnp.dot(x, w_KN, preferred_element_type=jnp.float32)
  return SplitHeads(b_N, head_dim).reference(acc, x.dtype)


def heads_misfit(n: int, head_dim: int, tiling: gemm.Tiling) -> str | None:
  """Why ``SplitHeads`` cannot split ``n`` columns on ``tiling``'s sub-tiles, or None."""
  if n % (PARTS * head_dim):
    return f"{n} columns are not whole heads of {PARTS} x {head_dim}"
  if head_dim % tiling.epi_n:
    return f"epilogue sub-tiles of {tiling.epi_n} columns straddle heads of {head_dim}"
  return None


def misfit(m: int, k: int, n: int, head_dim: int, tiling: gemm.Tiling) -> str | None:
  """Why the kernel cannot take an ``[m, k] @ [k, n]`` product on ``tiling``, or None."""
  if tiling.cluster_n != 1:
    return "the split QKV GEMM runs without clusters (cluster_n = 1)"
  return (heads_misfit(n, head_dim, tiling)
          or tiling.misfit(rows_per_seq=tiling.cta_m, m=m, n=n, k=k))


def matmul_bias_split(x, w_KN, b_N, *, head_dim: int, num_sms: int,
                      tiling: gemm.Tiling = FORWARD_TILING):
  """``(q, k, v)`` as ``matmul_bias_split_reference``: the GEMM core with the
  ``SplitHeads`` epilogue."""
  *lead, k = x.shape
  if w_KN.shape[0] != k:
    raise ValueError(f"matmul_bias_split: {x.shape} and the weight {w_KN.shape} do not "
                     "contract")
  reason = misfit(math.prod(lead), k, w_KN.shape[1], head_dim, tiling)
  if reason:
    raise ValueError(f"matmul_bias_split: {reason}")
  return gemm.matmul_epilogue(x, w_KN, SplitHeads(b_N, head_dim), tiling=tiling,
                              num_sms=num_sms, name="taco_matmul")
