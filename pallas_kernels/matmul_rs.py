"""Matmul + reduce-scatter in one Mosaic GPU kernel: ``out = reduce_scatter(y @ w, axis)``
along the sequence, each partial tile sent to its owner as soon as it is computed; plain or
FP8-compressed.

Inside a ``jax.shard_map`` over ``axis`` (n ranks; this rank r), y ``[B, T, F]`` is this
rank's slice of the features for the full sequence and w ``[F, D]`` its rows of the weight;
rank c owns chunk c of the sequence (rows ``c S .. (c + 1) S`` of every sequence, S = T / n)
of the sum over ranks. Each partial output tile of a peer's chunk goes, straight from the
epilogue, into slot r of that peer's receive buffer (``plgpu.remote_ref``), while the next
tiles are computed; the own chunk's epilogue adds the received partials to its accumulator,
in fp32. The row tiles of every chunk come in ``phases`` groups (``schedule``): phase p of
each peer's chunk (``c = r + 1, ..., r + n - 1``), then phase p - 1 of the own chunk, whose
partials the peers sent one phase earlier. So the transfers run beside compute all through
the kernel, instead of the own chunk waiting for the last partial of every peer. A
semaphore per phase counts the senders' warpgroups whose partials of it have landed; the
own phase starts once all have. A sender signals a loop's partials at the end of its next
loop (``signal_plan``), so no loop ends waiting for its own stores to cross the link.

Compressed (``fp8``: the codec's settings), each partial tile is encoded in the epilogue, in
groups of G = ``tile_n`` columns along the hidden dimension, with the codec's own
``encode_groups``: FP8 codes plus one fp32 multiplier per row and group
(``decode.group_multiplier``). The owner encodes its own tile the same way and sums the n
decoded partials in fp32 in rank order: the codes and the sum of the compressed
reduce-scatter (``matmul_reduce_scatter_reference``).

``rank`` and ``received`` give local mode, for the CPU tests (jax's GPU interpret mode
simulates no peer copies or semaphores): the partials meant for rank c land in slot c of
a local ``sent`` output, and the peers' partials for this rank come from ``received``.
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


def misfit(y_shape, w_shape, n: int, tiling: gemm.Tiling, group_size: int | None = None,
           phases: int | None = None):
  """Why the kernel cannot take y ``[B, T, F]`` and w ``[F, D]`` over n ranks with these
  tiles (and, for the FP8 kernel, groups of ``group_size``; ``phases`` row-tile groups),
  or None when it can."""
  b, t, f = y_shape
  if w_shape[0] != f:
    return f"y {tuple(y_shape)} and w {tuple(w_shape)} do not contract"
  if t % n:
    return f"sequence {t} is not divisible by the {n} ranks"
  if group_size is not None and group_size != tiling.tile_n:
    return (f"the FP8 kernel encodes groups of its tile_n ({tiling.tile_n}) columns, "
            f"not {group_size}")
  reason = tiling.misfit(rows_per_seq=t // n, m=b * t // n, n=w_shape[1], k=f)
  row_tiles = b * t // n // tiling.cta_m
  if reason is None and phases is not None and (phases < 1 or row_tiles % phases):
    return f"{phases} phases do not divide the chunk's {row_tiles} row tiles"
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
  the own phase p - 1 measured slower on 2xH200: docs/parallel.md.)"""
  order = []
  for p in range(phases + 1):
    order += [(q, p) for q in range(1, n) if p < phases] + ([(n, p - 1)] if p > 0 else [])
  return order


def signal_plan(n: int, phases: int) -> list[tuple[tuple[int, int], list, list]]:
  """When each sent loop's semaphore signal goes out: per loop of ``schedule``, ``(loop,
  before, after)``, the sent loops signalled before it starts (after every store has
  landed) and those signalled after it (once every store older than this loop's has).

  A signal must wait for the loop's TMA stores to have landed on the peer, which takes the
  link's time for the loop's last tiles. Signalled at the end of its own loop, that wait
  held the tensor cores idle for every sent loop. Deferred to the end of the next loop, it
  waits for stores that have long drained while the next loop computed; it is flushed
  before a loop only where that loop is the own phase that waits for it."""
  plan, pending = [], None
  for q, p in schedule(n, phases):
    before = []
    if q == n and pending is not None and pending[1] == p:
      before, pending = [pending], None
    plan.append(((q, p), before, [pending] if pending else []))
    pending = (q, p) if q < n else None
  assert pending is None, "the schedule ends with the own chunk's last phase"
  return plan


