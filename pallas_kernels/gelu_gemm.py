"""The MLP's GELU inside its GEMMs' epilogues (Pallas Mosaic GPU, Hopper).

XLA runs the MLP's activation as passes of their own over ``[tokens, d_ff]``: at the 1.3B
model on one H200, 0.75 ms a layer (forward 0.22, backward 0.53), about 7% of a step, where
the two GEMMs beside it could apply it to their accumulators on the way out (cuBLASLt's
GELU and DGELU epilogues, which XLA does not use: ``benchmarks/probe_epilogue.py``).

* ``matmul_bias_gelu(x, w, b)``: ``h = x @ w + b`` and ``a = gelu(h)`` (tanh form), both
  written by the epilogue of one GEMM: the MLP-in's forward. ``h`` is what the backward
  needs, ``a`` what the MLP-out multiplies.
* ``matmul_gelu_grad(g, w, h)``: ``dh = (g @ w.T) * gelu'(h)``, with ``w`` as stored
  ``[N, K]`` (the MLP-out's weight, read transposed): the gradient at ``h`` straight from
  the GEMM that makes the gradient at ``a``, each tile's ``h`` loaded while its matmul runs,
  and the MLP-in bias's gradient (dh summed over rows), summed from the fp32 product in the
  same epilogue rather than by a pass of XLA's over dh.

Both run on the GEMM core (``gemm.TileLoop``) and round as the XLA ops they replace where
those round: ``h`` to the compute dtype before the GELU and its derivative, computed in
fp32 from it. The gradient at ``a`` is not rounded before the product (XLA's is, once).
``*_reference`` say what each computes, in jnp. ``approx_math``: the GPU's tanh
approximation (relative error ~2^-11, below bf16's rounding of the results), 0.05-0.06 ms a
call faster at the 1.3B shapes (benchmarks/probe_gelu_gemm.py).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm

_C, _K = math.sqrt(2 / math.pi), 0.044715
# The forward kernel's tiles: its bias takes 1 KB, so four stages fit (three took as long:
# probe_gelu_gemm_tune_1gpu_20261129). The backward kernel's: ``TILING``, below.
FORWARD_TILING = gemm.Tiling()


def gelu(h32):
  """GELU, tanh form (``jax.nn.gelu(approximate=True)``), of fp32 values."""
  return 0.5 * h32 * (1 + jnp.tanh(_C * (h32 + _K * h32 * h32 * h32)))


def gelu_grad(h32):
  """d gelu(h) / dh of fp32 values (tanh form). With t = tanh(c (h + k h^3)),
  0.5 (1 + t) + 0.5 h (1 - t^2) c (1 + 3 k h^2), factored as
  0.5 (1 + t) (1 + (1 - t) h c (1 + 3 k h^2)) with t = tanh(h (c + c k h^2)): fewer
  operations on each element of the epilogue, 1.3-1.6% off the backward kernel at the 1.3B
  shapes (``benchmarks/probe_gelu_gemm.py``'s ``[unfactored]``). The forward's ``gelu``,
  factored alike, ran 1% slower, and keeps its form."""
  h2 = h32 * h32
  t = jnp.tanh(h32 * (_C + (_C * _K) * h2))
  return (0.5 + 0.5 * t) * (1 + (1 - t) * (h32 * (_C + (3 * _C * _K) * h2)))


def matmul_bias_gelu_reference(x, w_KN, b_N):
  """``(h, gelu(h))`` with ``h = x @ w + b``, x ``[..., K]`` (fp32 accumulation, then x's
  dtype)."""
  return BiasGelu(b_N).reference(jnp.dot(x, w_KN, preferred_element_type=jnp.float32),
                                 x.dtype)


def matmul_gelu_grad_reference(g, w_NK, h):
  """``(dh, db)``: ``dh = (g @ w.T) * gelu'(h)``, g ``[..., K]``, h ``[..., N]`` (fp32
  accumulation and product, then g's dtype), and ``db``, fp32 ``[N]``, the sum of that fp32
  product over rows (the bias's gradient)."""
  epilogue = GeluGrad(h)
  outs = epilogue.reference(jnp.dot(g, w_NK.T, preferred_element_type=jnp.float32), g.dtype)
  return outs[0], epilogue.bias_gradient(outs)


def misfit(m: int, k: int, n: int, tiling: gemm.Tiling) -> str | None:
  """Why the kernels cannot take an ``[m, k] @ [k, n]`` product on ``tiling``, or None."""
  if tiling.cluster_n != 1:
    return "the GELU GEMMs run without clusters (cluster_n = 1)"
  return tiling.misfit(rows_per_seq=tiling.cta_m, m=m, n=n, k=k)  # rows: any runs of tiles


def _check(what, a_shape, w_kn, tiling):
  *_, k = a_shape
  m = math.prod(a_shape[:-1])
  wk, n = w_kn
  if wk != k:
    raise ValueError(f"{what}: {a_shape} and the weight's [K, N] {w_kn} do not contract")
  reason = misfit(m, k, n, tiling)
  if reason:
    raise ValueError(f"{what}: {reason}")
  return m, k, n


# ``GeluGrad`` sums the MLP-in bias's gradient in its epilogue (else XLA sums dh after it:
# bench_train's ``_dbxla``)
BIAS_GRAD = True
# The rows of dh that ``GeluGrad`` sums into each row of its bias-gradient output: one
# warp's share of a warpgroup's 64 accumulator rows
BIAS_ROWS = 16


def warp_column_sums(value, dest) -> None:
  """Writes the sums over each warp's 16 rows of ``value``, a compute warpgroup's fp32
  ``[64, n]`` accumulator (WGMMA layout), to the gmem ref ``dest`` ``[4, n]`` (warp w's to
  row w): each thread adds its two rows of a column, butterfly shuffles add the eight lanes
  that share its columns, and four lanes a warp store. No warp waits for another. (Mosaic
  GPU's ``jnp.sum`` over all 64 rows meets the warps in shared memory at one offset for the
  whole CTA, where the two compute warpgroups would race; given a scratch each, its barriers
  made the kernel slower than XLA's pass over dh: ``results/reverted/*_db_xwarp_*``.) Under
  jax's GPU interpreter, which runs no inline Mosaic GPU, it is ``jnp.sum``."""
  if gemm.interpreting():
    dest[...] = jnp.sum(value.reshape(-1, BIAS_ROWS, value.shape[-1]), axis=1)
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def column_sums(ctx, v, dest):
    del ctx
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    n = v.shape[1]
    if v.layout != mgpu.WGMMA_LAYOUT or v.shape[0] != 64:
      raise NotImplementedError(f"warp_column_sums: {v.shape} in {v.layout}")
    # thread t of warp w holds rows 16 w + t // 4 (+ 8) of columns 8 j + 2 (t % 4) (+ 1)
    regs = v.registers.reshape(n // 8, 2)
    tid = mgpu_utils.thread_idx()
    lane = arith.remui(tid, mgpu_utils.c(32, i32))
    warp = arith.remui(arith.divui(tid, mgpu_utils.c(32, i32)), mgpu_utils.c(4, i32))
    col = arith.muli(arith.remui(lane, mgpu_utils.c(4, i32)), mgpu_utils.c(2, i32))
    sums = []
    for j in range(n // 8):
      part = arith.addf(regs[j, 0], regs[j, 1])
      for distance in (4, 8, 16):
        part = arith.addf(part, mgpu_utils.shfl_bfly(part, distance))
      sums.append(part)
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, lane, mgpu_utils.c(4, i32))):
      for j, part in enumerate(sums):
        at = arith.addi(col, mgpu_utils.c(8 * j, i32))
        vector.store(part, dest, [arith.index_cast(index, warp), arith.index_cast(index, at)])
  column_sums(value, dest)


@jax.tree_util.register_pytree_node_class
class BiasGelu(gemm.AddBias):
  """The epilogue ``h = acc + b``, ``a = gelu(h)``: both written, in the output dtype (the
  compute dtype: h is rounded to it before the GELU)."""
  name = "_bias_gelu"
  setting_fields = ("approx_math",)

  def __init__(self, bias_N, approx_math: bool = False):
    super().__init__(bias_N)
    self.approx_math = approx_math

  def outputs(self, m, n, dtype):
    self.check_width(n, "matmul_bias_gelu")
    return (jax.ShapeDtypeStruct((m, n), dtype),) * 2

  def reference(self, acc, dtype):
    h, = super().reference(acc, dtype)
    return h, gelu(h.astype(jnp.float32)).astype(dtype)

  def store(self, t, ins, outs, scratch, acc, row, col, wg):
    h_ref, a_ref = outs
    slot = 0
    for rows, cols, h in self.biased(t, scratch, acc, wg, h_ref.dtype):
      a = gelu(h.astype(jnp.float32)).astype(h_ref.dtype)
      dest = (pl.ds(row + rows.start, t.epi_m), pl.ds(col + cols.start, t.epi_n))
      for out_ref, value in ((h_ref, h), (a_ref, a)):
        gemm.stage_out(value, scratch["out_smem"], wg, slot, out_ref.at[dest])
        slot ^= 1


@jax.tree_util.register_pytree_node_class
class GeluGrad(gemm.Store):
  """The epilogue ``dh = acc * gelu'(h)``, h ``[rows, N]`` as the output's rows. Each compute
  warpgroup's h tile is copied into shared memory as its tile starts (after the last
  tile's stores have read theirs); the epilogue writes the product over it, and stores it
  from there. With ``bias_grad`` it also sums the fp32 product over each block of
  ``BIAS_ROWS`` rows, a second output ``[rows / BIAS_ROWS, N]`` (``reference``'s: one row)
  whose sum over rows is the MLP-in bias's gradient (``bias_gradient``), so that no pass
  reads dh again for it."""
  name = "_gelu_grad"
  derivative = staticmethod(gelu_grad)  # of fp32 values (a subclass may change it)
  array_fields, setting_fields = ("h_MN",), ("approx_math", "bias_grad")
  row_outputs = 1  # dh; the sums have a row per BIAS_ROWS
  staged = False  # stores from its h tile's buffer
  # its h tiles take 64 KB (two warpgroups' [64, 256] or [128, 128]): three stages of
  # [128, 64] A and [64, 256] B blocks (48 KB each) fit beside them, four do not; the GEMM
  # core is about as fast at three as at four at the 1.3B shapes
  # (bench_collective_matmul_nvlink_rs_stages_2gpu_20261128)
  max_stages = 3

  def __init__(self, h_XN, approx_math: bool = False, bias_grad: bool | None = None):
    self.h_MN, self.approx_math = h_XN.reshape(-1, h_XN.shape[-1]), approx_math
    self.bias_grad = BIAS_GRAD if bias_grad is None else bias_grad

  def outputs(self, m, n, dtype):
    if self.h_MN.shape != (m, n):
      raise ValueError(f"matmul_gelu_grad: h {self.h_MN.shape} is not {(m, n)}")
    db_rows = (jax.ShapeDtypeStruct((m // BIAS_ROWS, n), jnp.float32),) * self.bias_grad
    return (jax.ShapeDtypeStruct((m, n), dtype), *db_rows)

  def scratch(self, t):
    return dict(h_smem=plgpu.SMEM((gemm.COMPUTE_WGS, t.tile_m, t.tile_n), self.h_MN.dtype,
                                  transforms=gemm.swizzled(t.tile_n, self.h_MN.dtype)),
                h_barrier=plgpu.Barrier(num_barriers=gemm.COMPUTE_WGS))

  def reference(self, acc, dtype):
    h = self.h_MN.reshape(acc.shape).astype(jnp.float32)
    dh = acc * self.derivative(h)
    db_rows = (dh.reshape(-1, dh.shape[-1]).sum(0, keepdims=True),) * self.bias_grad
    return (dh.astype(dtype), *db_rows)

  def bias_gradient(self, outs):
    """The MLP-in bias's gradient, fp32 ``[N]``: from this epilogue's outputs ``outs``
    (the rows it summed, or, without ``bias_grad``, the sum of dh)."""
    if self.bias_grad:
      return outs[1].sum(0)
    return jnp.sum(outs[0].reshape(-1, outs[0].shape[-1]), axis=0, dtype=jnp.float32)

  @staticmethod
  def _tile(t, row, col):
    return pl.ds(row, t.tile_m), pl.ds(col, t.tile_n)

  def before_tile(self, t, ins, scratch, row, col, wg):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's product is out
    plgpu.copy_gmem_to_smem(ins[0].at[self._tile(t, row, col)], scratch["h_smem"].at[wg],
                            scratch["h_barrier"].at[wg])

  def store(self, t, ins, outs, scratch, acc, row, col, wg):
    plgpu.barrier_wait(scratch["h_barrier"].at[wg])
    h_smem = scratch["h_smem"]
    for rows, cols in gemm.sub_tiles(t):
      part = h_smem.at[wg, pl.ds(rows.start, t.epi_m), pl.ds(cols.start, t.epi_n)]
      dh = acc[rows, cols] * self.derivative(part[...].astype(jnp.float32))
      part[...] = dh.astype(outs[0].dtype)
      for i in range(t.epi_m // 64) if self.bias_grad else ():  # each warpgroup row block
        first = (row + rows.start + 64 * i) // BIAS_ROWS
        warp_column_sums(dh[64 * i:64 * (i + 1)], outs[1].at[
            pl.ds(first, 64 // BIAS_ROWS), pl.ds(col + cols.start, t.epi_n)])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem.at[wg], outs[0].at[self._tile(t, row, col)])


# The backward kernel's tiles: as many stages as leave room for its h tiles.
TILING = gemm.Tiling(stages=GeluGrad.max_stages)


def matmul_bias_gelu(x, w_KN, b_N, *, num_sms: int, tiling: gemm.Tiling = FORWARD_TILING,
                     approx_math: bool = False):
  """``(h, a)``: ``h = x @ w + b`` and ``a = gelu(h)``, x ``[..., K]``, both ``[..., N]`` in
  x's dtype (``matmul_bias_gelu_reference``): the GEMM core with the ``BiasGelu``
  epilogue."""
  _check("matmul_bias_gelu", x.shape, w_KN.shape, tiling)
  return gemm.matmul_epilogue(x, w_KN, BiasGelu(b_N, approx_math), tiling=tiling,
                              num_sms=num_sms, name="taco_matmul")


def matmul_gelu_grad(g, w_NK, h, *, num_sms: int, tiling: gemm.Tiling = TILING,
                     approx_math: bool = False, bias_grad: bool | None = None):
  """``(dh, db)`` as ``matmul_gelu_grad_reference``: the GEMM core with the ``GeluGrad``
  epilogue, w ``[N, K]`` read transposed. ``bias_grad`` (default ``BIAS_GRAD``): ``db``
  summed in the epilogue, else by XLA from dh (one more pass over it)."""
  *lead, _ = g.shape
  _, _, n = _check("matmul_gelu_grad", g.shape, gemm.weight_kn(w_NK.shape, True), tiling)
  if h.shape != (*lead, n):
    raise ValueError(f"matmul_gelu_grad: h {h.shape} is not {(*lead, n)}")
  epilogue = GeluGrad(h, approx_math, bias_grad)
  outs = gemm.matmul_epilogue(g, w_NK, epilogue, tiling=tiling, num_sms=num_sms,
                              transpose_w=True, name="taco_matmul")
  return outs[0], epilogue.bias_gradient(outs)
