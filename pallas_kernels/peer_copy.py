"""The link's yardstick: how fast copies issued from inside a Mosaic GPU kernel move bytes
between GPUs, with no matmul beside them.

The collective-matmul kernels move their bytes with TMA copies to and from peer memory
(``plgpu.remote_ref``). At TP=4 they reach 160-280 GB/s where NVLink is rated 450 GB/s a
direction, and whether that is the kernels or the link is what this kernel answers: it
does nothing but those copies, on ``num_sms`` SMs with ``depth`` blocks of shared memory
each, so its time is the link's (or the copy engine's) for that many bytes in flight.
On 4 H200s it moves ~340 GB/s a rank pushed and ~310 pulled, from 33 SMs with two blocks
each up (``benchmarks/bench_peer_copy.py``; docs/measurements.md, "What the link allows
inside a kernel").

Each rank holds a shard ``[R, C]``; ``dst[i]`` on rank ``q`` becomes the shard of rank
``q + 1 + i`` (mod n), for ``i`` over the sources: the next rank only (``peers="one"``: a
ring step) or all ``n - 1`` peers (``"all"``: an all-gather). The blocks of all sources
are dealt round-robin over the SMs, sources interleaved, so every link is busy at once.

* ``mode="pull"``: a rank loads the peers' blocks (TMA from their memory into shared
  memory, ``depth - 1`` loads in flight per SM) and stores them into its ``dst``; it leaves
  once its peers have finished reading it (one relayed signal from each, as the pulled
  all-gather kernel does).
* ``mode="push"``: a rank loads its own blocks and stores them into the peers' ``dst``;
  each SM signals each peer once its stores have landed, and a rank leaves once all its
  sources' SMs have signalled it.

Local mode (``local_peers``: the sources' shards ``[P, R, C]``, given) runs one rank's
block loop with no peers, for the CPU tests in jax's GPU interpret mode: every block is
read from ``local_peers`` and lands in this rank's ``dst``, as in a pull.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm

MODES = ("pull", "push")
PEERS = ("one", "all")


def sources(n: int, peers: str) -> int:
  """How many shards a rank receives: 1 for a ring step, ``n - 1`` for an all-gather."""
  if peers not in PEERS:
    raise ValueError(f"peers={peers!r}: expected one of {PEERS}")
  return 1 if peers == "one" else n - 1


def reference(gathered, rank, peers: str):
  """What rank ``rank`` (an int, or traced inside ``shard_map``) ends with, from every rank's
  shard ``gathered [n, R, C]``."""
  n = gathered.shape[0]
  return jnp.stack([gathered[(rank + 1 + i) % n] for i in range(sources(n, peers))])


SEMAPHORES = 2
DONE, COUNT = range(SEMAPHORES)  # the peers' signals; this GPU's SMs finished (pull)


def share(total: int, num_sms: int):
  """How many of ``total`` blocks, dealt round-robin, this SM copies: its items are
  ``sm, sm + num_sms, ...``."""
  return (total - lax.axis_index(gemm.SM) + num_sms - 1) // num_sms


def check_slots(who: str, depth: int, block_bytes: int) -> None:
  """Refuses ``depth`` shared-memory slots of ``block_bytes`` for `copy_blocks` (a
  ValueError naming ``who``) where they cannot keep a block in flight or do not fit."""
  if depth < 2:
    raise ValueError(f"{who}: depth={depth}; at least 2 blocks per SM are needed to keep "
                     "one in flight while another is stored")
  if depth * block_bytes > gemm.SMEM_BYTES:
    raise ValueError(f"{who}: {depth} blocks of {block_bytes} bytes exceed shared memory")


def copy_blocks(mine, depth: int, load, store, loaded) -> None:
  """This SM's ``mine`` blocks through ``depth`` shared-memory slots: ``load(item, slot)``
  starts block ``item``'s load into ``slot`` (arriving on barrier ``loaded[slot]``),
  ``store(item, slot)`` its store from there; a slot is refilled with the block ``depth``
  on once its store has read it. Returns once this SM's stores have landed."""
  for item in range(depth):  # the first depth blocks in flight
    @pl.when(item < mine)
    def _first(item=item):
      load(item, item)

  @pl.loop(0, mine)
  def _copy(item):
    slot = lax.rem(item, depth)
    plgpu.barrier_wait(loaded.at[slot])
    store(item, slot)

    @pl.when((item >= 1) & (item - 1 + depth < mine))
    def _refill():  # the previous block's slot, once its store has read it
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      load(item - 1 + depth, lax.rem(item - 1, depth))

  plgpu.wait_smem_to_gmem(0)


