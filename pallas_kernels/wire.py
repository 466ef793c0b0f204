"""The wire format: one uint8 buffer per compressed message, so that a collective moves the
codes and both scales in a single transfer (one NCCL launch instead of two).

Row r of a ``[rows, D]`` message with K = D / G groups is ``D + 8 K`` bytes:

    [ codes: D bytes (fp8 bit patterns) | 8 byte planes of K bytes each ]

plane b (b = 0..3) holds byte b (least significant first) of every group's fp32 alpha, plane
4 + b byte b of every group's fp32 scale. Planes, rather than each scale's four bytes
together, let a kernel program that owns groups [j bk, (j + 1) bk) write and read its scales
as eight contiguous runs of bk bytes. ``pack``/``unpack`` are the specification (jnp; XLA
fuses them into their neighbours); the encode and decode kernels write and read the same
bytes with ``store_tile``/``load_tile``.
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from taco_jax.pallas_kernels.common import FP8_DTYPES, row_mask

SCALE_BYTES = 8  # alpha and scale, fp32 each, per group


def width(d: int, group_size: int) -> int:
  """Bytes per row of the wire format of a ``[rows, d]`` message."""
  return d + SCALE_BYTES * (d // group_size)


def message_width(wire_width: int, group_size: int) -> int:
  """The message's last dimension D from its wire rows' width (inverse of ``width``)."""
  d, rem = divmod(wire_width * group_size, group_size + SCALE_BYTES)
  if rem or d % group_size:
    raise ValueError(f"a wire row of {wire_width} bytes is not a message of whole groups "
                     f"of {group_size} (D + {SCALE_BYTES} D / {group_size} bytes)")
  return d


def to_bytes(v):
  """fp32 array -> its four bytes as uint8 arrays, least significant first."""
  u = jax.lax.bitcast_convert_type(v, jnp.uint32)
  return [(jax.lax.shift_right_logical(u, jnp.uint32(8 * b)) & jnp.uint32(0xFF)
           ).astype(jnp.uint8) for b in range(4)]


def from_bytes(planes):
  """Inverse of ``to_bytes``."""
  u = planes[0].astype(jnp.uint32)
  for b in range(1, 4):
    u = u | jax.lax.shift_left(planes[b].astype(jnp.uint32), jnp.uint32(8 * b))
  return jax.lax.bitcast_convert_type(u, jnp.float32)


def pack(codes_RD, alpha_RK, scale_RK):
  """(fp8 codes, fp32 alpha, fp32 scale) -> the ``[rows, D + 8 K]`` uint8 wire rows."""
  planes_R8K = jnp.concatenate(to_bytes(alpha_RK) + to_bytes(scale_RK), axis=-1)
  return jnp.concatenate([jax.lax.bitcast_convert_type(codes_RD, jnp.uint8), planes_R8K], -1)


def unpack(wire_RW, *, group_size: int, fmt: str):
  """Inverse of ``pack``: ``(codes_RD, alpha_RK, scale_RK)``."""
  d = message_width(wire_RW.shape[-1], group_size)
  k = d // group_size
  codes_RD = jax.lax.bitcast_convert_type(wire_RW[..., :d], FP8_DTYPES[fmt])
  planes = [wire_RW[..., d + b * k:d + (b + 1) * k] for b in range(SCALE_BYTES)]
  return codes_RD, from_bytes(planes[:4]), from_bytes(planes[4:])


# --- inside kernels: one program's tile of groups [j bk, (j + 1) bk) ---------------------


def _store(wire_ref, start, value, rows):
  view = wire_ref.at[:, pl.ds(start, value.shape[-1])]
  if rows is None:
    view[...] = value
  else:
    plgpu.store(view, value, mask=row_mask(rows, value.shape))


def _read(wire_ref, chunk, start, size, rows):
  # One indexer (Triton's lowering takes no chained .at[...] views).
  view = wire_ref.at[(*chunk, slice(None), pl.ds(start, size))]
  if rows is None:
    return view[...]
  return plgpu.load(view, mask=row_mask(rows, view.shape), other=jnp.zeros((), jnp.uint8))


def store_tile(wire_ref, codes, alpha, scale, *, j, groups: int, rows: int | None):
  """Writes program (i, j)'s ``[br, bk G]`` codes and ``[br, bk]`` scales into its wire
  rows (``groups`` = K per row; ``rows``: the message's rows when the last block
  overhangs them, else None)."""
  bk = alpha.shape[-1]
  bkg = codes.shape[-1]
  d = groups * (bkg // bk)
  _store(wire_ref, j * bkg, jax.lax.bitcast_convert_type(codes, jnp.uint8), rows)
  for b, plane in enumerate(to_bytes(alpha) + to_bytes(scale)):
    _store(wire_ref, d + b * groups + j * bk, plane, rows)


def load_tile(wire_ref, *, j, group_size: int, bk: int, groups: int, fmt: str,
              rows: int | None, chunk=None):
  """Reads program (i, j)'s codes ``[br, bk G]``, alpha and scale ``[br, bk]`` (inverse
  of ``store_tile``) from chunk ``chunk`` of stacked wire rows (None: not stacked); rows
  past ``rows`` read zero bytes, which decode to zeros like any unsent row."""
  chunk = () if chunk is None else (chunk,)
  bkg = bk * group_size
  d = groups * group_size
  codes = _read(wire_ref, chunk, j * bkg, bkg, rows)
  planes = [_read(wire_ref, chunk, d + b * groups + j * bk, bk, rows)
            for b in range(SCALE_BYTES)]
  alpha, scale = from_bytes(planes[:4]), from_bytes(planes[4:])
  return jax.lax.bitcast_convert_type(codes, FP8_DTYPES[fmt]), alpha, scale
