"""All-to-all + matmul in one Mosaic GPU kernel: ``all_to_all(y) @ w``, rows to columns,
the transfer running beside the matmul instead of before it. It is the forward pass of
``parallel.tp_exchange``'s out-projection (`taco_jax.tp.fused.exchange_matmul`).

Inside a ``jax.shard_map`` over ``axis`` (n ranks; this rank r), y ``[B, T, C]`` holds this
rank's C columns of the full sequence. The exchanged x ``[B, S, n C]`` (S = T / n) holds,
in column chunk q, rank q's columns of this rank's sequence shard (what
``exchange.all_to_all(y, split_axis=1)`` leaves), and the output is ``x @ w`` for the whole
weight w ``[n C, D]``. A tile's contraction runs over every rank's columns, and a pipeline
loads its A operand from one array, so the kernel cannot read the peers' columns tile by
tile; and read once per output column tile they would cross the link several times.
Instead the first ``movers`` SMs pull every block of the exchanged x once, the peers'
over NVLink (TMA from ``plgpu.remote_ref``) and this rank's own locally, into x (an
output: the weight's gradient needs it), in row order, and count each GEMM row tile's
landed blocks on a semaphore of this GPU. The other SMs run the GEMM core over x
(``gemm.TileLoop``), each tile once its rows have all landed (``wait_rows``), so the
first waves multiply the first rows while the movers bring the later ones.

The peers' y are complete when the kernel starts: XLA runs a barrier across the GPUs
before a collective kernel. A rank leaves only once its peers' reads of its y have landed
(``peer_copy.release_sources``, from the movers).

Measured on H200s at the 1.3B shapes (2026-11-28): 1.10x faster than the exchange kernel
then cuBLAS at TP=4, 1.05x at TP=2, but no faster in the training step at TP=4 and 1.4%
slower at TP=2 (docs/parallel.md), so the layers' forward runs the two apart unless
``fused.EXCHANGE_FORWARD`` is "fused".

Local mode (``rank`` and ``local_y``, every rank's y ``[n, B, T, C]``) runs this rank's
kernel with no peers, for the CPU tests in jax's GPU interpret mode, which runs the grid's
CTAs one after the other: the movers' CTAs come first, so the GEMM needs no waits there.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import exchange, gemm
from taco_jax.pallas_kernels.ag_matmul import NARROW, WIDE
from taco_jax.pallas_kernels.peer_copy import check_slots, copy_blocks, release_sources

TILINGS = (WIDE, NARROW)
# At the 1.3B shapes on H200s, 24 movers ran 1.14x faster than 12 at TP=4, 1.28x at TP=2
# (bench_exchange_nvlink_movers_*gpu_20261128.json), with ~3 MB of pulls in flight.
MOVERS = 24
DEPTH = 4  # blocks in flight per mover
ROWS = exchange.ROWS  # a moved block's rows


def reference(y_all, w, rank):
  """``(x @ w, x)`` of rank ``rank``, x its exchanged input, from every rank's y ``[n, B, T,
  C]``: the tiled all-to-all, then the matmul (fp32 accumulation, y's dtype)."""
  x = exchange.reference(y_all, rank, 1)
  return jnp.einsum("bsf,fd->bsd", x, w, preferred_element_type=jnp.float32).astype(x.dtype), x


def misfit(y_shape, w_shape, n: int, tiling: gemm.Tiling, movers: int = MOVERS,
           num_sms: int | None = None) -> str | None:
  """Why the kernel cannot take y ``[B, T, C]`` and w ``[n C, D]`` over n ranks with these
  tiles, ``movers`` of ``num_sms`` SMs moving, or None when it can."""
  b, t, c = y_shape
  if w_shape[0] != n * c:
    return f"y {tuple(y_shape)} over {n} ranks and w {tuple(w_shape)} do not contract"
  reason = exchange.misfit(y_shape, n, 1)
  if reason:
    return reason
  if tiling.cta_m % ROWS:
    return f"row tiles of {tiling.cta_m} are not whole blocks of {ROWS} moved rows"
  if num_sms is not None and not 0 < movers < num_sms:
    return f"{movers} movers of {num_sms} SMs leave none to move or none to multiply"
  return tiling.misfit(rows_per_seq=t // n, m=b * t // n, n=w_shape[1], k=n * c,
                       clusters="the all-to-all matmul kernel runs no clusters",
                       num_sms=None if num_sms is None else num_sms - movers)


def default_tiling(y_shape, w_shape, n: int) -> gemm.Tiling:
  """The first of ``TILINGS`` that fits, else the last (whose ``misfit`` then says why)."""
  return gemm.first_fitting(TILINGS, lambda tiling: misfit(y_shape, w_shape, n, tiling))


@gemm.lowered_once("axis_name", "n", "num_sms", "movers", "tiling", "depth", "out_dtype",
                   "rank", reads=("TILINGS",))
def all_to_all_matmul(y_BTC, w_FD, axis_name, *, n: int, num_sms: int,
                      movers: int = MOVERS, tiling: gemm.Tiling | None = None,
                      depth: int = DEPTH, out_dtype=None, rank=None, local_y=None):
  """``(all_to_all(y, split_axis=1, concat_axis=2) @ w, the exchanged x)`` over
  ``axis_name`` (n ranks; the module docstring): ``[B, S, D]`` (``out_dtype``, default
  y's) and ``[B, S, n C]``. ``tiling``: default ``default_tiling``'s. ``rank`` and
  ``local_y``: local mode."""
  if n < 2:
    raise ValueError(f"all_to_all_matmul needs 2 or more ranks, got n={n}")
  t = tiling or default_tiling(y_BTC.shape, w_FD.shape, n)
  reason = misfit(y_BTC.shape, w_FD.shape, n, t, movers, num_sms)
  if reason:
    raise ValueError(f"all_to_all_matmul: {reason}")
  b, seq, c = y_BTC.shape
  s, d = seq // n, w_FD.shape[1]
  width = exchange.block_cols(c)
  check_slots("all_to_all_matmul", depth, ROWS * width * y_BTC.dtype.itemsize)
  row_tiles = b * s // t.cta_m
  per_row_tile = t.cta_m // ROWS * n * (c // width)  # blocks that land in a GEMM row tile
  out_dtype = out_dtype or y_BTC.dtype
  local = local_y is not None
  loop = gemm.TileLoop(t, [gemm.Operand((t.cta_m, t.tile_k), y_BTC.dtype, lambda kk: (0, kk))],
                       w_FD.dtype, n * c)

  def body(*refs, out_smem):
    (y_ref, w_ref), given, (out_ref, x_ref) = gemm.split_refs(refs, 2, int(local), 2)
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, row_tiles + 2)
    sm, wg = lax.axis_index(gemm.SM), lax.axis_index(gemm.WG)
    sources = [lax.rem(r + q, n) for q in range(n)]  # q = 0: this rank's own columns

    def source_rows(q):  # [B T, C] rows of source q's y
      if local:
        return given[0].at[sources[q]]
      return y_ref if q == 0 else plgpu.remote_ref(y_ref, {axis_name: sources[q]})

    def each_block(item, copy):
      """``copy(q, x rows, y rows, column block j, row tile)`` for block ``item`` of this
      mover: blocks in row order, a row tile's sources and column blocks interleaved."""
      flat = sm + item * movers
      tile, rest = flat // per_row_tile, lax.rem(flat, per_row_tile)
      q, rest = lax.rem(rest, n), rest // n
      j, half = lax.rem(rest, c // width), rest // (c // width)
      row = tile * t.cta_m + half * ROWS  # in x [B S, n C]; y's is this rank's shard's
      y_row = (row // s) * seq + r * s + lax.rem(row, s)
      for k in range(n):
        pl.when(q == k)(functools.partial(copy, k, pl.ds(row, ROWS), pl.ds(y_row, ROWS), j,
                                          tile))

    @pl.when(sm < movers)
    def _move():
      @functools.partial(pl.run_scoped, slots=plgpu.SMEM((depth, ROWS, width), y_BTC.dtype),
                         loaded=plgpu.Barrier(num_barriers=depth), collective_axes=gemm.WG)
      def _scope(slots, loaded):
        @pl.when(wg == 0)
        def _copies():
          def load(item, slot):
            each_block(item, lambda q, rows, y_rows, j, tile: plgpu.copy_gmem_to_smem(
                source_rows(q).at[y_rows, pl.ds(j * width, width)], slots.at[slot],
                loaded.at[slot]))

          def store(item, slot):
            def copy(q, rows, y_rows, j, tile):
              plgpu.copy_smem_to_gmem(slots.at[slot], x_ref.at[
                  rows, pl.ds(sources[q] * c + j * width, width)])
              if sems is not None:  # landed: one more block of its row tile
                plgpu.wait_smem_to_gmem(0)
                plgpu.semaphore_signal(sems.at[tile], memory_scope="gpu")
            each_block(item, copy)

          mine = (row_tiles * per_row_tile - sm + movers - 1) // movers
          copy_blocks(mine, depth, load, store, loaded)
          if sems is not None:
            release_sources(sems.at[row_tiles:], movers, sources[1:], axis_name)

    @pl.when(sm >= movers)
    def _multiply():
      def epilogue(m_idx, n_idx, wg, acc):
        gemm.store_tiles(acc.astype(out_dtype), out_smem, out_ref,
                         *t.wg_start(m_idx * t.cta_m, n_idx, wg), wg, t)

      def wait_rows(m_idx):
        plgpu.semaphore_wait(sems.at[m_idx], value=per_row_tile, decrement=False,
                             memory_scope="gpu")

      @functools.partial(pl.run_scoped, allocs=loop.allocations(x_ref, w_ref),
                         collective_axes=gemm.WG)
      def _scope(allocs):
        loop.run(allocs, m=b * s, n=d, w_ref=w_ref, epilogue=epilogue,
                 a_refs=lambda m_idx: [x_ref.at[pl.ds(m_idx * t.cta_m, t.cta_m)]],
                 wait_rows=None if sems is None else wait_rows, workers_from=movers)
    plgpu.wait_smem_to_gmem(0)

  out_type = (jax.ShapeDtypeStruct((b * s, d), out_dtype),
              jax.ShapeDtypeStruct((b * s, n * c), y_BTC.dtype))
  f = gemm.kernel(body, out_type=out_type, num_sms=num_sms,
                  scratch_types=dict(out_smem=gemm.out_smem_type(t, out_dtype)),
                  name=f"taco_all_to_all_matmul_{n}")
  given = () if not local else (local_y.reshape(n, b * seq, c),)
  out, x = f(y_BTC.reshape(b * seq, c), w_FD, *given)
  return out.reshape(b, s, d), x.reshape(b, s, n * c)