def release_sources(sems, num_sms: int, sources, axis_name) -> None:
  """A pulling kernel's way out: once all ``num_sms`` SMs' reads have landed (each SM
  signals after `copy_blocks`), SM 0 tells each of ``sources`` that it may go, then waits
  until as many ranks have told it the same (the reads are symmetric: as many ranks read
  this one as it reads), so no rank's input is freed while a peer still reads it
  (`gemm.relay`)."""
  gemm.relay(sems.at[COUNT], sems.at[DONE], expected=num_sms,
             relays=lax.axis_index(gemm.SM) == 0, peers=sources, axis_name=axis_name,
             wait=len(sources))


def peer_copy(shard, axis_name, *, n: int, mode: str = "pull", peers: str = "all",
              block_rows: int = 64, depth: int = 4, num_sms: int, rank=None,
              local_peers=None):
  """``dst [P, R, C]``: the shards of this rank's ``P`` sources (module docstring), moved by
  ``num_sms`` SMs in ``[block_rows, C]`` blocks, ``depth`` per SM in shared memory. Call it
  inside ``shard_map`` over ``axis_name`` (``n`` ranks), or in local mode with ``rank`` and
  ``local_peers``."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: expected one of {MODES}")
  if n < 2:
    raise ValueError(f"peer_copy needs 2 or more ranks, got n={n}")
  p_count = sources(n, peers)
  rows, cols = shard.shape
  if rows % block_rows:
    raise ValueError(f"peer_copy: {rows} rows do not divide into blocks of {block_rows}")
  check_slots("peer_copy", depth, block_rows * cols * shard.dtype.itemsize)
  local = local_peers is not None
  total = p_count * (rows // block_rows)

  def body(*refs, smem, loaded):
    (src_ref,), given, (dst_ref,) = gemm.split_refs(refs, 1, int(local), 1)
    r, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, SEMAPHORES)
    targets = [lax.rem(r + 1 + i, n) for i in range(p_count)]    # pull from / receive from
    receivers = [lax.rem(r - 1 - i + n, n) for i in range(p_count)]  # push to
    sm = lax.axis_index(gemm.SM)
    mine = share(total, num_sms)

    def source_ref(s):  # where the blocks of source s are read
      if local:
        return given[0].at[s]
      if mode == "push":
        return src_ref
      return plgpu.remote_ref(src_ref, {axis_name: targets[s]})

    def dest_ref(s):  # where they land: rank r is source s of rank r - 1 - s
      if local or mode == "pull":
        return dst_ref.at[s]
      return plgpu.remote_ref(dst_ref, {axis_name: receivers[s]}).at[s]

    def per_source(item, copy):
      """``copy(s, rows)`` for the source and rows of block ``item`` of this SM."""
      flat = sm + item * num_sms
      i, rows_j = lax.rem(flat, p_count), pl.ds((flat // p_count) * block_rows, block_rows)
      if p_count == 1:
        copy(0, rows_j)
        return
      for s in range(p_count):
        pl.when(i == s)(functools.partial(copy, s, rows_j))

    def load(item, slot):
      per_source(item, lambda s, rows_j: plgpu.copy_gmem_to_smem(
          source_ref(s).at[rows_j], smem.at[slot], loaded.at[slot]))

    def store(item, slot):
      per_source(item, lambda s, rows_j: plgpu.copy_smem_to_gmem(
          smem.at[slot], dest_ref(s).at[rows_j]))

    copy_blocks(mine, depth, load, store, loaded)
    if sems is None:
      return
    if mode == "push":  # in every receiver
      for receiver in receivers:
        pl.semaphore_signal(sems.at[DONE], device_id={axis_name: receiver})
      pl.semaphore_wait(sems.at[DONE], value=num_sms * p_count, decrement=False)
      return
    release_sources(sems, num_sms, targets, axis_name)

  out_type = jax.ShapeDtypeStruct((p_count, rows, cols), shard.dtype)
  f = plgpu.kernel(
      body, out_type=out_type, grid=(num_sms,), grid_names=(gemm.SM,),
      scratch_types=dict(smem=plgpu.SMEM((depth, block_rows, cols), shard.dtype),
                         loaded=plgpu.Barrier(num_barriers=depth)),
      kernel_name=f"taco_peer_copy_{mode}_{peers}_{n}")
  return f(shard, *((local_peers,) if local else ()))
