"""Matmul + reduce-scatter in one Mosaic GPU kernel: ``out = reduce_scatter(y @ w, axis)``
along the sequence, each partial tile sent to its owner as soon as it is computed; plain or
FP8-compressed.

Inside a ``jax.shard_map`` over ``axis`` (n ranks; this rank r), y ``[B, T, F]`` is this
rank's slice of the features for the full sequence and w ``[F, D]`` its rows of the weight;
rank c owns chunk c of the sequence (rows ``c S .. (c + 1) S`` of every sequence, S = T / n)
of the sum over ranks. Each partial output tile of a peer's chunk goes, straight from the
epilogue, into slot c of this rank's outbox, in local memory, while the next tiles are
computed; the owner's epilogue reads the peers' partials for its tile out of their
outboxes (``plgpu.remote_ref``; the first ``pull_depth`` TMA loads start before the tile's
matmul, so they land while it runs, and each later one as a slot is read) and adds them to
its accumulator, in fp32. The row tiles of every chunk come in ``phases`` groups
(``schedule``): phase p of each peer's chunk (``c = r + 1, ..., r + n - 1``), then phase
p - 1 of the own chunk, whose partials the peers wrote one phase earlier.
Once every warpgroup of a rank has written its partials of a phase for all its peers, one
relayed signal tells each peer (``relay``); the peer's own phase starts when every peer's
has come. One signal per phase rather than per peer's loop: each needs every warpgroup's
stores drained first, and at TP=4 the twelve drains of a 4-phase kernel cost the FP8
kernel 0.025-0.031 ms (``_skip``'s ``signals``, bench_collective_matmul_nvlink_skip_fp8_4gpu);
the peers' own loops of a phase come after their sent loops of the next one, so a signal
sent after all of a phase's sent loops still comes before it is waited for.
A last one holds every rank until its peers have read its outbox.
The relaying warpgroup waits for all the others, and its SM's tiles with it: it is the one
on the SM dealt the phase's last tile, which is about the last to finish anyway, rather
than always SM 0, which would wait out the other SMs' lag at every phase; and it signals
every peer behind one fence (``plgpu.semaphore_signal_parallel``).

Why pull and relay: with every warpgroup signalling its peer itself (a release at system
scope), the signals of a GPU's 264 compute warpgroups were served one after the other and
held SMs for up to ~200 us; the relay is what took the kernel from the matmul's time plus
the whole transfer's to 1.09x the matmul at the 1.3B MLP-out (pulling alone gained ~4%).
Pulling keeps the sender's stores local, so a sent loop's stores have landed, and can be
signalled, as soon as the loop ends (docs/parallel.md, "Found on 2026-11-24").

Compressed (``fp8``: the codec's settings), each partial tile is encoded in the epilogue, in
groups of G = ``tile_n`` columns along the hidden dimension, with the codec's own
``encode_groups``: FP8 codes plus one fp32 multiplier per row and group
(``decode.group_multiplier``). The owner encodes its own tile the same way and sums the n
decoded partials in fp32 in rank order: the codes and the sum of the compressed
reduce-scatter (``matmul_reduce_scatter_reference``).

``rank`` and ``received`` give local mode, for the CPU tests (jax's GPU interpret mode
simulates no peer copies or semaphores): the peers' partials for this rank come from
``received`` instead of their outboxes.
"""
from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm
from taco_jax.pallas_kernels.common import FP8_DTYPES
from taco_jax.pallas_kernels.ag_matmul import decode_tile
from taco_jax.pallas_kernels.decode import decode_reference, group_multiplier
from taco_jax.pallas_kernels.encode import encode_groups, encode_reference


