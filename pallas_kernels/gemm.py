"""The GEMM core of the collective-matmul kernels (Pallas Mosaic GPU, Hopper).

A persistent, warp-specialized matmul: one CTA per SM walks its share of the output tiles
of a chunk (``dealt``). Per tile, a memory warpgroup streams ``[cta_m, tile_k]`` A blocks
and ``[tile_k, cta_n]`` B blocks into shared memory (TMA, ``stages`` deep;
``plgpu.emit_pipeline_warp_specialized``, chained over the SM's tiles where jax allows:
``Tiling.chain``) and two compute warpgroups each accumulate a ``[tile_m, tile_n]`` part
of the CTA tile with wgmma in fp32 (split along N or M). What is
specific to a collective comes in through hooks of ``TileLoop.run``:

* ``a_refs(m_idx)``: the gmem refs of the chunk's row tile ``m_idx`` (the sequence chunks of
  a ``[B, T, D]`` activation are not contiguous rows for B > 1), or ``Sources`` to choose
  them per tile among refs of several arrays (this GPU's and a peer's);
* ``before_tile(m_idx, n_idx, wg)``: per-tile work before the pipeline, e.g. loading the
  tile's FP8 group multipliers;
* ``decode(blocks, wg, k_idx)``: for A operands that are not plain bf16 (FP8 codes), a
  function of a static slice of the step's contraction that returns that part of the
  warpgroup's A tile, decoded, as a value (``Tiling.decode_parts`` parts a step);
* ``decoded(m_idx, n_idx, wg, k_idx, cols, value)``: each decoded part once its wgmma is
  issued, e.g. to write it out (``store_alone``);
* ``after_mma(m_idx, n_idx, k_idx, blocks)``: e.g. forwarding the A block to a peer;
* ``epilogue(m_idx, n_idx, wg, acc)``: what happens to the fp32 accumulator; the kernels
  take it as an object (``Store``, the plain store, or ``gelu_gemm``'s epilogues), so the
  GEMM core and the all-gather kernels run the same epilogues.

A decoded A operand goes to the wgmma from registers (the dequantize-before-wgmma pattern).
jax's GPU interpret mode takes wgmma operands from shared memory only, so kernels with a
decoded operand lower (and run) on the GPU only; the CPU tests run their tile math and the
plain kernels, which share everything else. Built on jax's public Mosaic GPU building
blocks, after the structure of jax's Hopper matmul example.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # is jax's GPU interpreter on (``interpreting``)
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WG = "wg"        # the warpgroup axis (2 compute + 1 memory warpgroup)
SM = "sm"        # the persistent grid axis: one CTA per SM (one cluster of CTAs, with clusters)
CLUSTER = "cluster"  # a cluster's CTAs (Tiling.cluster_n), side by side along N
COMPUTE_WGS = 2
SMEM_BYTES = 227 * 1024  # shared memory per block on sm_90
# The clusters of CTAs an H200 (132 SMs) runs at once, where fewer than one per
# ``cluster_n`` SMs: of 4 CTAs, 30. At the 1.3B shapes the GEMM core in 28 to 31 clusters
# of 4 (5 of the 128 row tiles each) takes 0.107-0.110 ms; in 32 or 33 (4 each) 0.150-0.170,
# some of them waiting for a place (bench_collective_matmul_nvlink_clusters_2gpu_20261127,
# _turns_, _layers_). Pairs: all 66 fit.
RESIDENT_CLUSTERS = {4: 30}


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile sizes of one kernel; the CTA computes a ``[cta_m, cta_n]`` output tile."""
  tile_m: int = 128    # rows per compute warpgroup tile
  tile_n: int = 128    # columns per compute warpgroup tile
  tile_k: int = 64     # contraction per pipeline step
  stages: int = 4      # pipeline depth (shared-memory buffers per operand)
  split: str = "n"     # how the two compute warpgroups share the CTA tile: "n" or "m"
  epi_m: int = 64      # epilogue sub-tile rows (one TMA store each)
  epi_n: int = 64      # epilogue sub-tile columns
  # The order of the output tiles (``plgpu.planar_snake``): strips of ``grid_width`` tiles
  # along ``grid_minor``, each walked along the other dimension, snaking. Strips of 8 row
  # tiles keep A and B blocks in L2 between neighbouring SMs: on an H200 at the 1.3B layer
  # shapes this order matches cuBLAS, where walking one row at a time is up to 11% slower
  # (bench_collective_matmul's one-GPU run).
  grid_minor: str = "m"
  grid_width: int = 8
  # CTAs per cluster, computing neighbouring column tiles of one row: each A block is loaded
  # once into all of them (TMA multicast), as jax's hopper_matmul_mgpu does for pairs
  cluster_n: int = 1
  # One pipeline over all the tiles an SM takes in a loop (``plgpu.PipelinePipeline``): a
  # tile's first blocks load as the last tile's are consumed, while its epilogue runs,
  # instead of after it. At the 1.3B TP=2 shapes the GEMM core alone took 0.7-3% less time
  # with it (one H200: bench_collective_matmul_chain_1gpu_20261127.json; 2 H200s, 1.1-2.8%:
  # _nvlink_chain_2gpu_). Loops where jax's pipelines cannot chain run a pipeline per tile
  # (``TileLoop.chains``).
  chain: bool = True
  # A decoded A operand (``TileLoop.run``'s ``decode``) goes to the wgmma in this many parts
  # along the contraction, each part's wgmma issued before the next part is decoded, so a
  # warpgroup decodes while its own last wgmma runs, not only while its neighbour's does.
  decode_parts: int = 1

  def __post_init__(self):
    for field in ("split", "grid_minor"):
      if getattr(self, field) not in ("n", "m"):
        raise ValueError(f"Tiling.{field} must be 'n' or 'm', got {getattr(self, field)!r}")
    for field in ("grid_width", "cluster_n", "decode_parts"):
      if getattr(self, field) < 1:
        raise ValueError(f"Tiling.{field} must be >= 1, got {getattr(self, field)}")

  @property
  def cta_m(self) -> int:
    return self.tile_m * (COMPUTE_WGS if self.split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (COMPUTE_WGS if self.split == "n" else 1)

  def wg_offsets(self, wg):
    """(row, column) offset of compute warpgroup ``wg``'s tile inside the CTA tile."""
    if self.split == "m":
      return wg * self.tile_m, 0
    return 0, wg * self.tile_n

  def wg_start(self, cta_row, n_idx, wg):
    """(row, column) of the first output element of compute warpgroup ``wg``'s tile, in the
    CTA tile of column tile ``n_idx`` whose rows start at ``cta_row``."""
    row0, col0 = self.wg_offsets(wg)
    return cta_row + row0, n_idx * self.cta_n + col0

  def misfit(self, *, rows_per_seq: int, m: int, n: int, k: int,
             clusters: str | None = None, num_sms: int | None = None) -> str | None:
    """Why these tiles do not divide a chunk of ``m`` rows (in runs of ``rows_per_seq``
    contiguous rows) times ``[k, n]`` on ``num_sms`` SMs, or None when they do;
    ``clusters``: None where the kernel runs clusters of CTAs, else why it does not."""
    if self.cluster_n != 1:
      if clusters is not None:
        return clusters
      if num_sms is not None and num_sms % self.cluster_n:
        return f"{num_sms} SMs do not make clusters of {self.cluster_n}"
    for what, size, tile in (("sequence shard", rows_per_seq, self.cta_m),
                             ("rows", m, self.cta_m), ("columns", n, self.cta_n * self.cluster_n),
                             ("contraction", k, self.tile_k)):
      if size % tile:
        return f"{what} {size} is not a multiple of the tile {tile}"
    if self.decode_parts > 1 and self.tile_k % (64 * self.decode_parts):
      # a wgmma reads a B block swizzled by 128 bytes in whole swizzles: 64 bf16 rows
      return (f"{self.decode_parts} decode parts of the pipeline step {self.tile_k} are not "
              f"multiples of 64")
    if k < 2 * self.tile_k:
      return f"contraction {k} is shorter than two pipeline steps of {self.tile_k}"
    if self.epi_m % 64:  # a warpgroup's accumulator rows come in blocks of 64
      return f"epilogue rows {self.epi_m} are not a multiple of 64"
    if self.tile_m % self.epi_m or self.tile_n % self.epi_n:
      return f"epilogue tile {self.epi_m}x{self.epi_n} does not divide {self.tile_m}x{self.tile_n}"
    return None


def first_fitting(tilings, misfit: Callable) -> Tiling:
  """The first of ``tilings`` for which ``misfit(tiling)`` is None, else the last (whose
  ``misfit`` then says why none fits)."""
  return next((t for t in tilings if misfit(t) is None), tilings[-1])


def swizzled(cols: int, dtype) -> tuple:
  """The shared-memory transforms of a block whose rows hold ``cols`` elements of ``dtype``."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(cols * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class Operand:
  """A pipelined A-side input: a ``block`` of ``dtype`` at block index ``index(k_idx)``;
  ``swizzle`` False for small blocks that no wgmma reads (e.g. per-row multipliers)."""
  block: tuple[int, int]
  dtype: object
  index: Callable
  swizzle: bool = True

  def spec(self, multicast: bool = False) -> plgpu.BlockSpec:
    """``multicast``: one load into every CTA of the cluster (they share the block)."""
    return plgpu.BlockSpec(self.block, self.index,
                           transforms=swizzled(self.block[1], self.dtype) if self.swizzle else (),
                           memory_space=plgpu.SMEM,
                           collective_axes=(CLUSTER,) if multicast else None)


@dataclasses.dataclass(frozen=True)
class Sources:
  """A row tile's A-side refs, chosen per tile: ``options`` are ``(when, refs)`` pairs, and
  the tile runs on the refs of the one whose ``when`` holds. Each option builds its own
  pipeline (its loads take their source array from the refs): one array per option."""
  options: tuple


class TileLoop:
  """The pipeline of one kernel, allocated once and run once per chunk (``run``).

  ``a_ops``: the A-side operands (the bf16 A block, or FP8 codes and multipliers); B is a
  ``[tile_k, cta_n]`` block of the weight, or with ``transpose_w`` a ``[cta_n, tile_k]``
  block of the weight stored ``[N, K]``, which the wgmma reads transposed (so a backward
  pass multiplies by ``w.T`` without XLA copying the weight transposed first). A step's
  blocks are released as it ends: ``after_mma``'s copies out of them must have read them
  by then.
  """

  def __init__(self, tiling: Tiling, a_ops: list[Operand], w_dtype, k: int,
               transpose_w: bool = False):
    self.t, self.k_iters, self.transpose_w = tiling, k // tiling.tile_k, transpose_w
    if transpose_w:
      b = Operand((tiling.cta_n, tiling.tile_k), w_dtype, lambda kk: (0, kk))
    else:
      b = Operand((tiling.tile_k, tiling.cta_n), w_dtype, lambda kk: (kk, 0))
    shared = tiling.cluster_n > 1  # the A blocks go to the cluster's CTAs at once
    self.specs = [s.spec(shared) for s in a_ops] + [b.spec()]

  def _pipeline(self, body, context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(self.k_iters,), memory_registers=40, in_specs=self.specs, wg_axis=WG,
        num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=self.t.stages,
        compute_context=context, pipeline_state=state)

  def chains(self, tiles: int, sms: int) -> bool:
    """Whether a loop of ``tiles`` tiles dealt over ``sms`` SMs (or clusters) runs as one
    pipeline per SM (``Tiling.chain``): jax chains pipelines of whole rounds of the stages
    only, and a chain needs a first and a last tile on every SM."""
    return self.t.chain and self.k_iters % self.t.stages == 0 and tiles >= 2 * sms

  def allocations(self, *gmem_refs):
    ignore = lambda *_, **__: None  # noqa: E731 (the bodies do not change the allocations)
    return self._pipeline(ignore, ignore).get_allocations(*gmem_refs)

  def run(self, allocs, *, m: int, n: int, a_refs: Callable, w_ref, epilogue: Callable,
          decode: Callable | None = None, decoded: Callable | None = None,
          after_mma: Callable | None = None,
          before_tile: Callable | None = None, acc_dtype=jnp.float32,
          first_sm: int | jax.Array = 0, wait_rows: Callable | None = None,
          workers_from: int = 0):
    """Computes the ``[m, n]`` output tiles of one chunk: tile (m_idx, n_idx) multiplies
    the A blocks of ``a_refs(m_idx)`` (gmem refs of ``cta_m`` rows) by ``w_ref``'s columns
    ``[n_idx cta_n, (n_idx + 1) cta_n)``; ``epilogue(m_idx, n_idx, wg, acc)`` gets each
    compute warpgroup's fp32 ``[tile_m, tile_n]`` accumulator. The tiles are dealt to the
    SMs from ``first_sm`` on (``dealt``); with clusters, the rows of ``cluster_n``
    neighbouring tiles to the clusters, whose CTAs take one tile each. ``wait_rows(m_idx)``
    runs in every warpgroup before a tile's first load: to wait until its A rows are there.
    ``workers_from``: the tiles go to SMs ``workers_from`` on only (the others do other
    work, e.g. moving the A rows in)."""
    t = self.t
    grid = (m // t.cta_m, n // (t.cta_n * t.cluster_n))
    tiles = grid[0] * grid[1]
    chained = self.chains(tiles, lax.axis_size(SM) - workers_from)

    @dealt(tiles, first_sm, workers_from)
    def _tile(idx, i, count):
      m_idx, n_idx = plgpu.planar_snake(idx, grid, "mn".index(t.grid_minor), t.grid_width)
      if t.cluster_n > 1:
        n_idx = n_idx * t.cluster_n + lax.axis_index(CLUSTER)
      wg = lax.axis_index(WG)
      row0, col0 = t.wg_offsets(wg)

      def context(run_pipeline):
        if before_tile is not None:
          before_tile(m_idx, n_idx, wg)

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.tile_m, t.tile_n), acc_dtype))
        def _acc(acc):
          with jax.named_scope("mma"):
            run_pipeline(acc)
          with jax.named_scope("epilogue"):
            epilogue(m_idx, n_idx, wg, acc[...])

      def b_part(b_block, ks=slice(None)):  # this warpgroup's [k, tile_n] part of B
        if self.transpose_w:
          return b_block.at[pl.ds(col0, t.tile_n), ks].transpose((1, 0))
        return b_block.at[ks, pl.ds(col0, t.tile_n)]

      def mma(idxs, *refs):
        *a_blocks, b_block, acc = refs
        if decode is None:
          a_block = a_blocks[0]
          plgpu.wgmma(acc, a_block.at[pl.ds(row0, t.tile_m)] if t.split == "m" else a_block,
                      b_part(b_block))
        else:
          part = decode(a_blocks, wg, idxs[0])
          kp = t.tile_k // t.decode_parts
          for p in range(t.decode_parts):
            cols = slice(p * kp, (p + 1) * kp)
            a = part(cols)
            plgpu.wgmma(acc, a, b_part(b_block, cols if t.decode_parts > 1 else slice(None)))
            if decoded is not None:
              decoded(m_idx, n_idx, wg, idxs[0], cols, a)
        if after_mma is not None:
          after_mma(m_idx, n_idx, idxs[0], a_blocks)
        plgpu.wgmma_wait(0)
        return acc

      if wait_rows is not None:
        wait_rows(m_idx)
      state = None  # a pipeline of its own
      if chained:
        state = jnp.where(i == 0, int(plgpu.PipelinePipeline.START), jnp.where(
            i == count - 1, int(plgpu.PipelinePipeline.STOP),
            int(plgpu.PipelinePipeline.STEADY)))
      pipeline = self._pipeline(mma, context, state)
      cols = pl.ds(n_idx * t.cta_n, t.cta_n)
      w_block = w_ref.at[cols] if self.transpose_w else w_ref.at[:, cols]
      sources = a_refs(m_idx)
      if not isinstance(sources, Sources):
        pipeline(*sources, w_block, allocations=allocs)
        return
      for when, refs in sources.options:
        pl.when(when)(functools.partial(pipeline, *refs, w_block, allocations=allocs))


def dealt(tiles: int, first_sm: int | jax.Array = 0, workers_from: int = 0):
  """A loop over this SM's share of ``tiles`` tiles, dealt round-robin over the SMs from
  SM ``first_sm`` on (counting from SM ``workers_from``, the first that takes tiles): the
  body gets each tile's index, its place i in this SM's share and the share's size. A
  kernel that runs several loops one after the other (the reduce-scatter's phases) starts
  each where the last one's deal ended, so that no SM takes the remainder of every loop: at
  a tile count just above a multiple of the SMs, that remainder would make every loop take
  one more wave."""
  def loop(body):
    sms, sm = lax.axis_size(SM) - workers_from, lax.axis_index(SM) - workers_from
    place = lax.rem(sm + (sms - first_sm % sms), sms)  # this SM's place in the deal
    count = tiles // sms + lax.convert_element_type(place < tiles % sms, place.dtype)
    lax.fori_loop(0, count, lambda i, _: body(i * sms + place, i, count), None)
  return loop


def stage_out(value, out_smem, wg, slot: int, dest) -> None:
  """Stores a ``[epi_m, epi_n]`` value to gmem ``dest`` through staging slot ``slot`` of
  warpgroup ``wg`` (``out_smem_type``); the slot's previous store must have read it."""
  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  out_smem[wg, slot] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dest)


def store_tiles(value, out_smem, out_ref, row, col, wg, tiling: Tiling):
  """Writes a compute warpgroup's ``[tile_m, tile_n]`` ``value`` through its two staging
  slots (``out_smem_type``) to gmem ``out_ref`` from (``row``, ``col``) on, one
  ``[epi_m, epi_n]`` sub-tile at a time: one sub-tile's TMA store overlaps the staging of
  the next."""
  t = tiling
  parts = [(i, j) for i in range(t.tile_m // t.epi_m) for j in range(t.tile_n // t.epi_n)]
  for k, (i, j) in enumerate(parts):
    stage_out(value[i * t.epi_m:(i + 1) * t.epi_m, j * t.epi_n:(j + 1) * t.epi_n], out_smem,
              wg, k % 2, out_ref.at[pl.ds(row + i * t.epi_m, t.epi_m),
                                    pl.ds(col + j * t.epi_n, t.epi_n)])


def store_alone(value, out_smem, out_ref, row, col, wg, tiling: Tiling):
  """Writes a compute warpgroup's ``value`` (whole epilogue sub-tiles) to gmem ``out_ref``
  from (``row``, ``col``) on through its second staging slot, each sub-tile once every
  earlier store has read its slot: for stores between the epilogues (``store_tiles``, whose
  first sub-tile takes the first slot, so they need no wait of their own for these)."""
  t = tiling
  rows, cols = value.shape
  for i in range(rows // t.epi_m):
    for j in range(cols // t.epi_n):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[wg, 1] = value[i * t.epi_m:(i + 1) * t.epi_m, j * t.epi_n:(j + 1) * t.epi_n]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg, 1], out_ref.at[
          pl.ds(row + i * t.epi_m, t.epi_m), pl.ds(col + j * t.epi_n, t.epi_n)])


def out_smem_type(tiling: Tiling, dtype) -> plgpu.SMEM:
  """The epilogue's staging buffers: two per compute warpgroup."""
  return plgpu.SMEM((COMPUTE_WGS, 2, tiling.epi_m, tiling.epi_n), dtype,
                    transforms=swizzled(tiling.epi_n, dtype))


def split_refs(refs, *counts) -> list[list]:
  """A kernel body's refs, in order, as groups of ``counts`` refs (0: an empty group)."""
  groups, i = [], 0
  for c in counts:
    groups.append(list(refs[i:i + c]))
    i += c
  return groups


def rank_and_semaphores(axis_name, rank, n: int, local: bool, count: int):
  """This rank (``rank`` in local mode, else its index on ``axis_name``) and ``count``
  global semaphores that count the peers' landed copies, one per stage of the exchange (one
  counter for all stages would let a fast SM's next-stage signal stand in for a slow SM's
  missing one): None in local mode or alone (n = 1, no peers and no symmetric memory)."""
  if n == 1:  # no peers: the mesh axis is not even asked for (that would need NVSHMEM)
    return (0 if rank is None else rank), None
  r = lax.axis_index(axis_name) if rank is None else rank
  if local:
    return r, None
  return r, pl.get_global(plgpu.SemaphoreType.REGULAR((count,)))


def relay(count, signal, *, expected: int, relays, peers, axis_name, wait: int = 0) -> None:
  """The end of a stage of a multi-GPU kernel: the caller (a warpgroup or an SM) counts on
  ``count``, a semaphore of this GPU (a release at GPU scope); the one where ``relays``
  holds waits until ``expected`` have counted, then signals ``signal`` on each of ``peers``
  behind one fence (a release at system scope, which carries what the counts released),
  and with ``wait`` then waits until that many peers have signalled it. One relayed signal
  rather than one from every warpgroup: system-scope signals given by a GPU's 264 compute
  warpgroups at once were served one after the other and held SMs for up to ~200 us
  (benchmarks/profile_rs_kernel.py; docs/parallel.md, "Found on 2026-11-24")."""
  plgpu.semaphore_signal(count, memory_scope="gpu")

  @pl.when(relays)
  def _relay():
    plgpu.semaphore_wait(count, value=expected, decrement=False, memory_scope="gpu")
    plgpu.semaphore_signal_parallel(*(
        plgpu.SemaphoreSignal(signal, device_id={axis_name: p}) for p in peers))
    if wait:
      pl.semaphore_wait(signal, value=wait, decrement=False)


_profile_dir: list[tuple[str, int]] = []  # set by ``profiling``


@contextlib.contextmanager
def profiling(trace_dir: str, events: int = 96):
  """Kernels built inside record, per warpgroup, when each ``jax.named_scope`` region of
  their bodies (``mma``, ``epilogue``, the waits) begins and ends, up to ``events``
  regions, and write a Chrome trace per call to ``trace_dir`` (Mosaic GPU's on-device
  profiler; benchmarks/profile_rs_kernel.py reads them)."""
  _profile_dir.append((trace_dir, events))
  try:
    yield
  finally:
    _profile_dir.pop()


class _HashableDict(dict):
  """A dict argument made a jit key: its items, frozen."""
  def __hash__(self):
    return hash(tuple(sorted(self.items())))


def lowered_once(*static: str, reads: tuple[str, ...] = ()):
  """Decorator: ``jax.jit`` for a kernel's entry point, with the arguments named in
  ``static`` static (a dict among them is keyed by its items). A step calls each kernel once
  a layer, and inside one jit every call of a Pallas kernel is traced and lowered again, its
  Mosaic GPU module copied into the step's: jitted, each shape and setting lowers once (the
  GELU GEMMs of 12 layers at the 350M's shapes lowered in 1.2 s to 0.5 MB of module, against
  9.7 s and 5.6 MB; the 350M trainer compiled in 24 s against 90 on one H200). Whether the
  kernels are built with the profiler (``profiling``) is part of the key, and so are the
  current values of the module globals named in ``reads`` (the defaults the entry point
  falls back on, e.g. a module's ``TILING``): a default changed after a shape's first trace
  gives a new kernel, not the old one. The entry point gets every argument by name, its
  defaults filled in. Under jax's GPU interpreter (the CPU tests) it runs unjitted, as
  before: there jitted kernels once deadlocked the interpreter's threads on a 2-core machine
  (its warpgroups' eager ops waiting for the CPU backend)."""
  def decorate(fn):
    signature = inspect.signature(fn)

    def by_name(_profile, _reads, **arguments):
      return fn(**arguments)
    by_name.__name__ = by_name.__qualname__ = fn.__name__
    jitted = jax.jit(by_name, static_argnames=(*static, "_profile", "_reads"))

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if interpreting():
        return fn(*args, **kwargs)
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      arguments = {k: _HashableDict(v) if k in static and isinstance(v, dict) else v
                   for k, v in bound.arguments.items()}
      return jitted(_profile=tuple(_profile_dir),
                    _reads=tuple(fn.__globals__[name] for name in reads), **arguments)
    return call
  return decorate


def interpreting() -> bool:
  """Whether kernels run under jax's GPU interpreter (``force_gpu_interpret_mode``: the CPU
  tests) rather than on the GPU."""
  return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def clusters(num_sms: int, cluster_n: int) -> int:
  """How many clusters of ``cluster_n`` CTAs a persistent kernel on ``num_sms`` SMs runs: as
  many as the GPU holds at once (``RESIDENT_CLUSTERS``)."""
  return min(num_sms // cluster_n, RESIDENT_CLUSTERS.get(cluster_n, num_sms))


def kernel(body, *, out_type, num_sms: int, scratch_types=None, name: str,
           cluster_n: int = 1, approx_math: bool = False):
  """A persistent kernel on ``num_sms`` SMs: CTAs of 2 compute + 1 memory warpgroups, one
  per SM, or in ``clusters`` of ``cluster_n`` (the grid's ``SM`` axis then counts them);
  ``approx_math``: the GPU's fast approximations of tanh, exp, ... (Mosaic GPU's)."""
  profile = {}
  if _profile_dir:
    trace_dir, events = _profile_dir[-1]
    profile = dict(profile_dir=trace_dir, profile_space=events, profile_bounds_check=True)
  cluster = dict(cluster=(cluster_n,), cluster_names=(CLUSTER,)) if cluster_n > 1 else {}
  return plgpu.kernel(
      body, out_type=out_type, grid=(clusters(num_sms, cluster_n),), grid_names=(SM,),
      num_threads=COMPUTE_WGS + 1, thread_name=WG, scratch_types=scratch_types or {},
      kernel_name=name, compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx_math,
          **profile), **cluster)


def weight_kn(w_shape, transpose_w: bool = False) -> tuple[int, int]:
  """``(K, N)`` of a weight ``[K, N]``, or ``[N, K]`` with ``transpose_w``."""
  k, n = w_shape
  return (n, k) if transpose_w else (k, n)


@jax.tree_util.register_pytree_node_class
class Store:
  """What a kernel makes of each compute warpgroup's fp32 accumulator: here, the plain
  store in the output's dtype. Subclasses apply math on the way, write more outputs and
  read arrays of their own (``gelu_gemm``'s epilogues). Epilogues are pytrees, so that a
  jitted kernel (``lowered_once``) takes their arrays as operands: a subclass registers
  itself and names the attributes that hold its arrays and its settings.

  A kernel on ``TileLoop`` passes ``inputs`` as operands after its own and its outputs'
  types from ``outputs``, allocates ``scratch`` beside its own (whose ``out_smem`` the
  epilogue may use where ``staged``), and for each warpgroup tile, whose first output
  element is (``row``, ``col``), calls ``before_tile`` before the tile's pipeline and
  ``store`` with its accumulator; ``ins`` and ``outs`` are the gmem refs of ``inputs`` and
  of the outputs, in order."""
  name = ""            # the kernel name's suffix
  approx_math = False  # compiled with the GPU's fast approximations of tanh, exp, ...
  staged = True        # stores through the kernel's staging buffers (``out_smem``)
  # the most pipeline stages of 64 that leave room for the epilogue's shared memory (None:
  # any, ``fit``)
  max_stages: int | None = None

  array_fields: tuple[str, ...] = ()    # its arrays (``inputs``, in order)
  setting_fields: tuple[str, ...] = ()  # its settings (hashable)
  # how many of ``outputs``, the first ones, have the kernel's rows (None: all); the others
  # (``gelu_gemm.GeluGrad``'s sums) keep their own shape
  row_outputs: int | None = None

  @property
  def inputs(self) -> tuple:
    return tuple(getattr(self, f) for f in self.array_fields)

  def outputs(self, m: int, n: int, dtype) -> tuple:
    return (jax.ShapeDtypeStruct((m, n), dtype),)

  def misfit(self, n: int, tiling: Tiling) -> str | None:
    """Why this epilogue cannot store ``n`` output columns on ``tiling``, or None."""
    return None

  def scratch(self, tiling: Tiling) -> dict:
    return {}

  def with_rows(self, outs, lead) -> tuple:
    """``outs``, the kernel's outputs, with their rows ``[M, N]`` as ``[*lead, N]`` (M =
    prod(lead)): those of ``row_outputs``."""
    rows = len(outs) if self.row_outputs is None else self.row_outputs
    return (*(o.reshape(*lead, o.shape[-1]) for o in outs[:rows]), *outs[rows:])

  def kernel_scratch(self, tiling: Tiling, out_dtype, staging: bool = False) -> dict:
    """``scratch``, with the kernel's staging buffers (``out_smem_type``) where this
    epilogue stores through them (``staged``) or the kernel needs them too (``staging``)."""
    scratch = self.scratch(tiling)
    if self.staged or staging:
      scratch["out_smem"] = out_smem_type(tiling, out_dtype)
    return scratch

  def before_tile(self, t: Tiling, ins, scratch, row, col, wg) -> None:
    pass

  def store(self, t: Tiling, ins, outs, scratch, acc, row, col, wg) -> None:
    store_tiles(acc.astype(outs[0].dtype), scratch["out_smem"], outs[0], row, col, wg, t)

  def reference(self, acc, dtype) -> tuple:
    """The outputs, in jnp, from the whole fp32 product ``acc`` (its rows as the output's):
    what ``store`` writes tile by tile, for paths where no kernel runs."""
    return (acc.astype(dtype),)

  def tree_flatten(self):
    return self.inputs, tuple(getattr(self, f) for f in self.setting_fields)

  @classmethod
  def tree_unflatten(cls, settings, arrays):
    epilogue = cls.__new__(cls)
    for field, value in zip(cls.array_fields + cls.setting_fields, (*arrays, *settings)):
      setattr(epilogue, field, value)
    return epilogue

  def fit(self, tiling: Tiling) -> Tiling:
    """``tiling``, with fewer pipeline stages of 64 where it leaves no room for this
    epilogue's shared memory (``max_stages``; a pipeline of steps of 128 decoded in halves
    becomes one of steps of 64)."""
    if self.max_stages is None or tiling.stages * tiling.tile_k <= 64 * self.max_stages:
      return tiling
    return dataclasses.replace(tiling, tile_k=64, stages=self.max_stages, decode_parts=1)


def sub_tiles(t: Tiling) -> list[tuple[slice, slice]]:
  """The (rows, columns) of each ``[epi_m, epi_n]`` epilogue sub-tile of a warpgroup's tile:
  an epilogue with math works a sub-tile at a time, so that its fp32 temporaries stay in
  registers beside the accumulator."""
  return [(slice(i * t.epi_m, (i + 1) * t.epi_m), slice(j * t.epi_n, (j + 1) * t.epi_n))
          for i in range(t.tile_m // t.epi_m) for j in range(t.tile_n // t.epi_n)]


@jax.tree_util.register_pytree_node_class
class AddBias(Store):
  """The store of ``acc + b`` (fp32, then the output's dtype), b ``[N]``: each compute
  warpgroup's bias columns are copied into shared memory as its tile starts, and are there
  by its epilogue. Subclasses apply more math to the biased sub-tiles (``biased``)."""
  name = "_bias"
  array_fields = ("bias_1N",)

  def __init__(self, bias_N):
    self.bias_1N = bias_N.astype(jnp.float32).reshape(1, -1)

  def check_width(self, n: int, what: str) -> None:
    if self.bias_1N.shape[1] != n:
      raise ValueError(f"{what}: bias ({self.bias_1N.shape[1]},) is not ({n},)")

  def outputs(self, m, n, dtype):
    self.check_width(n, "matmul + bias")
    return (jax.ShapeDtypeStruct((m, n), dtype),)

  def scratch(self, t):
    return dict(bias_smem=plgpu.SMEM((COMPUTE_WGS, 1, t.tile_n), jnp.float32),
                bias_barrier=plgpu.Barrier(num_barriers=COMPUTE_WGS))

  def reference(self, acc, dtype):
    return ((acc + self.bias_1N[0]).astype(dtype),)

  def before_tile(self, t, ins, scratch, row, col, wg):
    plgpu.copy_gmem_to_smem(ins[0].at[:, pl.ds(col, t.tile_n)], scratch["bias_smem"].at[wg],
                            scratch["bias_barrier"].at[wg])

  def biased(self, t, scratch, acc, wg, dtype):
    """Each epilogue sub-tile ``(rows, cols, acc[rows, cols] + b)``, in ``dtype``, once the
    tile's bias is in shared memory."""
    plgpu.barrier_wait(scratch["bias_barrier"].at[wg])
    for rows, cols in sub_tiles(t):
      bias = scratch["bias_smem"][wg, 0, pl.ds(cols.start, t.epi_n)]
      yield rows, cols, (acc[rows, cols] + bias[None, :]).astype(dtype)

  def store(self, t, ins, outs, scratch, acc, row, col, wg):
    for k, (rows, cols, y) in enumerate(self.biased(t, scratch, acc, wg, outs[0].dtype)):
      stage_out(y, scratch["out_smem"], wg, k % 2, outs[0].at[
          pl.ds(row + rows.start, t.epi_m), pl.ds(col + cols.start, t.epi_n)])


def matmul(a_XK, w_KN, *, tiling: Tiling = Tiling(), num_sms: int, out_dtype=None,
           transpose_w: bool = False):
  """``a @ w`` (fp32 accumulation) by the GEMM core alone, with no hooks: the yardstick of
  the collective-matmul kernels' own speed (bench_collective_matmul's ``core``: what the
  kernels' copies and epilogues cost on top of it, and how far it is from cuBLAS), and the
  matmul of a kernel whose communication is free. a ``[..., K]``: its leading dimensions
  are the rows, and the result keeps them. ``transpose_w``: w is given ``[N, K]`` and
  multiplied transposed (``TileLoop``)."""
  return matmul_epilogue(a_XK, w_KN, Store(), tiling=tiling, num_sms=num_sms,
                         out_dtype=out_dtype, transpose_w=transpose_w, name="taco_gemm")[0]


@lowered_once("tiling", "num_sms", "out_dtype", "transpose_w", "name")
def matmul_epilogue(a_XK, w_KN, epilogue: Store, *, tiling: Tiling = Tiling(),
                    num_sms: int, out_dtype=None, transpose_w: bool = False,
                    name: str = "taco_matmul"):
  """``matmul`` with ``epilogue`` in place of the plain store: its outputs, each with a's
  leading dimensions (``out_dtype``: theirs, default a's)."""
  t = tiling
  *lead, k = a_XK.shape
  a_MK = a_XK.reshape(-1, k)
  (m, _), (wk, n) = a_MK.shape, weight_kn(w_KN.shape, transpose_w)
  if wk != k:
    raise ValueError(f"{name}: a {a_XK.shape} and w {w_KN.shape} do not contract"
                     + " (w transposed)" * transpose_w)
  reason = t.misfit(rows_per_seq=m, m=m, n=n, k=k, num_sms=num_sms) or epilogue.misfit(n, t)
  if reason:
    raise ValueError(f"{name}: {reason}")
  out_dtype = out_dtype or a_MK.dtype
  loop = TileLoop(t, [Operand((t.cta_m, t.tile_k), a_MK.dtype, lambda kk: (0, kk))],
                  w_KN.dtype, k, transpose_w)
  out_types = epilogue.outputs(m, n, out_dtype)
  n_ins = len(epilogue.inputs)

  def body(a_ref, w_ref, *refs, **scratch):
    ins, outs = refs[:n_ins], refs[n_ins:]

    def at(m_idx, n_idx, wg):
      return t.wg_start(m_idx * t.cta_m, n_idx, wg)

    @functools.partial(pl.run_scoped, allocs=loop.allocations(a_ref, w_ref),
                       collective_axes=WG)
    def _scope(allocs):
      def before_tile(m_idx, n_idx, wg):
        epilogue.before_tile(t, ins, scratch, *at(m_idx, n_idx, wg), wg)

      def store(m_idx, n_idx, wg, acc):
        epilogue.store(t, ins, outs, scratch, acc, *at(m_idx, n_idx, wg), wg)
      loop.run(allocs, m=m, n=n, w_ref=w_ref, epilogue=store, before_tile=before_tile,
               a_refs=lambda m_idx: [a_ref.at[pl.ds(m_idx * t.cta_m, t.cta_m)]])
    plgpu.wait_smem_to_gmem(0)

  outs = kernel(body, out_type=out_types, num_sms=num_sms,
                scratch_types=epilogue.kernel_scratch(t, out_dtype),
                name=name + epilogue.name, cluster_n=t.cluster_n,
                approx_math=epilogue.approx_math)(a_MK, w_KN, *epilogue.inputs)
  return epilogue.with_rows(outs, lead)


def num_sms(default: int = 4) -> int:
  """The multiprocessor count of the first device (132 on an H100 / H200), or ``default``
  where the device has none (CPU, where the kernels run in interpret mode)."""
  return getattr(jax.devices()[0], "core_count", None) or default
