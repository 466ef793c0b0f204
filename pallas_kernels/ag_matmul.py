"""All-gather + matmul in one Mosaic GPU kernel: ``y = all_gather(x, axis) @ w`` along the
sequence, with the transfers in flight while the matmul runs; plain or FP8-compressed.

Inside a ``jax.shard_map`` over ``axis`` (n ranks; this rank r), x ``[B, S, K]`` is this
rank's sequence shard and the gathered x ``[B, T = n S, K]`` the full sequence, chunk c
(rows ``c S .. (c + 1) S`` of every sequence) coming from rank c. The kernel computes the
chunks in ring order: at step s it multiplies chunk ``c = (r + s) mod n`` and, as each A
block of that chunk passes through shared memory, copies it on to rank ``r - 1``
(``plgpu.remote_ref``), which multiplies it at step s + 1. From ``ROW_WAITS_FROM`` ranks on,
a semaphore per step and row tile counts the output tiles of that row whose copies have
landed, and a tile starts once its A rows are there, so no SM waits for a whole chunk and
the deal of tiles to SMs runs on across the steps; with fewer, a semaphore per step counts
the SMs whose copies of it have landed, and a step starts once its chunk is complete. Every
output tile of a row forwards a share of that row's A blocks (tile column j the blocks
k = j mod the columns), so the copies spread evenly over all SMs and the whole step, at a
rate the link sustains, instead of a few SMs stalling on them. The gathered x is an output
as well: the weight gradient needs it and must not gather again.

The pulled schedule (``Tiling.cluster_n > 1``) reads the peers' x instead: the row tiles of
all chunks take turns (own, next peer's, ...) in one loop, and a peer's row tile is loaded
straight from its x (TMA from ``plgpu.remote_ref``) into the pipeline, so the link is busy
for the whole kernel instead of pacing the first step, and no chunk waits for a whole step.
A row tile is read once per column group of ``cluster_n`` output tiles: the CTAs of a
cluster compute neighbouring tiles of one row and share each A block (TMA multicast), so a
cluster as wide as the row (the out-projection's backward at TP=2: 4 tiles of 256) moves
each remote byte over the link once. Every A block is copied on into the gathered x as it
leaves the pipeline, as the ring copies its own chunk. The peers' x are complete when the
kernel starts (XLA runs a barrier across the GPUs before each collective kernel), and a
rank leaves only once its peers' reads of its x have landed (one relayed signal from each,
as the reduce-scatter's release).
Plain only: the FP8 kernel keeps the ring.

Compressed (``fp8=True``), what travels is the codec's FP8 codes ``[B, S, K]`` and one fp32
multiplier per group of G codes, ``scale / alpha`` (``decode.group_multiplier``), laid out
``[K / G, B S]`` so that a row tile's multipliers are one TMA copy into shared memory. Each
compute warpgroup decodes its A tile (``codes * multiplier`` in fp32, then the compute
dtype: exactly ``decode_reference`` without the Hadamard transform) right before the
wgmma. The encode is the codec's own kernel, run by the caller. Every chunk is decoded,
this rank's too, as in the compressed all-gather (``all_gather_matmul_reference``), and
the gathered x the kernel returns is written from those registers (each A block by one
tile of its row). Decoding the gathered codes in a pass of its own after the kernel took
0.041 ms at the 1.3B TP=2 shapes; with the kernel writing the gathered x, the encode,
kernel and all took 0.139 ms instead of 0.177 at the out-projection's backward, 0.322
instead of 0.356 at QKV, 0.412 instead of 0.448 at MLP-in, results equal bit for bit
(bench_collective_matmul_nvlink_decoded_2gpu_20261127).

Local mode runs this rank's part without peers, for the CPU tests (jax's GPU interpret
mode simulates no peer copies or semaphores): chunks c != r are read from a pre-gathered
input, and the copies meant for rank r - 1 land in a local ``sent`` output, so the tests
check both what the kernel computes and what it sends where.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm
from taco_jax.pallas_kernels.decode import decode_reference, group_multiplier
from taco_jax.pallas_kernels.encode import encode

# Each compute warpgroup a [64, 256] part of the CTA's [128, 256] tile (the rows split): one
# wgmma of 256 columns per 16 of the contraction, where [128, 128] parts take two of 128.
# The plain kernels, on 2 H200s at the 1.3B TP=2 shapes (one process, device time; the
# GEMM core alone 0.4-2% faster too): QKV 0.2825 ms against 0.2841, MLP-in 0.366 against
# 0.3675, the out-projection's backward (pulled) 0.1293 against 0.1330
# (bench_collective_matmul_nvlink_delay_2gpu_20261127.json).
WIDE = gemm.Tiling(tile_m=64, tile_n=256, split="m")
# Both kernels' tiles for widths that 256 does not divide (at TP=4 the 2.7B QKV's 1920
# columns and its out-projection backward's 640): [128, 128] per warpgroup, the rows split.
NARROW = gemm.Tiling(split="m")
# The FP8 kernel's warpgroups split the rows: each decodes its own A rows before its wgmma.
# The wide tiles decode half as many A elements per multiply-add as [128, 128] ones: on one
# H200 at the 1.3B / 2.7B TP=2 shapes the kernel ran 1.06-1.12x the plain kernel with them,
# 1.27-1.30x with 128 x 128 (bench_collective_matmul_fp8sweep_1gpu_20261123.json). Steps of
# 128 in a pipeline 2 deep (the same shared memory as 64 x 4), each decoded and multiplied
# in two halves, took 4.6-5.1% less kernel time than steps of 64 at the 1.3B TP=2 shapes
# on 2 H200s (QKV 0.287 ms against 0.302, MLP-in 0.381 against 0.399, the out-projection's
# backward 0.112 against 0.118; 2.2-4.1% of the encode, kernel and gathered x's decode
# together, as the layers then ran them; the halves alone 0.3-1.1% of that), where the
# plain kernel took 1-10% more with them
# (bench_collective_matmul_nvlink_decode_parts_2gpu_20261127).
# The steps of 64 are the fallback for groups of 64, the narrower tiles for widths that 256
# does not divide.
FP8_TILINGS = (dataclasses.replace(WIDE, tile_k=128, stages=2, decode_parts=2), WIDE, NARROW)


def all_gather_matmul_reference(x_BSK, w_KN, axis_name, *, fp8=None, out_dtype=None):
  """``(all_gather(x) @ w, all_gather(x))`` along the sequence (axis 1), with XLA: the plain
  collective, then the matmul. ``fp8``: a dict of codec settings (``group_size``, ``fmt``,
  ``dual_scale``, ``lam``, optionally the encode's ``implementation``: the compressed
  path's, for the same codes): the compressed all-gather (encode, gather codes and
  scales, decode every chunk) then the matmul."""
  if fp8 is not None:
    b, s, k = x_BSK.shape
    enc = encode(x_BSK.reshape(b * s, k), hadamard=False, **fp8)
    gathered = [lax.all_gather(a.reshape(b, s, -1), axis_name, axis=1, tiled=True)
                for a in enc]
    t = gathered[0].shape[1]
    x_BTK = decode_reference(*(a.reshape(b * t, -1) for a in gathered),
                             group_size=fp8["group_size"], hadamard=False,
                             out_dtype=x_BSK.dtype).reshape(b, t, k)
  else:
    x_BTK = lax.all_gather(x_BSK, axis_name, axis=1, tiled=True)
  y = jnp.einsum("btk,kn->btn", x_BTK, w_KN, preferred_element_type=jnp.float32)
  return y.astype(out_dtype or x_BSK.dtype), x_BTK


def misfit(x_shape, w_shape, tiling: gemm.Tiling, group_size: int | None = None,
           num_sms: int | None = None) -> str | None:
  """Why the kernel cannot take x ``[B, S, K]`` and w ``[K, N]`` with these tiles (and, for
  the FP8 kernel, groups of ``group_size``) on ``num_sms`` SMs, or None when it can."""
  b, s, k = x_shape
  if w_shape[0] != k:
    return f"x {tuple(x_shape)} and w {tuple(w_shape)} do not contract"
  if group_size is not None:
    if group_size % tiling.tile_k or k % group_size:
      return (f"groups of {group_size} are not whole pipeline steps of {tiling.tile_k} "
              f"within the contraction {k}")
    if tiling.split != "m":
      return "the FP8 kernel splits the rows between its warpgroups (Tiling.split='m')"
  no_clusters = "the FP8 all-gather kernel does not pull (Tiling.cluster_n)" if group_size else None
  return tiling.misfit(rows_per_seq=s, m=b * s, n=w_shape[1], k=k, clusters=no_clusters,
                       num_sms=num_sms)


# The ring's steps wait for row tiles from this many ranks on, for whole chunks below. At
# TP=4 the 1.3B QKV and MLP-in kernels took 0.195 and 0.209 ms against 0.204 and 0.220 with
# chunk waits; at TP=2 0.286 and 0.376 against 0.285 and 0.369: one step to wait for, and
# a signal per tile costs what it saves (one process each, 4 H200s, TP=2 on two of them:
# bench_collective_matmul_nvlink_row_ready_vs_chunk_*_20261127.json).
ROW_WAITS_FROM = 3

# Cluster widths at which the pulled schedule beat the ring where a cluster covers the row,
# at the 1.3B out-projection's backward: 4 at TP=2 (0.140 ms against 0.152 on 2 H200s,
# bench_collective_matmul_nvlink_layers_2gpu_20261127), 2 at TP=4 (0.179 against 0.191,
# _nvlink_pulled_4gpu_).
PULL_CLUSTERS = (2, 4)


# The ring's tile widths, each with its time per multiply-add against 256 columns: the
# whole gathered QKV matmul on one H200 at TP=4's shapes (the kernel with no peer, the same
# six waves of work at each width) took 0.139, 0.147 and 0.157 ms
# (bench_collective_matmul_nvlink_waves_4gpu_20261127.json).
RING_WIDTHS = {256: 1.0, 192: 1.06, 128: 1.13}
# A narrower width is taken only where it beats the wider pick's estimate by this much.
RING_NARROWING_GAIN = 0.05


def plain_tiling(x_shape, w_shape, n: int, num_sms: int = 132) -> gemm.Tiling:
  """The plain kernel's tiles for x ``[B, S, K]`` and w ``[K, N]`` over n ranks on
  ``num_sms`` SMs: the pulled schedule where one cluster of ``PULL_CLUSTERS`` covers an
  output row (each remote byte then crosses the link once), else the ring; both on the
  ``WIDE`` tiles (the ring's narrowed by ``ring_tiling`` where its steps wait for whole
  chunks), or the ring on the ``NARROW`` ones where only those fit."""
  if misfit(x_shape, w_shape, WIDE) and not misfit(x_shape, w_shape, NARROW):
    return NARROW
  width = w_shape[1] // WIDE.cta_n
  if n > 1 and width * WIDE.cta_n == w_shape[1] and width in PULL_CLUSTERS:
    return dataclasses.replace(WIDE, cluster_n=width)
  return ring_tiling(x_shape, w_shape, num_sms) if n < ROW_WAITS_FROM else WIDE


def ring_tiling(x_shape, w_shape, num_sms: int) -> gemm.Tiling:
  """``WIDE``, narrowed to a ``RING_WIDTHS`` width where a ring step's tiles fill the SMs'
  waves so much better that it pays for the narrower tiles: for a ring whose steps wait for
  whole chunks, so that a step takes its last wave's time. At TP=4 (then waiting so) the
  1.3B QKV's step was 192 tiles of 256 columns on 132 SMs, two waves for 1.45 waves of
  work, and 256 tiles of 192 columns the same two waves of three quarters the work (0.206
  ms against 0.238, 4 H200s, ``nvlink_waves``); at TP=2 the 2.7B out-projection's backward
  takes 128 columns (0.206 ms against 0.219, ``nvlink_ring_widths_2.7b``). Waiting for row
  tiles, the 1.3B QKV at TP=4 took 0.195 ms on 256 columns and 0.193-0.195 on 192
  (``nvlink_row_ready``)."""
  b, s, _ = x_shape
  best, best_cost = WIDE, None
  for cols, relative_cost in RING_WIDTHS.items():
    tiling = dataclasses.replace(WIDE, tile_n=cols)
    if misfit(x_shape, w_shape, tiling):
      continue
    tiles = (b * s // tiling.cta_m) * (w_shape[1] // tiling.cta_n)
    cost = -(-tiles // num_sms) * cols * relative_cost
    if best_cost is None or cost < (1 - RING_NARROWING_GAIN) * best_cost:
      best, best_cost = tiling, cost
  return best


def fp8_tiling(x_shape, w_shape, group_size: int) -> gemm.Tiling:
  """The first of ``FP8_TILINGS`` that fits these shapes, else the last (whose ``misfit``
  then says why none does)."""
  return gemm.first_fitting(FP8_TILINGS,
                            lambda tiling: misfit(x_shape, w_shape, tiling, group_size))


@dataclasses.dataclass(frozen=True)
class _Rows:
  """Where chunk c's row tiles live: rows of the local ``[B S, .]`` shard and of the
  gathered ``[B T, .]`` arrays."""
  s: int      # rows per sequence shard
  t: int      # rows per full sequence
  cta_m: int

  def local(self, m_idx):
    return m_idx * self.cta_m

  def gathered(self, c, m_idx):
    row = m_idx * self.cta_m
    return (row // self.s) * self.t + c * self.s + row % self.s


class _Multipliers:
  """The FP8 kernel's group multipliers: per row tile and compute warpgroup, its
  ``[K / G, tile_m]`` multipliers are loaded into shared memory once (``load``), read by
  every pipeline step's decode (``row``) and copied on with the tile (``send``)."""

  def __init__(self, tiling: gemm.Tiling, k: int, group_size: int):
    self.t, self.groups, self.per = tiling, k // group_size, group_size // tiling.tile_k

  def scratch(self) -> dict:
    t = self.t
    return dict(mult_smem=plgpu.SMEM((gemm.COMPUTE_WGS, self.groups, t.tile_m), jnp.float32),
                mult_barrier=plgpu.Barrier(num_barriers=gemm.COMPUTE_WGS))

  def load(self, src_ref, row, wg, scratch):
    """Warpgroup ``wg``'s multipliers of the row tile at ``row`` (its rows from
    ``row + wg tile_m``) into its shared-memory buffer."""
    smem, barrier = scratch["mult_smem"].at[wg], scratch["mult_barrier"].at[wg]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's were sent on
    plgpu.copy_gmem_to_smem(src_ref.at[:, pl.ds(row + wg * self.t.tile_m, self.t.tile_m)],
                            smem, barrier)
    plgpu.barrier_wait(barrier)

  def send(self, dest_ref, row, wg, scratch):
    plgpu.copy_smem_to_gmem(scratch["mult_smem"].at[wg],
                            dest_ref.at[:, pl.ds(row + wg * self.t.tile_m, self.t.tile_m)])

  def decoder(self, dtype, scratch):
    """The A operand of warpgroup ``wg`` at pipeline step ``k_idx``, by parts of the step's
    contraction: its codes times their group's multiplier, in fp32, then ``dtype``
    (``decode_reference``, no transform)."""
    t = self.t

    def decode(blocks, wg, k_idx):
      codes = blocks[0][pl.ds(wg * t.tile_m, t.tile_m)]
      mult = scratch["mult_smem"][wg, k_idx // self.per]
      return lambda cols: decode_tile(codes[:, cols], mult, dtype)
    return decode


def decode_tile(codes_MK, mult_M, dtype):
  """A tile of FP8 codes whose rows are each one group's (or part of one), decoded with
  their groups' multipliers: ``decode_reference`` without the transform, op for op (FP8 to
  fp32 through fp16 is exact; Mosaic GPU converts FP8 only to 16-bit floats)."""
  q = codes_MK.astype(jnp.float16).astype(jnp.float32)
  return (q * mult_M[:, None]).astype(dtype)


def _takes_block(k_idx, n_idx, n_tiles: int):
  """Whether output tile column ``n_idx`` (of ``n_tiles`` in a row) is the one that copies
  out the row's A block ``k_idx``: each block by exactly one tile of its row."""
  return lax.rem(k_idx, n_tiles) == n_idx


def _block_copier(t: gemm.Tiling, n_tiles: int, row_of, dests):
  """The ``after_mma`` hook that copies each A block of a row tile, as it leaves the
  pipeline, to the rows ``row_of(m_idx)`` of every gmem ref in ``dests`` (the gathered x,
  a peer's). Every output tile of a row copies a share of the row's blocks (tile column j
  the blocks k = j mod ``n_tiles``: ``_takes_block``), from warpgroup 0. The pipeline
  releases a block as its step ends, so its copies are read out within the step, while its
  wgmma runs. (Holding each block one step longer instead, the copies read out during the
  next step, was no faster: bench_collective_matmul_nvlink_delay_2gpu_20261127.json,
  ``[delay=0]``; and jax chains no pipelines that hold their blocks, ``Tiling.chain``.)"""
  def after_mma(m_idx, n_idx, k_idx, blocks):
    row = row_of(m_idx)

    @pl.when((lax.axis_index(gemm.WG) == 0) & _takes_block(k_idx, n_idx, n_tiles))
    def _send():
      for dest in dests:
        plgpu.copy_smem_to_gmem(blocks[0], dest.at[
            pl.ds(row, t.cta_m), pl.ds(k_idx * t.tile_k, t.tile_k)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  return after_mma


def _store_decoded(t: gemm.Tiling, n_tiles: int, row_of, out_smem, xd_ref):
  """The ``decoded`` hook that writes each decoded A part of a row tile to the rows
  ``row_of(m_idx)`` of the gathered x ``xd_ref``: of each A block, the tile of the row that
  forwards it (``_takes_block``, as ``_block_copier``), so every block once, straight from
  the registers the wgmma read, instead of a pass over the gathered codes after the
  kernel."""
  def decoded(m_idx, n_idx, wg, k_idx, cols, value):
    @pl.when(_takes_block(k_idx, n_idx, n_tiles))
    def _store():
      gemm.store_alone(value, out_smem, xd_ref, row_of(m_idx) + t.wg_offsets(wg)[0],
                       k_idx * t.tile_k + cols.start, wg, t)
  return decoded


def _call(a_RK, w_KN, *, s: int, n: int, rank, axis_name, tiling: gemm.Tiling,
          num_sms: int, out_dtype, dtype, transpose_w: bool, epilogue: gemm.Store,
          mult_GR=None, group_size=None, gathered=None, skip=(),
          chunk_waits: bool | None = None):
  """The kernel on this rank's A rows ``a_RK`` (x, or FP8 codes with ``mult_GR``), ``s``
  rows per sequence shard. ``gathered`` (local mode): the pre-gathered A rows (and
  multipliers) that peers would have written. Returns ``epilogue``'s output rows (``y``
  for the plain store) and the list of the gathered A rows (FP8: the codes and
  multipliers, the peers' receive buffers, then the gathered x, decoded as the wgmma took
  it: ``_store_decoded``), and in local mode what was sent to rank r - 1.
  ``chunk_waits``: each step waits for the whole chunk, every SM's copies of it, instead of
  each tile for its row tile (default: below ``ROW_WAITS_FROM`` ranks)."""
  if chunk_waits is None:
    chunk_waits = n < ROW_WAITS_FROM
  t = tiling
  local = gathered is not None
  fp8 = mult_GR is not None
  rows, k = a_RK.shape
  t_rows, n_out = rows * n, gemm.weight_kn(w_KN.shape, transpose_w)[1]
  n_tiles = n_out // t.cta_n  # output tiles per row: each forwards a share of the A blocks
  at = _Rows(s, n * s, t.cta_m)
  a_op = gemm.Operand((t.cta_m, t.tile_k), a_RK.dtype, lambda kk: (0, kk))
  loop = gemm.TileLoop(t, [a_op], w_KN.dtype, k, transpose_w)
  mults = _Multipliers(t, k, group_size) if fp8 else None
  n_arrays = 2 if fp8 else 1  # A rows (+ multipliers)
  row_tiles = rows // t.cta_m
  # the warpgroups of a tile that copy to rank r - 1: warpgroup 0 its share of the A blocks
  # and (FP8) each compute warpgroup its rows' multipliers
  copiers = gemm.COMPUTE_WGS if fp8 else 1
  # the signals that say a row tile of a chunk has landed: one from warpgroup 0 of each of
  # the row's output tiles, and (FP8) one from each other copier of the row's first tile
  row_signals = n_tiles + copiers - 1
  out_types = epilogue.outputs(t_rows, n_out, out_dtype)

  def body(*refs, **scratch):
    extra = n_arrays if local else 0
    mine, (w_ref,), src, ins, outs, xg, xd, sent = gemm.split_refs(
        refs, n_arrays, 1, extra, len(epilogue.inputs), len(out_types), n_arrays, int(fp8),
        extra)
    src = src or xg  # the peers write the gathered arrays themselves
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local,
                                       (n - 1) * (1 if chunk_waits else row_tiles))
    by_rows = sems is not None and not chunk_waits  # what the steps wait for, with peers
    by_chunks = sems is not None and chunk_waits
    prev = lax.rem(r + n - 1, n)
    peer = sent if sems is None else [plgpu.remote_ref(ref, {axis_name: prev}) for ref in xg]

    def landed(index):  # this warpgroup's copies to rank r - 1 have landed: tell it
      plgpu.wait_smem_to_gmem(0)
      pl.semaphore_signal(sems.at[index], device_id={axis_name: prev})

    def wait_rows(step, m_idx):  # row tile m_idx of the chunk rank r + 1 sent at ``step``
      pl.semaphore_wait(sems.at[step * row_tiles + m_idx], value=row_signals, decrement=False)

    @functools.partial(pl.run_scoped, allocs=loop.allocations(mine[0], w_ref),
                       collective_axes=gemm.WG)
    def _scope(allocs):
      for step in range(n):
        c = lax.rem(r + step, n)
        forward = step < n - 1
        arrays = mine if step == 0 else src
        row_of = at.local if step == 0 else functools.partial(at.gathered, c)
        own_copy = step == 0 and "copy" not in skip and not fp8  # FP8: xd holds this chunk
        dests = ([xg] if own_copy else []) + ([peer] if forward else [])

        def a_view(m_idx, arrays=arrays, row_of=row_of):
          return [arrays[0].at[pl.ds(row_of(m_idx), t.cta_m)]]

        def tile_at(m_idx, n_idx, wg, c=c):  # the warpgroup tile's first output element
          return t.wg_start(at.gathered(c, m_idx), n_idx, wg)

        def before_tile(m_idx, n_idx, wg, arrays=arrays, row_of=row_of, c=c, dests=dests,
                        tile_at=tile_at):
          if fp8:
            mults.load(arrays[1], row_of(m_idx), wg, scratch)

            @pl.when(n_idx == 0)
            def _send():
              for dest in dests:
                mults.send(dest[1], at.gathered(c, m_idx), wg, scratch)
          epilogue.before_tile(t, ins, scratch, *tile_at(m_idx, n_idx, wg), wg)

        after_mma = _block_copier(t, n_tiles, functools.partial(at.gathered, c),
                                  [dest[0] for dest in dests])

        def store(m_idx, n_idx, wg, acc, step=step, forward=forward, tile_at=tile_at):
          if forward and by_rows:
            pl.when((wg == 0) | ((n_idx == 0) if fp8 else False))(
                functools.partial(landed, step * row_tiles + m_idx))
          epilogue.store(t, ins, outs, scratch, acc, *tile_at(m_idx, n_idx, wg), wg)

        loop.run(allocs, m=rows, n=n_out, a_refs=a_view, w_ref=w_ref, epilogue=store,
                 decode=mults.decoder(dtype, scratch) if fp8 else None,
                 decoded=(_store_decoded(t, n_tiles, functools.partial(at.gathered, c),
                                         scratch["out_smem"], xd[0]) if fp8 else None),
                 before_tile=before_tile,
                 after_mma=after_mma if dests else None,
                 first_sm=0 if chunk_waits else (step * row_tiles * n_tiles) % num_sms,
                 wait_rows=functools.partial(wait_rows, step - 1) if by_rows and step else None)
        if forward and by_chunks:
          pl.when(lax.axis_index(gemm.WG) < copiers)(
              functools.partial(landed, step))
          pl.semaphore_wait(sems.at[step], value=num_sms * copiers, decrement=False)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  gathered_types = [jax.ShapeDtypeStruct((t_rows, k), a_RK.dtype)]
  operands = [a_RK]
  if fp8:
    gathered_types.append(jax.ShapeDtypeStruct((k // group_size, t_rows), jnp.float32))
    operands.append(mult_GR)
  operands.append(w_KN)
  if local:
    operands += list(gathered)
  operands += list(epilogue.inputs)
  out_type = [*out_types, *gathered_types]
  if fp8:
    out_type.append(jax.ShapeDtypeStruct((t_rows, k), dtype))
  if local:
    out_type += gathered_types  # what was sent to rank r - 1
  scratch = epilogue.kernel_scratch(t, out_dtype, staging=fp8)  # FP8: the decoded x's stores
  if fp8:
    scratch.update(mults.scratch())
  f = gemm.kernel(body, out_type=tuple(out_type), num_sms=num_sms, scratch_types=scratch,
                  name=f"taco_all_gather_matmul{'_fp8' if fp8 else ''}{epilogue.name}_{n}",
                  approx_math=epilogue.approx_math)
  results = f(*operands)
  return results[:len(out_types)], results[len(out_types):]


def _call_pulled(x_RK, w_KN, *, s: int, n: int, rank, axis_name, tiling: gemm.Tiling,
                 num_sms: int, out_dtype, transpose_w: bool, epilogue: gemm.Store,
                 gathered=None):
  """The pulled schedule (module docstring) on this rank's rows ``x_RK``, ``s`` rows per
  sequence shard; ``gathered`` (local mode): the pre-gathered x, whose chunks stand in for
  the peers' x. Returns ``epilogue``'s output rows and the list of the gathered x rows."""
  t = tiling
  local = gathered is not None
  rows, k = x_RK.shape
  t_rows, n_out = rows * n, gemm.weight_kn(w_KN.shape, transpose_w)[1]
  at = _Rows(s, n * s, t.cta_m)
  loop = gemm.TileLoop(t, [gemm.Operand((t.cta_m, t.tile_k), x_RK.dtype, lambda kk: (0, kk))],
                       w_KN.dtype, k, transpose_w)
  done, count = range(2)  # the semaphores: the peers' reads of x landed, this GPU's CTAs'
  clusters = gemm.clusters(num_sms, t.cluster_n)
  out_types = epilogue.outputs(t_rows, n_out, out_dtype)

  def body(*refs, **scratch):
    (x_ref, w_ref), src, ins, outs, (xg_ref,) = gemm.split_refs(
        refs, 2, int(local), len(epilogue.inputs), len(out_types), 1)
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, 2)
    peers = [lax.rem(r + q, n) for q in range(1, n)]

    def chunk(m_idx):
      """The chunks' row tiles take turns, own, next peer's, ...; when the clusters are a
      multiple of n, each round of the deal starts one chunk further, so that every
      cluster takes turns too (else a cluster would only ever take one chunk's tiles)."""
      if clusters % n:
        return lax.rem(r + m_idx, n), m_idx // n
      turn, place = m_idx // clusters, lax.rem(m_idx, clusters)
      return lax.rem(r + place + turn, n), turn * (clusters // n) + place // n

    def a_view(m_idx):
      c, j = chunk(m_idx)
      options = [(c == r, [x_ref.at[pl.ds(at.local(j), t.cta_m)]])]
      for p in peers:
        if local:
          view = src[0].at[pl.ds(at.gathered(p, j), t.cta_m)]
        else:
          view = plgpu.remote_ref(x_ref, {axis_name: p}).at[pl.ds(at.local(j), t.cta_m)]
        options.append((c == p, [view]))
      return gemm.Sources(tuple(options)) if peers else options[0][1]

    def row_of(m_idx):
      return at.gathered(*chunk(m_idx))

    def before_tile(m_idx, n_idx, wg):
      epilogue.before_tile(t, ins, scratch, *t.wg_start(row_of(m_idx), n_idx, wg), wg)

    def store(m_idx, n_idx, wg, acc):
      epilogue.store(t, ins, outs, scratch, acc, *t.wg_start(row_of(m_idx), n_idx, wg), wg)

    @functools.partial(pl.run_scoped, allocs=loop.allocations(x_ref, w_ref),
                       collective_axes=gemm.WG)
    def _scope(allocs):
      loop.run(allocs, m=t_rows, n=n_out, a_refs=a_view, w_ref=w_ref, epilogue=store,
               before_tile=before_tile,
               after_mma=_block_copier(t, n_out // t.cta_n, row_of, [xg_ref]))

    if sems is not None:  # this CTA's reads have landed; no rank leaves while a peer reads it
      @pl.when(lax.axis_index(gemm.WG) == 0)
      def _release():
        gemm.relay(sems.at[count], sems.at[done], expected=clusters * t.cluster_n,
                   relays=(lax.axis_index(gemm.SM) == 0) & (lax.axis_index(gemm.CLUSTER) == 0),
                   peers=peers, axis_name=axis_name, wait=n - 1)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = (*out_types, jax.ShapeDtypeStruct((t_rows, k), x_RK.dtype))
  f = gemm.kernel(body, out_type=out_type, num_sms=num_sms,
                  scratch_types=epilogue.kernel_scratch(t, out_dtype),
                  name=f"taco_all_gather_matmul_pulled{epilogue.name}_{n}",
                  cluster_n=t.cluster_n, approx_math=epilogue.approx_math)
  results = f(x_RK, w_KN, *(() if gathered is None else gathered), *epilogue.inputs)
  return results[:len(out_types)], results[len(out_types):]


@gemm.lowered_once("axis_name", "tiling", "num_sms", "out_dtype", "transpose_w", "rank",
                   "_skip", "_chunk_waits")
def all_gather_matmul(x_BSK, w_KN, axis_name, *, tiling: gemm.Tiling = WIDE,
                      num_sms: int, out_dtype=None, transpose_w: bool = False,
                      epilogue: gemm.Store | None = None, rank=None,
                      local_gathered=None, _skip: tuple[str, ...] = (),
                      _chunk_waits: bool | None = None):
  """``(all_gather(x) @ w, all_gather(x))`` along the sequence, as one kernel (module
  docstring); returns ``y [B, T, N]`` (``out_dtype``, default x's) and the gathered x.
  ``num_sms``: the GPU's multiprocessor count. ``tiling.cluster_n > 1``: the pulled
  schedule. ``transpose_w``: w is given ``[N, K]`` and multiplied transposed
  (``gemm.TileLoop``). ``epilogue``: in place of the plain store (e.g.
  ``gelu_gemm.BiasGelu``), its outputs ``[B, T, .]`` in place of y; its inputs' rows are
  the gathered rows. ``rank`` and ``local_gathered`` (the gathered x): local mode, which
  with the ring also returns what this rank sent to rank r - 1. ``_skip``, for timing
  experiments only: ``("copy",)`` leaves this rank's own chunk out of the gathered x (the
  ring's copy that the matmul alone does not make), so the gathered x is wrong;
  ``_chunk_waits``: whether the ring's steps wait for whole chunks instead of row tiles
  (default: below ``ROW_WAITS_FROM`` ranks)."""
  reason = misfit(x_BSK.shape, gemm.weight_kn(w_KN.shape, transpose_w), tiling,
                  num_sms=num_sms)
  if reason:
    raise ValueError(f"all_gather_matmul: {reason}")
  b, s, k = x_BSK.shape
  n = lax.axis_size(axis_name) if rank is None else local_gathered.shape[1] // s
  gathered = None if local_gathered is None else [local_gathered.reshape(-1, k)]
  epilogue = epilogue or gemm.Store()
  args = dict(s=s, n=n, rank=rank, axis_name=axis_name, tiling=tiling, num_sms=num_sms,
              out_dtype=out_dtype or x_BSK.dtype, gathered=gathered, transpose_w=transpose_w,
              epilogue=epilogue)
  if tiling.cluster_n > 1:
    if _skip or _chunk_waits is not None:
      raise ValueError("all_gather_matmul: _skip and _chunk_waits are for the ring schedule "
                       "(cluster_n = 1)")
    outs, rest = _call_pulled(x_BSK.reshape(b * s, k), w_KN, **args)
  else:
    outs, rest = _call(x_BSK.reshape(b * s, k), w_KN, dtype=x_BSK.dtype, skip=_skip,
                       chunk_waits=_chunk_waits, **args)
  return (*epilogue.with_rows(outs, (b, n * s)), *(a.reshape(b, n * s, k) for a in rest))


@gemm.lowered_once("axis_name", "group_size", "dtype", "tiling", "num_sms", "out_dtype",
                   "transpose_w", "rank", reads=("FP8_TILINGS",))
def all_gather_matmul_fp8(codes_BSK, mult_GR, w_KN, axis_name, *, group_size: int,
                          dtype=jnp.bfloat16, tiling: gemm.Tiling | None = None, num_sms: int,
                          out_dtype=None, transpose_w: bool = False,
                          epilogue: gemm.Store | None = None, rank=None,
                          local_gathered=None):
  """The compressed kernel: ``codes_BSK`` are x's FP8 codes and ``mult_GR`` ``[K / G,
  B S]`` their groups' multipliers (``multipliers``); x is decoded to ``dtype`` tile by tile
  before each wgmma. Returns ``y [B, T, N]`` and the gathered x ``[B, T, K]``, which the
  kernel writes as it decodes it (``out_dtype``, default ``dtype``, must be ``dtype``: the
  two share the staging buffers). ``tiling``: default ``fp8_tiling``'s. ``transpose_w`` and
  ``epilogue``: as ``all_gather_matmul``'s (its outputs in place of y). ``rank`` and
  ``local_gathered`` (gathered codes and multipliers): local mode, which also returns what
  was sent to rank r - 1 (codes ``[B, T, K]`` and multipliers)."""
  w_shape = gemm.weight_kn(w_KN.shape, transpose_w)
  tiling = tiling or fp8_tiling(codes_BSK.shape, w_shape, group_size)
  epilogue = epilogue or gemm.Store()
  reason = misfit(codes_BSK.shape, w_shape, tiling, group_size)
  if not reason and jnp.dtype(out_dtype or dtype) != jnp.dtype(dtype):
    reason = f"y in {jnp.dtype(out_dtype)} is staged where the gathered x in {dtype} is"
  if reason:
    raise ValueError(f"all_gather_matmul_fp8: {reason}")
  b, s, k = codes_BSK.shape
  if mult_GR.shape != (k // group_size, b * s):
    raise ValueError(f"all_gather_matmul_fp8: multipliers {mult_GR.shape} do not match codes "
                     f"{codes_BSK.shape} in groups of {group_size}")
  n = lax.axis_size(axis_name) if rank is None else local_gathered[0].shape[1] // s
  gathered = None
  if local_gathered is not None:
    gathered = [local_gathered[0].reshape(-1, k), local_gathered[1]]
  outs, (_, _, x_full, *sent) = _call(  # _: the gathered codes, the peers' receive buffers
      codes_BSK.reshape(b * s, k), w_KN, s=s, n=n, rank=rank, axis_name=axis_name,
      tiling=tiling, num_sms=num_sms, out_dtype=dtype, dtype=dtype, mult_GR=mult_GR,
      group_size=group_size, gathered=gathered, transpose_w=transpose_w,
      epilogue=epilogue)
  out = [*epilogue.with_rows(outs, (b, n * s)), x_full.reshape(b, n * s, k)]
  if sent:
    out += [sent[0].reshape(b, n * s, k), sent[1]]
  return tuple(out)


def multipliers(alpha_RK, scale_RK):
  """The kernel's per-group decode multipliers ``[K, R]`` from the codec's scales
  ``[R, K]`` (``group_multiplier``, transposed so a row tile's are contiguous)."""
  return group_multiplier(alpha_RK, scale_RK).T
