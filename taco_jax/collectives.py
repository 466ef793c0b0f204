"""Collectives that send FP8 (TACO) instead of the input dtype, inside a manual shard_map.

``compression=None`` (the default) gives exactly the ``jax.lax`` collective (same HLO), so
the baseline and the compressed run share one code path. With a ``CompressionConfig``:

* all-gather: compress the local shard -> all-gather its wire rows -> decompress.
* reduce-scatter: compress each of the N destination chunks -> all-to-all the wire rows
  -> decode the N received chunks and sum them in fp32 -> cast to x.dtype.
* all-reduce: one-shot (compress -> all-gather -> decode+sum) or two-shot (compressed
  reduce-scatter over rows, fp32 result recompressed -> compressed all-gather).
* ppermute: compress -> ppermute the wire rows -> decompress (ranks that receive
  nothing hold zero bytes, which decode to zeros).
* all-to-all: plain only (``all_to_all``).

FP8 codes are never summed by a collective (every rank has its own scales). Wire format
(``codec.to_wire``, ``pallas_kernels.wire``): one uint8 buffer per message, each row its
codes then its groups' fp32 scales as bytes, so every compressed collective is one
transfer (uint8 because the CPU backend silently widens fp8 collectives to f16, and every
backend moves u8). Groups run along the last axis of each message, so gathering or
scattering along the last axis never makes a group straddle two ranks.

Messages for which compression does not pay go through the plain collective: smaller than
``compression.min_bytes`` per device (the local input's bytes) or below the size measured
for that collective on the link (``compression.link``, by default the one this process
runs on; ``taco_jax.policy.pays_for``). `decide` makes that choice, once per message:
inside the collective for a bare ``CompressionConfig``, or beforehand by a caller that
passes ``compression=Decided(codec)`` (the TP layers, which give the monitor the same one).

``free_communication(axis)``: while tracing inside it, the collectives over ``axis`` are
local stand-ins of the same shapes (for measuring a step whose communication costs nothing).

Compressed, these functions are forward-only (differentiating one raises a TypeError):
use ``taco_jax.mappings`` for regions with gradients. Uncompressed, they are the lax ops
and differentiate as those do.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from taco_jax import policy
from taco_jax.codec import CompressionConfig, from_wire, sum_from_wire, to_wire

AxisName = str | tuple[str, ...]
Algorithm = Literal["one_shot", "two_shot"]


def axis_size(axis_name: AxisName, fn: str = "collective", shape=()) -> int:
  """``jax.lax.axis_size`` with a clear error for an axis that is not in the mesh."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{fn}: unknown mesh axis {axis_name!r} (input shape {tuple(shape)}); call it "
        "inside a jax.shard_map whose mesh has this axis") from e


def _check_dim(fn: str, axis_name, n: int, shape, dim: int, what: str) -> int:
  ndim = len(shape)
  if not -ndim <= dim < ndim:
    raise ValueError(f"{fn}: {what}={dim} is out of range for an input of shape {shape}")
  dim %= ndim
  if shape[dim] % n:
    raise ValueError(
        f"{fn}: dimension {dim} of shape {tuple(shape)} has size {shape[dim]}, which is not "
        f"divisible by the size {n} of mesh axis {axis_name!r}")
  return dim


def _forward_only(fn: str, f, x):
  """Runs ``f(x)``; differentiating it raises a clear error instead of silently taking the
  gradient of the codec's own arithmetic (the u8 codes carry no tangent)."""
  @jax.custom_vjp
  def g(x):
    return f(x)

  def bwd(_, ct):
    raise TypeError(f"{fn}: a compressed collective has no gradient of its own; "
                    "differentiate through taco_jax.mappings (custom_vjp regions whose "
                    "backward collective is compressed separately)")

  g.defvjp(lambda x: (f(x), None), bwd)
  return g(x)


_decisions: list | None = None  # see `recording_decisions`
_free: list = []  # see `free_communication`: the axes whose collectives are stand-ins


