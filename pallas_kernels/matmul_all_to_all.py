"""Matmul + all-to-all in one Mosaic GPU kernel: ``all_to_all(a @ w)``, columns to rows, each
output tile pushed to the rank that owns it straight from the epilogue, so the transfer
runs while the next tiles are computed instead of after the matmul. It is the gradient of
``parallel.tp_exchange``'s out-projection input (`taco_jax.tp.fused.exchange_matmul`).

Inside a ``jax.shard_map`` over ``axis`` (n ranks; this rank r), a ``[B, S, K]`` is this
rank's sequence shard and the product ``a @ w`` ``[B, S, N]`` has n column chunks of C = N /
n. Chunk c belongs to rank c, which stacks what it receives along the sequence in rank
order: its output ``[B, n S, C]`` holds rank q's chunk c in rows ``q S .. (q + 1) S`` of
every sequence, as ``exchange.all_to_all(a @ w, split_axis=2)`` would leave it. The kernel
is the GEMM core (``gemm.TileLoop``) with an epilogue that stores each tile into its
owner's output (``plgpu.remote_ref``; this rank's own chunk locally); a column tile never
straddles two chunks (``misfit``). The owners' outputs are free to write when the kernel
starts: XLA runs a barrier across the GPUs before a collective kernel.

A rank may leave, and its output be read, once every peer's stores into it have landed.
Each compute warpgroup drains its stores and counts on a semaphore of its own GPU; one
warpgroup waits for all of them and signals every peer once (the relay of
``matmul_rs``: system-scope signals from every warpgroup at once are served one after the
other), and every rank waits for its n - 1 peers' signals.

Local mode (``rank`` given) runs rank ``rank``'s part with no peers, for the CPU tests in
jax's GPU interpret mode: the output is every owner's ``[n, B, n S, C]``, of which this
rank writes the rows of its own sequence shard, at the places the peer stores would take.
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

# The all-gather kernel's tiles: 256 columns where they tile a chunk, else 128 (at TP=4
# the 2.7B's chunks of 640 columns).
TILINGS = (WIDE, NARROW)
COUNT, DONE = range(2)  # the semaphores: this GPU's warpgroups drained; the peers' signals


def reference(a_all, w, rank, transpose_w: bool = False):
  """What rank ``rank`` ends with, from every rank's a ``[n, B, S, K]``: each rank's ``a @ w``
  (fp32 accumulation, a's dtype), exchanged by the tiled all-to-all."""
  w_kn = w.T if transpose_w else w
  products = jnp.stack([jnp.einsum("bsk,kn->bsn", a, w_kn, preferred_element_type=jnp.float32)
                        .astype(a.dtype) for a in a_all])
  return exchange.reference(products, rank, 2)


def misfit(a_shape, w_shape, n: int, tiling: gemm.Tiling,
           num_sms: int | None = None) -> str | None:
  """Why the kernel cannot take a ``[B, S, K]`` and w ``[K, N]`` over n ranks with these
  tiles on ``num_sms`` SMs, or None when it can."""
  b, s, k = a_shape
  if w_shape[0] != k:
    return f"a {tuple(a_shape)} and w {tuple(w_shape)} do not contract"
  if w_shape[1] % n:
    return f"the product's {w_shape[1]} columns do not divide over {n} ranks"
  if (w_shape[1] // n) % tiling.cta_n:
    return (f"column tiles of {tiling.cta_n} do not tile the {w_shape[1] // n}-column chunk "
            f"each rank owns")
  return tiling.misfit(rows_per_seq=s, m=b * s, n=w_shape[1], k=k, num_sms=num_sms,
                       clusters="the matmul-exchange kernel runs no clusters")


def default_tiling(a_shape, w_shape, n: int) -> gemm.Tiling:
  """The first of ``TILINGS`` that fits, else the last (whose ``misfit`` then says why)."""
  return gemm.first_fitting(TILINGS, lambda tiling: misfit(a_shape, w_shape, n, tiling))


@gemm.lowered_once("axis_name", "n", "num_sms", "tiling", "out_dtype", "transpose_w", "rank",
                   reads=("TILINGS",))
def matmul_all_to_all(a_BSK, w, axis_name, *, n: int, num_sms: int,
                      tiling: gemm.Tiling | None = None, out_dtype=None,
                      transpose_w: bool = False, rank=None):
  """``all_to_all(a @ w, split_axis=2, concat_axis=1)`` over ``axis_name`` (n ranks; the
  module docstring): ``[B, n S, N / n]``, ``out_dtype`` (default a's). ``transpose_w``: w
  is given ``[N, K]`` and multiplied transposed (``gemm.TileLoop``). ``tiling``: default
  ``default_tiling``'s. ``rank``: local mode, which returns every owner's output
  ``[n, B, n S, N / n]`` with this rank's rows written."""
  if n < 2:
    raise ValueError(f"matmul_all_to_all needs 2 or more ranks, got n={n}")
  w_shape = gemm.weight_kn(w.shape, transpose_w)
  t = tiling or default_tiling(a_BSK.shape, w_shape, n)
  reason = misfit(a_BSK.shape, w_shape, n, t, num_sms)
  if reason:
    raise ValueError(f"matmul_all_to_all: {reason}")
  b, s, k = a_BSK.shape
  chunk = w_shape[1] // n
  out_dtype = out_dtype or a_BSK.dtype
  local = rank is not None
  loop = gemm.TileLoop(t, [gemm.Operand((t.cta_m, t.tile_k), a_BSK.dtype, lambda kk: (0, kk))],
                       w.dtype, k, transpose_w)
  signals = num_sms * gemm.COMPUTE_WGS

  def body(a_ref, w_ref, y_ref, out_smem):
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, 2)
    peers = [lax.rem(r + q, n) for q in range(1, n)]
    owners = [(r, y_ref.at[r] if local else y_ref)]  # (rank, the output its tiles go to)
    owners += [(p, y_ref.at[p] if local else plgpu.remote_ref(y_ref, {axis_name: p}))
               for p in peers]

    def epilogue(m_idx, n_idx, wg, acc):
      row0, col0 = t.wg_offsets(wg)
      row = m_idx * t.cta_m + row0  # in a's rows [B S]; in the owner's [B T], shard r's
      row = (row // s) * (n * s) + r * s + row % s
      col = n_idx * t.cta_n + col0
      value = acc.astype(out_dtype)
      for owner, out in owners:
        pl.when(col // chunk == owner)(functools.partial(
            gemm.store_tiles, value, out_smem, out, row, lax.rem(col, chunk), wg, t))

    @functools.partial(pl.run_scoped, allocs=loop.allocations(a_ref, w_ref),
                       collective_axes=gemm.WG)
    def _scope(allocs):
      loop.run(allocs, m=b * s, n=w_shape[1], w_ref=w_ref, epilogue=epilogue,
               a_refs=lambda m_idx: [a_ref.at[pl.ds(m_idx * t.cta_m, t.cta_m)]])

    if sems is None:
      plgpu.wait_smem_to_gmem(0)
      return

    @pl.when(lax.axis_index(gemm.WG) < gemm.COMPUTE_WGS)
    def _landed():
      plgpu.wait_smem_to_gmem(0)  # this warpgroup's stores, the peers' included, landed
      gemm.relay(sems.at[COUNT], sems.at[DONE], expected=signals,
                 relays=(lax.axis_index(gemm.SM) == 0) & (lax.axis_index(gemm.WG) == 0),
                 peers=peers, axis_name=axis_name, wait=n - 1)

  rows = b * n * s
  out_type = jax.ShapeDtypeStruct((n, rows, chunk) if local else (rows, chunk), out_dtype)
  f = gemm.kernel(body, out_type=out_type, num_sms=num_sms,
                  scratch_types=dict(out_smem=gemm.out_smem_type(t, out_dtype)),
                  name=f"taco_matmul_all_to_all_{n}")
  y = f(a_BSK.reshape(b * s, k), w)
  return y.reshape(n, b, n * s, chunk) if local else y.reshape(b, n * s, chunk)