class _Epilogues:
  """What each compute warpgroup does with its fp32 ``[tile_m, tile_n]`` accumulator:
  ``send`` a peer's partial tile (as the transfer dtype, or encoded) to ``dest`` arrays,
  ``finish`` this rank's tile by adding the received partials and storing the result."""

  def __init__(self, tiling, *, n, dtype, out_dtype, fp8, scratch):
    self.t, self.n, self.dtype, self.out_dtype = tiling, n, dtype, out_dtype
    self.fp8, self.s = fp8, scratch

  def _slabs(self):
    return range(self.t.tile_m // self.t.epi_m)

  def _encode(self, x):
    """A slab's partials as the reference sends them: in the transfer dtype, encoded."""
    fp8 = self.fp8
    codes, alpha, scale = encode_groups(
        x.astype(self.dtype).astype(jnp.float32), None, fmt=fp8["fmt"],
        dual_scale=fp8["dual_scale"], lam=fp8["lam"], fixed_order=False)
    return codes, group_multiplier(alpha, scale)

  def send(self, acc, wg, row, col, dests) -> int:
    """``dests``: (codes or values, multipliers or None) refs of ``[rows, D]`` (and
    ``[D / G, rows]``) into which this tile's partials go at (row, col). Returns the
    number of TMA stores issued."""
    t = self.t
    if not self.fp8:
      return sum(gemm.store_tiles(
          acc.astype(self.dtype), self.s["out_smem"], lambda i, j: values.at[
              pl.ds(row + i * t.epi_m, t.epi_m), pl.ds(col + j * t.epi_n, t.epi_n)], wg, t)
                 for values, _ in dests)
    codes_smem, mult_smem = self.s["codes_smem"], self.s["mult_smem"]
    for i in self._slabs():
      codes, mult = self._encode(acc[i * t.epi_m:(i + 1) * t.epi_m])
      slot = i % 2
      plgpu.wait_smem_to_gmem(2 * len(dests), wait_read_only=True)
      codes_smem[wg, slot] = codes
      mult_smem[wg, slot, 0] = mult
      plgpu.commit_smem()
      rows = pl.ds(row + i * t.epi_m, t.epi_m)
      for dest_codes, dest_mult in dests:
        plgpu.copy_smem_to_gmem(codes_smem.at[wg, slot], dest_codes.at[rows, pl.ds(col, t.tile_n)])
        plgpu.copy_smem_to_gmem(mult_smem.at[wg, slot],
                                dest_mult.at[pl.ds(col // t.tile_n, 1), rows])
    return 2 * len(dests) * len(self._slabs())

  def _peer_pairs(self):
    """The (slab, j) order in which ``finish`` reads the received partials: per slab, the
    peers in rank order (rank ``j + (j >= r)``, this rank skipped)."""
    return [(i, j) for i in self._slabs() for j in range(self.n - 1)]

  def _barrier(self, wg, slot: int, which: int):
    return self.s["in_barrier"].at[(wg * 2 + slot) * 2 + which]

  def _fetch(self, k: int, wg, r, row, col, received):
    """Starts the TMA loads of pair ``k`` of ``_peer_pairs`` (a peer's codes and
    multipliers of one slab) into receive slot ``k % 2``."""
    t, (i, j), slot = self.t, self._peer_pairs()[k], k % 2
    p, rows = j + (r <= j), pl.ds(row + i * t.epi_m, t.epi_m)
    plgpu.copy_gmem_to_smem(received[0].at[p, rows, pl.ds(col, t.tile_n)],
                            self.s["codes_smem"].at[wg, slot], self._barrier(wg, slot, 0))
    plgpu.copy_gmem_to_smem(received[1].at[p, pl.ds(col // t.tile_n, 1), rows],
                            self.s["mult_smem"].at[wg, slot], self._barrier(wg, slot, 1))

  def prefetch(self, wg, r, row, col, received):
    """Before this rank's own tile is computed (FP8): the loads of its first two received
    partials, so that they land while the matmul runs. They reuse the send buffers (an
    own tile sends nothing), once the last sent tile has been read out of them."""
    if not self.fp8:
      return
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for k in range(min(2, len(self._peer_pairs()))):
      self._fetch(k, wg, r, row, col, received)

  def _load(self, src, wg, what):
    """One TMA load of ``src`` into this warpgroup's ``what`` buffer, awaited."""
    buf, barrier = self.s[what].at[wg], self.s["in_barrier"].at[wg]
    plgpu.copy_gmem_to_smem(src, buf, barrier)
    plgpu.barrier_wait(barrier)
    return buf

  def _fp8_sums(self, acc, wg, r, row, col, received):
    """Per slab, the n decoded partials (this rank's own, encoded and decoded as sent)
    summed in fp32 in rank order, as the reference sums; reads the slots ``prefetch``
    filled and refills each with the pair after next."""
    t, n, pairs = self.t, self.n, len(self._peer_pairs())
    for i in self._slabs():
      own = decode_tile(*self._encode(acc[i * t.epi_m:(i + 1) * t.epi_m]), jnp.float32)
      total = jnp.zeros_like(own)
      for j in range(n - 1):
        mine = jnp.broadcast_to(r == j, own.shape)  # select_n takes no scalar predicate
        total = jnp.where(mine, total + own, total)  # this rank's place in rank order
        k = i * (n - 1) + j
        slot = k % 2
        plgpu.barrier_wait(self._barrier(wg, slot, 0))
        plgpu.barrier_wait(self._barrier(wg, slot, 1))
        total = total + decode_tile(self.s["codes_smem"][wg, slot],
                                    self.s["mult_smem"][wg, slot, 0], jnp.float32)
        if k + 2 < pairs:
          plgpu.commit_smem()  # every warp has read the slot before the TMA refills it
          self._fetch(k + 2, wg, r, row, col, received)
      last = jnp.broadcast_to(r == n - 1, own.shape)
      yield i, jnp.where(last, total + own, total)

  def finish(self, acc, wg, r, row, col, received, out_ref) -> int:
    """This rank's tile: its partial plus the received ones (``received``: the arrays of
    the receive slots, ``[n, rows, D]`` values or codes, and ``[n, D / G, rows]``
    multipliers), stored to ``out_ref`` at (row, col). Returns the number of TMA stores
    issued."""
    t, n = self.t, self.n
    stores = 0
    cols = t.tile_n // t.epi_n
    if self.fp8:
      slabs = self._fp8_sums(acc, wg, r, row, col, received)
    else:
      slabs = ((i, acc[i * t.epi_m:(i + 1) * t.epi_m]) for i in self._slabs())
    for i, slab in slabs:
      rows = pl.ds(row + i * t.epi_m, t.epi_m)
      for j in range(cols):
        sub = pl.ds(col + j * t.epi_n, t.epi_n)
        v = slab[:, j * t.epi_n:(j + 1) * t.epi_n]
        if not self.fp8:
          for q in range(1, n):  # the peers' partials, in any order
            got = self._load(received[0].at[lax.rem(r + q, n), rows, sub], wg, "in_values")
            v = v + got[...].astype(jnp.float32)
        stores += gemm.stage_out(v.astype(self.out_dtype), self.s["out_smem"], wg,
                                 (i * cols + j) % 2, out_ref.at[rows, sub])
    return stores

  def scratch_types(self) -> dict:
    t, wgs = self.t, gemm.COMPUTE_WGS
    # plain: a sent tile's stores drain over the link while the next tile computes
    slots = 2 if self.fp8 else gemm.tile_slots(t)
    out = dict(out_smem=gemm.out_smem_type(t, self.out_dtype, slots),
               # FP8: per warpgroup, receive slot and (codes, multipliers)
               in_barrier=plgpu.Barrier(num_barriers=wgs * (4 if self.fp8 else 1)))
    if self.fp8:
      codes_dtype = jnp.dtype(self.fp8["codes_dtype"])
      out.update(
          codes_smem=plgpu.SMEM((wgs, 2, t.epi_m, t.tile_n), codes_dtype,
                                transforms=gemm.swizzled(t.tile_n, codes_dtype)),
          mult_smem=plgpu.SMEM((wgs, 2, 1, t.epi_m), jnp.float32))
    else:
      out.update(in_values=plgpu.SMEM((wgs, t.epi_m, t.epi_n), self.dtype,
                                      transforms=gemm.swizzled(t.epi_n, self.dtype)))
    return out


def _call(y_RF, w_FD, *, s: int, n: int, rank, axis_name, tiling: gemm.Tiling,
          num_sms: int, out_dtype, phases: int, fp8=None, received=None):
  """The kernel on y's rows ``[B T, F]`` (``s`` rows per sequence shard). ``received``
  (local mode): the receive slots' arrays that peers would have written. Returns the
  output rows ``[B S, D]``, the receive slots, and in local mode the partials sent."""
  t = tiling
  local = received is not None
  rows, f = y_RF.shape
  t_len, d = n * s, w_FD.shape[1]
  out_rows = rows // n
  dtype = y_RF.dtype
  loop = gemm.TileLoop(t, [gemm.Operand((t.cta_m, t.tile_k), dtype, lambda kk: (0, kk))],
                       w_FD.dtype, f)
  slot_types = slot_shapes(n, out_rows, d, dtype, fp8 and dict(fp8, group_size=t.tile_n))
  n_slots = len(slot_types)
  signals = num_sms * gemm.COMPUTE_WGS  # every compute warpgroup of every SM sends
  epilogues = functools.partial(_Epilogues, t, n=n, dtype=dtype, out_dtype=out_dtype, fp8=fp8)

  def body(*refs, **scratch):
    extra = n_slots if local else 0
    (y_ref, w_ref), inbox, (out_ref,), slots, sent = gemm.split_refs(
        refs, 2, extra, 1, n_slots, extra)
    inbox = inbox or slots  # the peers write the receive slots themselves
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, phases)
    epi = epilogues(scratch=scratch)
    phase_tiles = out_rows // t.cta_m // phases

    def y_row(c, m_idx):  # the row of chunk c's row tile m_idx in y
      row = m_idx * t.cta_m
      return (row // s) * t_len + c * s + row % s

    @functools.partial(pl.run_scoped, allocs=loop.allocations(y_ref, w_ref),
                       collective_axes=gemm.WG)
    def _scope(allocs):
      computes = lax.axis_index(gemm.WG) < gemm.COMPUTE_WGS  # the warpgroups that store

      def signal(loops):  # this SM's partials of these loops are on their ranks
        for q, p in loops:
          pl.semaphore_signal(sems.at[p], device_id={axis_name: lax.rem(r + q, n)})

      dealt = 0  # tiles dealt so far: each loop deals on from there (gemm.dealt)
      for (q, p), before, after in signal_plan(n, phases):
        if sems is not None and before:
          @pl.when(computes)
          def _flush(before=before):
            plgpu.wait_smem_to_gmem(0)
            signal(before)

        if q == n and sems is not None:  # every peer's partials of phase p have landed
          pl.semaphore_wait(sems.at[p], value=(n - 1) * signals, decrement=False)

        def at(m_idx, n_idx, wg, p=p):  # a warpgroup tile's (row, column) in its chunk
          row0, col0 = t.wg_offsets(wg)
          return (p * phase_tiles + m_idx) * t.cta_m + row0, n_idx * t.cta_n + col0

        stores = []  # per tile, recorded as the loop's epilogue is traced

        def epilogue(m_idx, n_idx, wg, acc, q=q, at=at, stores=stores):
          row, col = at(m_idx, n_idx, wg)
          if q == n:
            stores.append(epi.finish(acc, wg, r, row, col, inbox, out_ref))
            return
          c = lax.rem(r + q, n)
          if local:
            dest = [a.at[c] for a in sent]
          else:
            dest = [plgpu.remote_ref(a, {axis_name: c}).at[r] for a in slots]
          stores.append(epi.send(acc, wg, row, col, [tuple(dest) + ((None,) * (fp8 is None))]))

        def prefetch(m_idx, n_idx, wg, at=at):  # the own chunk's FP8 receive slots
          epi.prefetch(wg, r, *at(m_idx, n_idx, wg), inbox)

        c = lax.rem(r + q, n)
        tiles = phase_tiles * (d // t.cta_n)
        first_sm = dealt % num_sms
        loop.run(allocs, m=phase_tiles * t.cta_m, n=d,
                 a_refs=lambda m_idx, c=c, p=p: [y_ref.at[pl.ds(
                     y_row(c, p * phase_tiles + m_idx), t.cta_m)]],
                 w_ref=w_ref, epilogue=epilogue, before_tile=prefetch if q == n else None,
                 first_sm=first_sm)
        dealt += tiles
        if sems is not None and after:
          assert len(set(stores)) == 1, stores

          @pl.when(computes)
          def _signal(after=after, first_sm=first_sm, per_tile=stores[0]):
            gemm.wait_older_stores(tiles, first_sm, per_tile, num_sms)
            signal(after)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = [jax.ShapeDtypeStruct((out_rows, d), out_dtype), *slot_types]
  if local:
    out_type += slot_types  # what was sent: slot c for rank c
  kernel = gemm.kernel(body, out_type=tuple(out_type), num_sms=num_sms,
                       scratch_types=epilogues(scratch=None).scratch_types(),
                       name=f"taco_matmul_reduce_scatter{'_fp8' if fp8 else ''}_{n}")
  return kernel(y_RF, w_FD, *(received if local else ()))


def slot_shapes(n: int, rows: int, d: int, dtype, fp8=None) -> list[jax.ShapeDtypeStruct]:
  """The receive slots' arrays of a kernel whose chunk has ``rows`` rows of width ``d``
  (sender p's partials in slot p): ``[n, rows, D]`` values in the transfer dtype, or with
  ``fp8`` (the codec's settings: ``fmt``, ``group_size``) FP8 codes ``[n, rows, D]`` and
  fp32 group multipliers ``[n, D / G, rows]``."""
  if fp8 is None:
    return [jax.ShapeDtypeStruct((n, rows, d), dtype)]
  return [jax.ShapeDtypeStruct((n, rows, d), FP8_DTYPES[fp8["fmt"]]),
          jax.ShapeDtypeStruct((n, d // fp8["group_size"], rows), jnp.float32)]


def matmul_reduce_scatter(y_BTF, w_FD, axis_name, *, tiling: gemm.Tiling | None = None,
                          num_sms: int, out_dtype=None, fp8=None, phases: int | None = None,
                          rank=None, n=None, received=None):
  """``reduce_scatter(y @ w)`` along the sequence as one kernel (module docstring): returns
  this rank's chunk ``[B, S, D]`` (``out_dtype``, default y's). ``fp8``: the codec's
  settings (``group_size`` = ``tiling.tile_n``, ``fmt``, ``dual_scale``, ``lam``) for the
  compressed kernel. ``num_sms``: the GPU's multiprocessor count. ``phases``: row-tile
  groups of the schedule (default ``default_phases``). Local mode: ``rank``, ``n`` and
  ``received`` (the receive slots' arrays, sender p in slot p; see ``slot_shapes``); it
  returns ``(out, sent)``, the partials sent in slot c for rank c."""
  if rank is None:
    n = lax.axis_size(axis_name)
  tiling = tiling or (TILING if fp8 is None else FP8_TILING)
  reason = misfit(y_BTF.shape, w_FD.shape, n, tiling, fp8 and fp8["group_size"], phases)
  if reason:
    raise ValueError(f"matmul_reduce_scatter: {reason}")
  b, t_len, f = y_BTF.shape
  phases = phases or default_phases(b * t_len // n // tiling.cta_m)
  if fp8 is not None:
    fp8 = dict(fmt=fp8["fmt"], dual_scale=fp8["dual_scale"], lam=fp8["lam"],
               codes_dtype=jnp.dtype(FP8_DTYPES[fp8["fmt"]]))
  out = _call(y_BTF.reshape(b * t_len, f), w_FD, s=t_len // n, n=n, rank=rank,
              axis_name=axis_name, tiling=tiling, num_sms=num_sms,
              out_dtype=out_dtype or y_BTF.dtype, phases=phases, fp8=fp8,
              received=received)
  result = out[0].reshape(b, t_len // n, -1)
  if received is None:
    return result
  return result, tuple(out[-len(received):])