@contextlib.contextmanager
def free_communication(axis_name: AxisName):
  """While tracing inside, ``all_gather``, ``reduce_scatter``, ``all_reduce`` and
  ``all_to_all`` over exactly ``axis_name`` send nothing: they are local stand-ins with the
  outputs' shapes (the local shard broadcast, the local slice, the input, the own chunk
  repeated), compressed or not; other axes and
  ``ppermute`` are untouched. The program computes nonsense with the same FLOPs: the step
  time of free communication over that axis (``benchmarks.bench_train``'s "ideal")."""
  _free.append(_axes(axis_name))
  try:
    yield
  finally:
    _free.pop()


def _axes(axis_name: AxisName) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def communication_is_free(axis_name: AxisName) -> bool:
  """Whether the collectives over ``axis_name`` are stand-ins here (`free_communication`):
  so that a caller that sends by other means (`taco_jax.tp.fused`'s kernels) stands in too."""
  return _axes(axis_name) in _free


class Decision(NamedTuple):
  """One decision of `decide`, as `recording_decisions` keeps it: which message, sent how."""
  collective: str
  nbytes: int                 # bytes per device of the local input
  compressed: bool
  site: str = ""              # the plan's site (`taco_jax.plan.SITES`), where the caller says
  axis_size: int | None = None
  shape: tuple = ()           # of the local input
  dtype: str = ""
  codec: CompressionConfig | None = None  # the codec asked for (sent or not)
  kernel: bool = False        # inside a fused collective-matmul kernel
  work: float | None = None   # the kernel's matmul FLOPs per byte of the message


@contextlib.contextmanager
def recording_decisions():
  """Collects every compression decision `decide` makes while tracing inside, as `Decision`
  records: e.g. around a step's lowering, to tell which messages a codec was asked for but
  a measured threshold (``link``) left plain, or which messages to time
  (`taco_jax.link_probe`)."""
  global _decisions
  outer, _decisions = _decisions, []
  try:
    yield _decisions
  finally:
    _decisions = outer


def decide(collective: str, x, compression: CompressionConfig | None,
           axis_size: int | None = None, *, kernel: bool = False, flops: int | None = None,
           site: str = "") -> CompressionConfig | None:
  """The codec ``collective`` ("all_gather", "reduce_scatter", "all_reduce", "ppermute")
  sends x with (the local input as passed to it; an array or a ``jax.ShapeDtypeStruct``):
  ``compression`` where it pays, else None (plain). Static, from shapes and the config.
  Without ``axis_size``, a ``link`` threshold is the most cautious measured one. ``kernel``:
  inside a fused collective-matmul kernel whose matmul takes ``flops`` (its own measured
  thresholds, by the work per byte of x: `policy.pays_for`). ``site``: the
  plan's name of the message (`taco_jax.plan.SITES`), for `recording_decisions` only.

  The one decision per message: a caller that also tells the monitor decides here and
  passes ``Decided(codec)`` to the collective; a collective given a bare config decides
  itself. With a codec, x must be a floating-point array of at least one dimension
  whatever its size (a TypeError / ValueError naming the collective otherwise), so that
  whether a call is accepted never depends on the message size."""
  if compression is None:
    return None
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{collective}: compression needs a floating-point input, got dtype "
                    f"{x.dtype}; send it with compression=None")
  if not x.shape:
    raise ValueError(f"{collective}: compression needs an array with at least one "
                     "dimension (groups run along the last), got a scalar")
  nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  work = None if flops is None else flops / nbytes
  pays = policy.pays_for(compression, collective, nbytes, axis_size, kernel=kernel, work=work)
  if _decisions is not None:
    _decisions.append(Decision(collective, nbytes, pays, site, axis_size, tuple(x.shape),
                               jnp.dtype(x.dtype).name, compression, kernel, work))
  return compression if pays else None


@dataclasses.dataclass(frozen=True)
class Decided:
  """A codec already chosen by `decide` for one message (None: plain). As a collective's
  ``compression`` it is sent with as it is, without deciding again: for callers that hand
  the same decision to `taco_jax.monitor`. Hashable, so a static argument like the config."""
  codec: CompressionConfig | None


Compression = CompressionConfig | Decided | None


def _codec(collective: str, x, compression: Compression, n: int) -> CompressionConfig | None:
  """The codec this message is sent with: the caller's decision, else `decide`'s."""
  if isinstance(compression, Decided):
    return compression.codec
  return decide(collective, x, compression, n)