def matmul_reduce_scatter_reference(y_BTF, w_FD, axis_name, *, fp8=None, out_dtype=None):
  """``reduce_scatter(y @ w)`` along the sequence (axis 1), with XLA: the matmul in y's
  dtype, then the plain collective, or with ``fp8`` (codec settings: ``group_size``,
  ``fmt``, ``dual_scale``, ``lam``) the compressed one: each destination chunk encoded,
  exchanged, decoded and summed in fp32 in rank order."""
  p = jnp.einsum("btf,fd->btd", y_BTF, w_FD, preferred_element_type=jnp.float32)
  p = p.astype(y_BTF.dtype)
  out_dtype = out_dtype or y_BTF.dtype
  if fp8 is None:
    return lax.psum_scatter(p, axis_name, scatter_dimension=1, tiled=True).astype(out_dtype)
  n = lax.axis_size(axis_name)
  b, t, d = p.shape
  chunks = jnp.moveaxis(p.reshape(b, n, t // n, d), 1, 0).reshape(n, -1, d)
  enc = [encode_reference(chunks[c], hadamard=False, **fp8) for c in range(n)]
  got = [lax.all_to_all(jnp.stack(a), axis_name, 0, 0, tiled=True) for a in zip(*enc)]
  total = jnp.zeros(chunks.shape[1:], jnp.float32)
  for i in range(n):
    total = total + decode_reference(got[0][i], got[1][i], got[2][i],
                                     group_size=fp8["group_size"], hadamard=False,
                                     out_dtype=jnp.float32)
  return total.astype(out_dtype).reshape(b, t // n, d)


# the epilogue's staging and receive buffers leave shared memory for 3 pipeline stages
TILING = gemm.Tiling(stages=3)
FP8_TILING = gemm.Tiling(stages=3, epi_n=32)  # G = tile_n = 128; the codes' buffers too


MAX_PHASES = 4
PULL_DEPTH = 2  # receive slots per warpgroup: the peers' partial blocks in flight
# what shared memory holds beside the pipeline's three stages at the default tiles: with
# 4 slots the kernels need 240 KB (plain) and 228 KB (FP8) of the 227 KB a block may have
MAX_PULL_DEPTH = 3


def misfit(y_shape, w_shape, n: int, tiling: gemm.Tiling, group_size: int | None = None,
           phases: int | None = None, pull_depth: int = PULL_DEPTH):
  """Why the kernel cannot take y ``[B, T, F]`` and w ``[F, D]`` over n ranks with these
  tiles (and, for the FP8 kernel, groups of ``group_size``; ``phases`` row-tile groups;
  ``pull_depth`` receive slots), or None when it can."""
  b, t, f = y_shape
  if w_shape[0] != f:
    return f"y {tuple(y_shape)} and w {tuple(w_shape)} do not contract"
  if t % n:
    return f"sequence {t} is not divisible by the {n} ranks"
  if group_size is not None and group_size != tiling.tile_n:
    return (f"the FP8 kernel encodes groups of its tile_n ({tiling.tile_n}) columns, "
            f"not {group_size}")
  reason = tiling.misfit(rows_per_seq=t // n, m=b * t // n, n=w_shape[1], k=f,
                         clusters="the reduce-scatter kernels take no clusters of CTAs")
  row_tiles = b * t // n // tiling.cta_m
  if reason is None and phases is not None and (phases < 1 or row_tiles % phases):
    return f"{phases} phases do not divide the chunk's {row_tiles} row tiles"
  if reason is None and not 1 <= pull_depth <= MAX_PULL_DEPTH:
    return f"pull_depth={pull_depth} is not between 1 and {MAX_PULL_DEPTH}"
  return reason


def default_phases(row_tiles: int) -> int:
  """The most phases, up to ``MAX_PHASES``, that divide a chunk's row tiles evenly."""
  return max(p for p in range(1, MAX_PHASES + 1) if row_tiles % p == 0)


def schedule(n: int, phases: int) -> list[tuple[int, int]]:
  """The order of a rank's tile loops, one after the other: ``(q, p)``, phase p of chunk
  ``r + q`` (q = n: its own). Phase p of every peer's chunk comes one loop or more before
  phase p of the own chunk, which waits for the peers' partials of that phase: every rank
  sends what the others wait for before it waits itself, and the own phase p - 1 computes
  while phase p's partials are on the link. (One loop that mixed the peers' phase p with
  the own phase p - 1 measured slower on 2xH200, when the senders pushed and again when
  the owners pulled: docs/parallel.md.)"""
  order = []
  for p in range(phases + 1):
    order += [(q, p) for q in range(1, n) if p < phases] + ([(n, p - 1)] if p > 0 else [])
  return order


def loop_index(q, p, n: int, phases: int):
  """Loop (q, p)'s place in ``schedule(n, phases)``, q and p maybe traced: the loops before
  a sent loop are the sent loops of the earlier phases and the own loops of all but the
  last of them; before the own loop of phase p come the sent loops of phases up to p + 1."""
  sent = (n - 1) * p + q - 1 + jnp.maximum(p - 1, 0)
  own = (n - 1) * jnp.minimum(p + 2, phases) + p
  return jnp.where(q == n, own, sent)


class _Epilogues:
  """What each compute warpgroup does with its fp32 ``[tile_m, tile_n]`` accumulator:
  ``send`` a peer's partial tile (as the transfer dtype, or encoded) to ``dest`` arrays,
  ``finish`` this rank's tile by adding the received partials and storing the result."""

  def __init__(self, tiling, *, n, dtype, out_dtype, fp8, depth, scratch):
    self.t, self.n, self.dtype, self.out_dtype = tiling, n, dtype, out_dtype
    self.fp8, self.depth, self.s = fp8, depth, scratch

  def _slabs(self):
    return range(self.t.tile_m // self.t.epi_m)

  def _encode(self, x):
    """A slab's partials as the reference sends them: in the transfer dtype, encoded."""
    fp8 = self.fp8
    codes, alpha, scale = encode_groups(
        x.astype(self.dtype).astype(jnp.float32), None, fmt=fp8["fmt"],
        dual_scale=fp8["dual_scale"], lam=fp8["lam"], fixed_order=False)
    return codes, group_multiplier(alpha, scale)

  def send(self, acc, wg, row, col, dests):
    """``dests``: (codes or values, multipliers or None) refs of ``[rows, D]`` (and
    ``[D / G, rows]``) into which this tile's partials go at (row, col)."""
    t = self.t
    if not self.fp8:
      for values, _ in dests:
        gemm.store_tiles(acc.astype(self.dtype), self.s["out_smem"], values, row, col, wg, t)
      return
    codes_smem, mult_smem = self.s["codes_smem"], self.s["mult_smem"]
    slabs = len(self._slabs())
    for i in range(slabs):
      codes, mult = self._encode(acc[i * t.epi_m:(i + 1) * t.epi_m])
      slot = i % 2
      # the copies that last read this slot (two slabs ago) must be done; with an odd
      # number of slabs, a tile's first slab takes the slot of the last tile's last slab
      reused_at_once = i == 0 and slabs % 2
      plgpu.wait_smem_to_gmem(0 if reused_at_once else 2 * len(dests), wait_read_only=True)
      codes_smem[wg, slot] = codes
      mult_smem[wg, slot, 0] = mult
      plgpu.commit_smem()
      rows = pl.ds(row + i * t.epi_m, t.epi_m)
      for dest_codes, dest_mult in dests:
        plgpu.copy_smem_to_gmem(codes_smem.at[wg, slot], dest_codes.at[rows, pl.ds(col, t.tile_n)])
        plgpu.copy_smem_to_gmem(mult_smem.at[wg, slot],
                                dest_mult.at[pl.ds(col // t.tile_n, 1), rows])

  @functools.cached_property
  def _reads(self) -> list[tuple[int, int, int]]:
    """The order in which ``finish`` reads the peers' partials: ``(slab, block, j)``, the
    peers in rank order (rank ``j + (j >= r)``, this rank skipped) per ``[epi_m, epi_n]``
    block of each slab; the FP8 kernel reads a slab's codes whole (one block)."""
    blocks = 1 if self.fp8 else self.t.tile_n // self.t.epi_n
    return [(i, c, j) for i in self._slabs() for c in range(blocks) for j in range(self.n - 1)]

  def _barrier(self, wg, slot: int, which: int):
    return self.s["in_barrier"].at[(wg * self.depth + slot) * 2 + which]

  def _fetch(self, k: int, wg, r, row, col, peer):
    """Starts the TMA loads of read ``k`` (``_reads``) from the peer's partials (``peer(a,
    p)``: array a of what rank p sent this rank) into receive slot ``k % depth``."""
    t, (i, c, j), slot = self.t, self._reads[k], k % self.depth
    p, rows = j + (r <= j), pl.ds(row + i * t.epi_m, t.epi_m)
    if not self.fp8:
      plgpu.copy_gmem_to_smem(peer(0, p).at[rows, pl.ds(col + c * t.epi_n, t.epi_n)],
                              self.s["in_values"].at[wg, slot], self._barrier(wg, slot, 0))
      return
    plgpu.copy_gmem_to_smem(peer(0, p).at[rows, pl.ds(col, t.tile_n)],
                            self.s["codes_smem"].at[wg, slot], self._barrier(wg, slot, 0))
    plgpu.copy_gmem_to_smem(peer(1, p).at[pl.ds(col // t.tile_n, 1), rows],
                            self.s["mult_smem"].at[wg, slot], self._barrier(wg, slot, 1))

  def prefetch(self, wg, r, row, col, peer):
    """Before this rank's own tile is computed: the loads of its first ``depth`` reads, so
    that they land while the matmul runs. The FP8 kernel's reuse the send buffers (an own
    tile sends nothing), once the last sent tile has been read out of them."""
    if self.fp8:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for k in range(min(self.depth, len(self._reads))):
      self._fetch(k, wg, r, row, col, peer)

  def discard(self, wg, r, row, col, peer, every: bool):
    """Waits for the loads a sent tile's ``prefetch`` started (``_probe``), unread; with
    ``every``, for all of an own tile's reads, each slot refilled as ``finish`` does."""
    if every:
      for k in range(len(self._reads)):
        self._take(k, wg, r, row, col, peer)
      return
    for k in range(min(self.depth, len(self._reads))):
      plgpu.barrier_wait(self._barrier(wg, k % self.depth, 0))

  def _take(self, k: int, wg, r, row, col, peer):
    """Read ``k``'s partial in fp32, once its loads have landed; its slot is refilled with
    read k + depth."""
    slot = k % self.depth
    with jax.named_scope("wait_read"):
      plgpu.barrier_wait(self._barrier(wg, slot, 0))
      if self.fp8:
        plgpu.barrier_wait(self._barrier(wg, slot, 1))
    if self.fp8:
      got = decode_tile(self.s["codes_smem"][wg, slot], self.s["mult_smem"][wg, slot, 0],
                        jnp.float32)
    else:
      got = self.s["in_values"][wg, slot].astype(jnp.float32)
    if k + self.depth < len(self._reads):
      plgpu.commit_smem()  # every warp has read the slot before the TMA refills it
      self._fetch(k + self.depth, wg, r, row, col, peer)
    return got

  def _fp8_sums(self, acc, wg, r, row, col, peer):
    """Per slab, the n decoded partials (this rank's own, encoded and decoded as sent)
    summed in fp32 in rank order, as the reference sums."""
    t, n = self.t, self.n
    for i in self._slabs():
      own = decode_tile(*self._encode(acc[i * t.epi_m:(i + 1) * t.epi_m]), jnp.float32)
      total = jnp.zeros_like(own)
      for j in range(n - 1):
        mine = jnp.broadcast_to(r == j, own.shape)  # select_n takes no scalar predicate
        total = jnp.where(mine, total + own, total)  # this rank's place in rank order
        total = total + self._take(i * (n - 1) + j, wg, r, row, col, peer)
      last = jnp.broadcast_to(r == n - 1, own.shape)
      yield i, jnp.where(last, total + own, total)

  def finish(self, acc, wg, r, row, col, peer, out_ref):
    """This rank's tile: its partial plus the peers' (``peer(a, p)``: array a of what rank
    p sent this rank, ``[rows, D]`` values or codes and ``[D / G, rows]`` multipliers),
    stored to ``out_ref`` at (row, col)."""
    t, n = self.t, self.n
    cols = t.tile_n // t.epi_n
    if self.fp8:
      slabs = self._fp8_sums(acc, wg, r, row, col, peer)
    else:
      slabs = ((i, acc[i * t.epi_m:(i + 1) * t.epi_m]) for i in self._slabs())
    for i, slab in slabs:
      rows = pl.ds(row + i * t.epi_m, t.epi_m)
      for c in range(cols):
        v, block = slab[:, c * t.epi_n:(c + 1) * t.epi_n], i * cols + c
        if not self.fp8:
          for j in range(n - 1):  # the peers' partials, in rank order
            v = v + self._take(block * (n - 1) + j, wg, r, row, col, peer)
        gemm.stage_out(v.astype(self.out_dtype), self.s["out_smem"], wg, block % 2,
                       out_ref.at[rows, pl.ds(col + c * t.epi_n, t.epi_n)])

  def scratch_types(self) -> dict:
    t, wgs, depth = self.t, gemm.COMPUTE_WGS, self.depth
    out = dict(out_smem=gemm.out_smem_type(t, self.out_dtype),
               # per warpgroup and receive slot: values or codes, and multipliers
               in_barrier=plgpu.Barrier(num_barriers=wgs * depth * 2))
    if self.fp8:  # the send slots (two) are receive slots too
      codes_dtype, slots = jnp.dtype(self.fp8["codes_dtype"]), max(2, depth)
      out.update(
          codes_smem=plgpu.SMEM((wgs, slots, t.epi_m, t.tile_n), codes_dtype,
                                transforms=gemm.swizzled(t.tile_n, codes_dtype)),
          mult_smem=plgpu.SMEM((wgs, slots, 1, t.epi_m), jnp.float32))
    else:
      out.update(in_values=plgpu.SMEM((wgs, depth, t.epi_m, t.epi_n), self.dtype,
                                      transforms=gemm.swizzled(t.epi_n, self.dtype)))
    return out


def _call(y_RF, w_FD, *, s: int, n: int, rank, axis_name, tiling: gemm.Tiling,
          num_sms: int, out_dtype, phases: int, pull_depth: int, transpose_w: bool,
          fp8=None, received=None, skip=(), probe=()):
  """The kernel on y's rows ``[B T, F]`` (``s`` rows per sequence shard). ``received``
  (local mode): what the peers sent this rank, the outbox slots' arrays stacked by
  sender. Returns the output rows ``[B S, D]`` and the outbox (``slot_shapes``)."""
  t = tiling
  local = received is not None
  rows, f = y_RF.shape
  t_len, d = n * s, gemm.weight_kn(w_FD.shape, transpose_w)[1]
  out_rows = rows // n
  dtype = y_RF.dtype
  loop = gemm.TileLoop(t, [gemm.Operand((t.cta_m, t.tile_k), dtype, lambda kk: (0, kk))],
                       w_FD.dtype, f, transpose_w)
  slot_types = slot_shapes(n, out_rows, d, dtype, fp8 and dict(fp8, group_size=t.tile_n))
  n_slots = len(slot_types)
  signals = num_sms * gemm.COMPUTE_WGS  # every compute warpgroup of every SM sends
  epilogues = functools.partial(_Epilogues, t, n=n, dtype=dtype, out_dtype=out_dtype, fp8=fp8,
                                depth=pull_depth)

  def body(*refs, **scratch):
    (y_ref, w_ref), received_refs, (out_ref,), outbox = gemm.split_refs(
        refs, 2, n_slots if local else 0, 1, n_slots)
    # per phase and for the release at the end: the peers' relayed signals, then the counts
    # of this rank's own warpgroups (``relay``)
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, 2 * (phases + 1))
    peers = [lax.rem(r + q, n) for q in range(1, n)]  # whom every relayed signal goes to

    def peer(a, p):  # array a of what rank p sent this rank: slot r of p's outbox
      if local:
        return received_refs[a].at[p]
      if "remote" in skip:
        return outbox[a].at[r]
      return plgpu.remote_ref(outbox[a], {axis_name: p}).at[r]

    def probed(a, p):  # where a sent tile's probe reads (``_probe``)
      return outbox[a].at[r] if "sent_local_reads" in probe else peer(a, p)
    epi = epilogues(scratch=scratch)
    phase_tiles = out_rows // t.cta_m // phases
    cols = d // t.cta_n

    def first_sm(q, p):  # loop (q, p)'s tiles are dealt on from where the last one's ended
      return lax.rem(loop_index(q, p, n, phases) * (phase_tiles * cols), num_sms)

    def last_sm(q, p):  # the SM dealt loop (q, p)'s last tile (``gemm.dealt``)
      return lax.rem(first_sm(q, p) + phase_tiles * cols - 1, num_sms)

    def y_row(c, m_idx):  # the row of chunk c's row tile m_idx in y
      row = m_idx * t.cta_m
      return (row // s) * t_len + c * s + row % s

    def relay(slot: int | jax.Array, last_loop):
      """This warpgroup's part of a loop is done (its partials are in the outbox, or its
      reads landed): `gemm.relay`, from compute warpgroup 0 of the SM dealt the last tile of
      the schedule's loop ``last_loop``, ``(q, p)``, to every peer."""
      relays = (lax.axis_index(gemm.SM) == last_sm(*last_loop)) & (lax.axis_index(gemm.WG) == 0)
      gemm.relay(sems.at[phases + 1 + slot], sems.at[slot], expected=signals, relays=relays,
                 peers=peers, axis_name=axis_name)

    computes = lax.axis_index(gemm.WG) < gemm.COMPUTE_WGS  # the warpgroups that store

    def tile_loop(allocs, q, p, own: bool):
      """Loop (q, p) of the schedule: phase p of chunk r + q, sent (q < n) or this rank's
      own (q = n). Its tiles are dealt on from where the loops before it ended
      (``gemm.dealt``)."""
      if own and sems is not None and "waits" not in skip:  # the peers' phase p is written
        with jax.named_scope("wait_peers"):
          pl.semaphore_wait(sems.at[p], value=n - 1, decrement=False)
      c = lax.rem(r + q, n)

      def at(m_idx, n_idx, wg):  # a warpgroup tile's (row, column) in its chunk
        return t.wg_start((p * phase_tiles + m_idx) * t.cta_m, n_idx, wg)

      def epilogue(m_idx, n_idx, wg, acc):
        row, col = at(m_idx, n_idx, wg)
        if own:
          epi.finish(acc, wg, r, row, col, peer, out_ref)
          return
        dest = tuple(a.at[c] for a in outbox) + ((None,) * (fp8 is None))
        epi.send(acc, wg, row, col, [dest])
        if probe:
          epi.discard(wg, r, row, col, probed, every="sent_all_reads" in probe)

      def prefetch(m_idx, n_idx, wg):  # an own (or probed) tile's first reads
        epi.prefetch(wg, r, *at(m_idx, n_idx, wg), peer if own else probed)

      loop.run(allocs, m=phase_tiles * t.cta_m, n=d,
               a_refs=lambda m_idx: [y_ref.at[pl.ds(
                   y_row(c, p * phase_tiles + m_idx), t.cta_m)]],
               w_ref=w_ref, epilogue=epilogue, before_tile=prefetch if own or probe else None,
               first_sm=first_sm(q, p))

    def signal_phase(p):
      """After the phase's last sent loop: this rank's partials of phase p are in its
      outbox, which one signal tells every peer."""
      if sems is None or "signals" in skip:
        return

      @pl.when(computes)
      def _signal():
        with jax.named_scope("signal"):
          plgpu.wait_smem_to_gmem(0)  # the stores are local: they land at once
          relay(p, (n - 1, p))

    @functools.partial(pl.run_scoped, allocs=loop.allocations(y_ref, w_ref),
                       collective_axes=gemm.WG)
    def _scope(allocs):
      # ``schedule``'s order, as loops rather than unrolled, so that the kernel holds two
      # tile loops (sent, own) whatever n and the phases: unrolled, the FP8 kernel at TP=4
      # took XLA more than 300 s to compile into the training step, and the FP8 kernel ran
      # 16-17% slower at TP=2 (bench_collective_matmul_nvlink_rolled_2gpu_20261127)
      @pl.loop(0, phases + 1)
      def _phase(p):
        @pl.when(p < phases)
        def _sends():
          @pl.loop(1, n)
          def _send(q):
            tile_loop(allocs, q, p, own=False)
          signal_phase(p)

        @pl.when(p > 0)
        def _own():
          tile_loop(allocs, n, p - 1, own=True)

      if sems is not None and "release" not in skip:  # the reads have landed: peers may go
        @pl.when(computes)
        def _release():
          with jax.named_scope("release"):
            relay(phases, (n, phases - 1))
            pl.semaphore_wait(sems.at[phases], value=n - 1, decrement=False)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = [jax.ShapeDtypeStruct((out_rows, d), out_dtype), *slot_types]
  kernel = gemm.kernel(body, out_type=tuple(out_type), num_sms=num_sms,
                       scratch_types=epilogues(scratch=None).scratch_types(),
                       name=f"taco_matmul_reduce_scatter{'_fp8' if fp8 else ''}_{n}")
  return kernel(y_RF, w_FD, *(received if local else ()))


def slot_shapes(n: int, rows: int, d: int, dtype, fp8=None) -> list[jax.ShapeDtypeStruct]:
  """The outbox's arrays of a kernel whose chunk has ``rows`` rows of width ``d`` (the
  partials for rank c in slot c): ``[n, rows, D]`` values in the transfer dtype, or with
  ``fp8`` (the codec's settings: ``fmt``, ``group_size``) FP8 codes ``[n, rows, D]`` and
  fp32 group multipliers ``[n, D / G, rows]``."""
  if fp8 is None:
    return [jax.ShapeDtypeStruct((n, rows, d), dtype)]
  return [jax.ShapeDtypeStruct((n, rows, d), FP8_DTYPES[fp8["fmt"]]),
          jax.ShapeDtypeStruct((n, d // fp8["group_size"], rows), jnp.float32)]


@gemm.lowered_once("axis_name", "tiling", "num_sms", "out_dtype", "fp8", "phases",
                   "pull_depth", "transpose_w", "rank", "n", "_skip", "_probe",
                   reads=("TILING", "FP8_TILING"))
def matmul_reduce_scatter(y_BTF, w_FD, axis_name, *, tiling: gemm.Tiling | None = None,
                          num_sms: int, out_dtype=None, fp8=None, phases: int | None = None,
                          pull_depth: int = PULL_DEPTH, transpose_w: bool = False, rank=None,
                          n=None, received=None, _skip: tuple[str, ...] = (),
                          _probe: tuple[str, ...] = ()):
  """``reduce_scatter(y @ w)`` along the sequence as one kernel (module docstring): returns
  this rank's chunk ``[B, S, D]`` (``out_dtype``, default y's). ``fp8``: the codec's
  settings (``group_size`` = ``tiling.tile_n``, ``fmt``, ``dual_scale``, ``lam``) for the
  compressed kernel. ``num_sms``: the GPU's multiprocessor count. ``phases``: row-tile
  groups of the schedule (default ``default_phases``). ``pull_depth``: the peers' partial
  blocks each warpgroup has in flight (1 to ``MAX_PULL_DEPTH``). ``transpose_w``: w is given
  ``[D, F]`` and multiplied transposed (``gemm.TileLoop``). Local mode: ``rank``,
  ``n`` and ``received`` (what each peer p sent this rank, slot r of its outbox, stacked by
  p; see ``slot_shapes``); it returns ``(out, outbox)``. ``_skip``, for timing experiments
  only (the result is wrong): ``"waits"`` leaves out the own phases' waits for the peers'
  signals, ``"release"`` the release at the end, ``"signals"`` the sent loops' signals (with
  ``"waits"`` and ``"release"`` only: else the peers wait for them forever), ``"remote"``
  reads this GPU's own outbox instead of the peers' (what the link and the synchronization
  each cost). ``_probe`` (plain kernel; the result stays right): ``"sent_reads"`` makes
  each sent tile read its first partial blocks from the peers as an own tile does, and wait
  for them unread; ``"sent_local_reads"`` the same from this GPU's outbox;
  ``"sent_all_reads"`` reads all an own tile reads, the slots refilled as they empty (what
  remote reads cost the tiles beside them)."""
  if rank is None:
    n = lax.axis_size(axis_name)
  tiling = tiling or (TILING if fp8 is None else FP8_TILING)
  reason = misfit(y_BTF.shape, gemm.weight_kn(w_FD.shape, transpose_w), n, tiling,
                  fp8 and fp8["group_size"], phases, pull_depth)
  if reason:
    raise ValueError(f"matmul_reduce_scatter: {reason}")
  b, t_len, f = y_BTF.shape
  phases = phases or default_phases(b * t_len // n // tiling.cta_m)
  if _probe and (fp8 is not None or n < 2
                 or not set(_probe) <= {"sent_reads", "sent_local_reads", "sent_all_reads"}):
    raise ValueError(f"matmul_reduce_scatter: _probe {_probe} is for the plain kernel with "
                     f"peers")
  if "signals" in _skip and not {"waits", "release"} <= set(_skip):
    raise ValueError("matmul_reduce_scatter: _skip 'signals' needs 'waits' and 'release'")
  if fp8 is not None:
    fp8 = dict(fmt=fp8["fmt"], dual_scale=fp8["dual_scale"], lam=fp8["lam"],
               codes_dtype=jnp.dtype(FP8_DTYPES[fp8["fmt"]]))
  out = _call(y_BTF.reshape(b * t_len, f), w_FD, s=t_len // n, n=n, rank=rank,
              axis_name=axis_name, tiling=tiling, num_sms=num_sms,
              out_dtype=out_dtype or y_BTF.dtype, phases=phases, pull_depth=pull_depth,
              transpose_w=transpose_w, fp8=fp8, received=received, skip=_skip, probe=_probe)
  result = out[0].reshape(b, t_len // n, -1)
  if received is None:
    return result
  return result, tuple(out[1:])
