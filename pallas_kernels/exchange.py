"""All-to-all in one Mosaic GPU kernel, pulled over NVLink: ``parallel.tp_exchange``'s
exchange of the attention's input with the kernel layers.

x ``[B, R, C]`` on each of n ranks (this one r). ``split_axis=1``: rows chunk j of x goes to
rank j, which lays what it receives side by side along the columns in rank order, ``[B, R
/ n, n C]`` (the forward exchange: every rank's heads for this rank's sequence shard).
``split_axis=2``: the transpose, columns chunk j to rank j, received stacked along the rows,
``[B, n R, C / n]`` (its gradient going back). Each rank reads its chunk of every peer's x
straight from the peer's memory (TMA from ``plgpu.remote_ref``) into shared memory and
stores it in place in its output, its own chunk too, in ``[ROWS, COLS]`` blocks dealt over
the SMs, sources interleaved, ``depth`` in flight per SM (`peer_copy.copy_blocks`); no
operand is copied into another layout before or after. A rank leaves once its peers'
reads of its x have landed (`peer_copy.release_sources`). The peers' x are complete when
the kernel starts: XLA runs a barrier across the GPUs before a collective kernel.

NCCL's all-to-all, which XLA runs as send/receive kernels, moved each 16 MiB of the 1.3B's
exchange at TP=2 in ~0.12 ms a call inside a training step
(`profile_step_nvlink_xchg_tp2`); copies pulled inside a kernel reach ~310 GB/s
(`peer_copy`).

Local mode (``local_x``: every rank's x, ``[n, B, R, C]``) runs rank ``rank``'s block loop
with no peers, for the CPU tests in jax's GPU interpret mode.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm
from taco_jax.pallas_kernels.peer_copy import (SEMAPHORES, check_slots, copy_blocks,
                                               release_sources, share)

ROWS, COLS = 64, 256  # a block: TMA boxes span at most 256 elements a dimension
MIN_COLS = 8  # 16 bytes of bf16: the narrowest TMA box row
DEPTH = 3


def reference(x_all, rank, split_axis: int):
  """What rank ``rank`` ends with, from every rank's x ``[n, B, R, C]``: the tiled
  ``lax.all_to_all`` of `taco_jax.collectives.all_to_all`."""
  n = x_all.shape[0]
  chunks = [jax.numpy.split(x, n, axis=split_axis)[rank] for x in x_all]
  return jax.numpy.concatenate(chunks, axis=3 - split_axis)


def misfit(shape, n: int, split_axis: int) -> str | None:
  """Why the kernel cannot exchange x of ``shape`` over n ranks, or None."""
  if split_axis not in (1, 2) or len(shape) != 3:
    return f"x {tuple(shape)} split along {split_axis}: the kernel takes [B, R, C] along 1 or 2"
  if shape[split_axis] % n:
    return f"dimension {split_axis} of {tuple(shape)} does not divide over {n} ranks"
  rows, cols = _chunk(shape, n, split_axis)
  if rows % ROWS or not block_cols(cols):
    return (f"blocks of {ROWS} rows and {COLS}, {COLS // 2}, ... {MIN_COLS} columns do not "
            f"tile the {rows} x {cols} chunks of {tuple(shape)}")
  return None


def block_cols(cols: int) -> int:
  """The widest block (COLS, COLS / 2, ... MIN_COLS columns) that tiles ``cols``, or 0;
  e.g. 128 for the 640 columns of the 2.7B's chunks at TP=4."""
  width = COLS
  while width >= MIN_COLS:
    if cols % width == 0:
      return width
    width //= 2
  return 0