def decision_summary(decisions) -> dict:
  """``recording_decisions``' list -> {collective: {"compressed": n, "plain": n,
  "plain_max_bytes": largest message left plain}}."""
  out = {}
  for collective, nbytes, compressed, *_ in decisions:
    row = out.setdefault(collective, {"compressed": 0, "plain": 0, "plain_max_bytes": 0})
    row["compressed" if compressed else "plain"] += 1
    if not compressed:
      row["plain_max_bytes"] = max(row["plain_max_bytes"], nbytes)
  return out


def roundtrip(x, cfg: CompressionConfig, dtype=jnp.float32):
  """What a receiver decodes from x sent with ``cfg``, computed on the sender: encode ->
  u8 wire format -> decode, with an optimization barrier on the wire arrays so that XLA
  cannot fold the fp32 -> fp8 -> fp32 round trip away (it may under excess precision).
  Not a collective: for measuring the error of what is sent (``taco_jax.monitor``)."""
  w = jax.lax.optimization_barrier(to_wire(x, cfg))
  return from_wire(w, cfg, x.shape[-1], dtype)


def _gather_wire(x, axis_name, cfg, to: str):
  """Compresses x and all-gathers its wire rows into a new leading axis [N, ...]."""
  return jax.lax.all_gather(to_wire(x, cfg), axis_name, axis=0, tiled=False, to=to)


def _reduce_stacked(chunks, axis_name, cfg, out_dtype):
  """Compressed reduce-scatter of chunks [N, ...]: rank i gets sum_j chunks_j[i] (fp32 sum)."""
  w = jax.lax.all_to_all(to_wire(chunks, cfg), axis_name, 0, 0, tiled=True)
  return sum_from_wire(w, cfg, chunks.shape[-1], out_dtype)


# --- public collectives ----------------------------------------------------------------


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = True,
               compression: Compression = None):
  """All-gather of ``x`` over ``axis_name`` (``lax.all_gather``; note ``tiled=True`` default).

  forward: all-gather, backward (its transpose): reduce-scatter (see ``mappings``).
  """
  fn = "all_gather"
  n = axis_size(axis_name, fn, x.shape)
  ndim = x.ndim + (0 if tiled else 1)
  if not -ndim <= axis < ndim:
    raise ValueError(f"{fn}: axis={axis} is out of range for an input of shape {x.shape}")
  axis %= ndim
  if communication_is_free(axis_name):
    y = jnp.broadcast_to(jnp.expand_dims(x, axis), (*x.shape[:axis], n, *x.shape[axis:]))
    return y.reshape(*x.shape[:axis], n * x.shape[axis], *x.shape[axis + 1:]) if tiled else y
  codec = _codec(fn, x, compression, n)
  if codec is None:
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
  return _forward_only(fn, lambda x: _all_gather(x, axis_name, axis, tiled, codec, "varying", n),
                       x)


def _all_gather(x, axis_name, axis, tiled, compression, to, n, out_dtype=None):
  y = from_wire(_gather_wire(x, axis_name, compression, to), compression, x.shape[-1],
                out_dtype or x.dtype)
  y = jnp.moveaxis(y, 0, axis)  # [N, *x.shape] -> the gathered axis in place
  if tiled:
    y = y.reshape(*x.shape[:axis], n * x.shape[axis], *x.shape[axis + 1:])
  return y


def reduce_scatter(x, axis_name: AxisName, *, scatter_dimension: int = 0,
                   compression: Compression = None):
  """Sum over ``axis_name``, rank i keeping chunk i of ``scatter_dimension`` (tiled
  ``lax.psum_scatter``). forward: reduce-scatter, backward (transpose): all-gather.

  Compressed: each of the N chunks is compressed, exchanged with one all-to-all and the
  N received chunks are decoded and summed in fp32, then cast to x.dtype.
  """
  fn = "reduce_scatter"
  n = axis_size(axis_name, fn, x.shape)
  d = _check_dim(fn, axis_name, n, x.shape, scatter_dimension, "scatter_dimension")
  if communication_is_free(axis_name):
    return jax.lax.slice_in_dim(x, 0, x.shape[d] // n, axis=d)
  codec = _codec(fn, x, compression, n)
  if codec is None:
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=d, tiled=True)
  return _forward_only(fn, lambda x: _reduce_scatter(x, axis_name, d, codec, x.dtype, n), x)