def _chunk(shape, n: int, split_axis: int) -> tuple[int, int]:
  """(rows, columns) of the chunk of x ``[B, R, C]`` that one rank sends another."""
  _, r, c = shape
  return (r // n, c) if split_axis == 1 else (r, c // n)


@gemm.lowered_once("axis_name", "n", "split_axis", "num_sms", "depth", "rank")
def all_to_all(x, axis_name, *, n: int, split_axis: int, num_sms: int, depth: int = DEPTH,
               rank=None, local_x=None):
  """The exchange of x ``[B, R, C]`` over ``axis_name`` (n ranks; the module docstring),
  on ``num_sms`` SMs; inside ``shard_map``, or in local mode with ``rank`` and
  ``local_x``."""
  if n < 2:
    raise ValueError(f"exchange.all_to_all needs 2 or more ranks, got n={n}")
  reason = misfit(x.shape, n, split_axis)
  if reason:
    raise ValueError(f"exchange.all_to_all: {reason}")
  b = x.shape[0]
  rows, cols = _chunk(x.shape, n, split_axis)
  if split_axis == 1:  # source rows chunk j -> destination columns chunk j
    src = x.reshape(b, n, rows, cols)
    out_shape = (b, rows, n, cols)
    at_src = lambda ref, bi, j, rs, cs: ref.at[bi, j, rs, cs]  # noqa: E731
    at_dst = lambda ref, bi, j, rs, cs: ref.at[bi, rs, j, cs]  # noqa: E731
  else:  # the transpose: source columns chunk j -> destination rows chunk j
    src = x.reshape(b, rows, n, cols)
    out_shape = (b, n, rows, cols)
    at_src = lambda ref, bi, j, rs, cs: ref.at[bi, rs, j, cs]  # noqa: E731
    at_dst = lambda ref, bi, j, rs, cs: ref.at[bi, j, rs, cs]  # noqa: E731
  width = block_cols(cols)
  check_slots("exchange.all_to_all", depth, ROWS * width * x.dtype.itemsize)
  row_blocks, col_blocks = rows // ROWS, cols // width
  per_source = b * row_blocks * col_blocks
  local = local_x is not None

  def body(*refs, smem, loaded):
    (src_ref,), given, (dst_ref,) = gemm.split_refs(refs, 1, int(local), 1)
    me, sems = gemm.rank_and_semaphores(axis_name, rank, n, local, SEMAPHORES)
    sources = [lax.rem(me + s, n) for s in range(n)]  # s = 0: this rank's own chunk
    sm = lax.axis_index(gemm.SM)

    def ref_of(s):  # the x that source s's blocks are read from
      if local:
        return given[0].at[sources[s]]
      if s == 0:
        return src_ref
      return plgpu.remote_ref(src_ref, {axis_name: sources[s]})

    def each_block(item, copy):
      """``copy(s, b, rows, cols)`` for block ``item`` of this SM, sources interleaved."""
      flat = sm + item * num_sms
      s, q = lax.rem(flat, n), flat // n
      cs = pl.ds(lax.rem(q, col_blocks) * width, width)
      q = q // col_blocks
      rs, bi = pl.ds(lax.rem(q, row_blocks) * ROWS, ROWS), q // row_blocks
      for k in range(n):
        pl.when(s == k)(functools.partial(copy, k, bi, rs, cs))

    def load(item, slot):
      each_block(item, lambda s, bi, rs, cs: plgpu.copy_gmem_to_smem(
          at_src(ref_of(s), bi, me, rs, cs), smem.at[slot], loaded.at[slot]))

    def store(item, slot):
      each_block(item, lambda s, bi, rs, cs: plgpu.copy_smem_to_gmem(
          smem.at[slot], at_dst(dst_ref, bi, sources[s], rs, cs)))

    copy_blocks(share(n * per_source, num_sms), depth, load, store, loaded)
    if sems is not None:
      release_sources(sems, num_sms, sources[1:], axis_name)

  f = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(out_shape, x.dtype), grid=(num_sms,),
      grid_names=(gemm.SM,),
      scratch_types=dict(smem=plgpu.SMEM((depth, ROWS, width), x.dtype),
                         loaded=plgpu.Barrier(num_barriers=depth)),
      kernel_name=f"taco_all_to_all_{n}")
  y = f(src, *((local_x.reshape(n, *src.shape),) if local else ()))
  return y.reshape(b, rows, n * cols) if split_axis == 1 else y.reshape(b, n * rows, cols)