def _reduce_scatter(x, axis_name, d, compression, out_dtype, n):
  chunks = x.reshape(*x.shape[:d], n, x.shape[d] // n, *x.shape[d + 1:])
  chunks = jnp.moveaxis(chunks, d, 0)  # [N, *chunk_shape]; groups still on the last axis
  return _reduce_stacked(chunks, axis_name, compression, out_dtype)


def all_reduce(x, axis_name: AxisName, *, compression: Compression = None,
               algorithm: Algorithm = "two_shot"):
  """Sum of ``x`` over ``axis_name`` on every rank (``lax.psum``; the result is invariant).

  forward: all-reduce, backward (transpose): identity (see ``mappings``).
  ``one_shot``: every rank gathers every rank's compressed x and decodes+sums (N-1 chunks
  received per rank of the full size). ``two_shot``: compressed reduce-scatter over the
  flattened rows (padded to a multiple of N), the fp32 partial sum recompressed and
  all-gathered (2 (N-1)/N of the size received per rank, but two rounds of rounding).
  With fewer rows than N, padding would send more than one-shot, so one-shot runs.
  """
  fn = "all_reduce"
  if algorithm not in ("one_shot", "two_shot"):
    raise ValueError(f"{fn}: algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")
  n = axis_size(axis_name, fn, x.shape)
  if communication_is_free(axis_name):
    return x
  codec = _codec(fn, x, compression, n)
  if codec is None:
    return jax.lax.psum(x, axis_name)
  return _forward_only(fn, lambda x: _all_reduce(x, axis_name, codec, algorithm, n), x)


def _all_reduce(x, axis_name, compression, algorithm, n):
  rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
  if algorithm == "one_shot" or rows.shape[0] < n:
    return sum_from_wire(_gather_wire(x, axis_name, compression, "invarying"), compression,
                         x.shape[-1], x.dtype)
  r = rows.shape[0]
  pad = -r % n
  if pad:
    rows = jnp.pad(rows, [(0, pad), (0, 0)])  # [rows, D]: scatter the rows
  part = _reduce_scatter(rows, axis_name, 0, compression, jnp.float32, n)
  out = _all_gather(part, axis_name, 0, True, compression, "invarying", n, x.dtype)
  return out[:r].reshape(x.shape)


def all_to_all(x, axis_name: AxisName, *, split_axis: int, concat_axis: int):
  """Tiled ``lax.all_to_all``: rank i's chunk j of ``split_axis`` goes to rank j, which
  concatenates what it receives along ``concat_axis`` in rank order. Plain only (bf16 on
  the wire); differentiates as the lax op (its transpose swaps the two axes). Under
  `free_communication` a stand-in of the output's shape: this rank's own chunk, repeated."""
  fn = "all_to_all"
  n = axis_size(axis_name, fn, x.shape)
  split_axis = _check_dim(fn, axis_name, n, x.shape, split_axis, "split_axis")
  concat_axis = _check_dim(fn, axis_name, 1, x.shape, concat_axis, "concat_axis")
  if communication_is_free(axis_name):
    own = jax.lax.slice_in_dim(x, 0, x.shape[split_axis] // n, axis=split_axis)
    return jnp.concatenate([own] * n, axis=concat_axis)
  return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def ppermute(x, axis_name: AxisName, perm, *, compression: Compression = None):
  """``lax.ppermute``: rank src sends x to rank dst for each (src, dst) in ``perm``; ranks
  that receive nothing get zeros. forward: ppermute, backward: ppermute with perm inverted.
  """
  n = axis_size(axis_name, "ppermute", x.shape)
  codec = _codec("ppermute", x, compression, n)
  if codec is None:
    return jax.lax.ppermute(x, axis_name, perm)
  return _forward_only("ppermute", lambda x: _ppermute(x, axis_name, perm, codec), x)


def _ppermute(x, axis_name, perm, compression):
  w = jax.lax.ppermute(to_wire(x, compression), axis_name, perm)
  return from_wire(w, compression, x.shape[-1], x.dtype)  # zero bytes -> zeros
