"""Collective matmuls: a sequence-parallel layer's all-gather / reduce-scatter split into a
ring of point-to-point transfers, each in flight while the matmul of another chunk runs.

Used by the column / row-parallel layers when `parallel.tp_overlap = "ring"`; the math is that of
`mappings.gather_from_sp` + matmul and matmul + `mappings.reduce_scatter_to_sp`
(`tests/test_overlap.py` checks values and gradients against them). With n ranks on the
axis and this rank r, chunk c is rows [c S, (c + 1) S) of the full sequence T = n S.

  gather_matmul(x_BSD, w_DF)  = all_gather(x) @ w. Step k multiplies the chunk held (that of
      rank r + k) while the next arrives from rank r + 1. With a codec, x is encoded once
      and its codes travel the ring (one encode, n - 1 decodes: the all-gather's error).
      backward: dx = ring reduce-scatter of dy @ w.T, whose transfers overlap the weight
      gradient dw = x_full.T @ dy (x_full: the chunks the forward received, kept as the
      residual, as autodiff of the direct version keeps the gathered x).
  matmul_scatter(y_BTF, w_FD) = reduce_scatter(y @ w). The running sum of chunk c travels
      r -> r + 1, each rank adding its y_c @ w, computed while the transfer is in flight.
      With a codec each hop re-encodes the running sum: n - 1 roundings of partial sums
      (about sqrt(n - 1) times the error of the direct compressed reduce-scatter).
      backward: dy_c = dout_c @ w.T with dout gathered by the ring; dw = sum_c y_c.T @ dout_c.

Whether a codec is used is `collectives.decide`'s decision on the message the direct
collective would send, once per message, so thresholds and `link` apply as they do there.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from taco_jax import collectives
from taco_jax.codec import CompressionConfig, from_wire, to_wire

SEQ = 1  # the sequence axis of [B, T, D] activations
# The weight gradients of a gathered input are dots with outputs in the weight's dtype (fp32
# accumulation), as XLA's own transposes of the collective layers' matmuls are, so XLA runs
# them on cuBLAS. True (bench_train's ``_dwf32``): fp32 outputs cast to the weight's dtype,
# a dot and a cast that XLA fuses into a Triton GEMM (the ring and kernel layers before
# 2026-11-28). The ring's reduce-scatter backward sums its chunks' products in fp32.
WEIGHT_GRADIENTS_F32 = False


def weight_gradient(spec: str, a, b, dtype):
  """The weight gradient ``einsum(spec, a, b)`` in the weight's ``dtype``
  (``WEIGHT_GRADIENTS_F32``: which output the dot itself has)."""
  out = jnp.float32 if WEIGHT_GRADIENTS_F32 else dtype
  return jnp.einsum(spec, a, b, preferred_element_type=out).astype(dtype)


def _chunk(a, c, size: int):
  return jax.lax.dynamic_slice_in_dim(a, c * size, size, axis=SEQ)


def _ring_gather(x, axis_name, n: int, codec):
  """Yields (c, x_c) for the n chunks of all_gather(x) along the sequence (c = the rank
  that owns x_c), issuing the transfer of the next chunk before yielding the current."""
  r = jax.lax.axis_index(axis_name)
  from_next = [(i, (i - 1) % n) for i in range(n)]
  if codec is None:
    msg, read = x, lambda m: m
  else:
    msg = to_wire(x, codec)  # the u8 wire rows of the collectives
    read = lambda m: from_wire(m, codec, x.shape[-1], x.dtype)  # noqa: E731
  for k in range(n):
    nxt = jax.lax.ppermute(msg, axis_name, from_next) if k + 1 < n else None
    yield (r + k) % n, read(msg)
    msg = nxt


def _ring_reduce_scatter(part, axis_name, n: int, codec, dtype):
  """sum over ranks of part(c) at c = this rank; part(c) is this rank's [B, S, ...] share
  of chunk c. Sums in fp32, sends in `dtype` (or as codes)."""
  r = jax.lax.axis_index(axis_name)
  to_next = [(i, (i + 1) % n) for i in range(n)]

  def send(a):
    if codec is None:
      return jax.lax.ppermute(a, axis_name, to_next)
    w = jax.lax.ppermute(to_wire(a, codec), axis_name, to_next)
    return from_wire(w, codec, a.shape[-1], jnp.float32)  # decoded straight to fp32

  acc = part((r - 1) % n).astype(dtype)
  for k in range(1, n):
    mine = part((r - k - 1) % n)  # independent of the transfer below: overlaps it
    acc = (send(acc).astype(jnp.float32) + mine.astype(jnp.float32)).astype(dtype)
  return acc


# --- all-gather -> matmul ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def gather_matmul(x_BSD, w_DF, axis_name, fwd: CompressionConfig | None = None,
                  bwd: CompressionConfig | None = None, out_dtype=None):
  """all_gather(x_BSD along the sequence) @ w_DF, as a ring (module docstring); the
  products in `out_dtype` (default: that of x and w), e.g. fp32 logits."""
  return _gather_matmul_fwd(x_BSD, w_DF, axis_name, fwd, bwd, out_dtype)[0]


def _gather_matmul_fwd(x, w, axis_name, fwd, bwd, out_dtype):
  n = collectives.axis_size(axis_name, "gather_matmul", x.shape)
  s = x.shape[SEQ]
  out_dtype = out_dtype or jnp.result_type(x, w)
  y = jnp.zeros((x.shape[0], n * s, w.shape[1]), out_dtype)
  x_full = jnp.zeros((x.shape[0], n * s, x.shape[2]), x.dtype)
  codec = collectives.decide("all_gather", x, fwd, n)
  for c, x_c in _ring_gather(x, axis_name, n, codec):
    y_c = jnp.einsum("bsd,df->bsf", x_c, w, preferred_element_type=out_dtype)
    y = jax.lax.dynamic_update_slice_in_dim(y, y_c, c * s, axis=SEQ)
    x_full = jax.lax.dynamic_update_slice_in_dim(x_full, x_c, c * s, axis=SEQ)
  return y, (x_full, w)


def _gather_matmul_bwd(axis_name, fwd, bwd, out_dtype, res, dy):
  x_full, w = res
  n = collectives.axis_size(axis_name, "gather_matmul", x_full.shape)
  s = x_full.shape[SEQ] // n
  rs_codec = collectives.decide("reduce_scatter", x_full, bwd, n)
  dx = _ring_reduce_scatter(lambda c: jnp.einsum("bsf,df->bsd", _chunk(dy, c, s), w),
                            axis_name, n, rs_codec, x_full.dtype)
  return dx, weight_gradient("btd,btf->df", x_full, dy, w.dtype)


gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


# --- matmul -> reduce-scatter --------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_scatter(y_BTF, w_FD, axis_name, fwd: CompressionConfig | None = None,
                   bwd: CompressionConfig | None = None):
  """reduce_scatter(y_BTF @ w_FD along the sequence), as a ring (module docstring)."""
  return _matmul_scatter_fwd(y_BTF, w_FD, axis_name, fwd, bwd)[0]


def _matmul_scatter_fwd(y, w, axis_name, fwd, bwd):
  n = collectives.axis_size(axis_name, "matmul_scatter", y.shape)
  if y.shape[SEQ] % n:
    raise ValueError(f"matmul_scatter: sequence length {y.shape[SEQ]} of {y.shape} is not "
                     f"divisible by the size {n} of axis {axis_name!r}")
  s = y.shape[SEQ] // n
  dtype = jnp.result_type(y, w)
  partial = jax.ShapeDtypeStruct((*y.shape[:-1], w.shape[1]), dtype)  # y @ w
  codec = collectives.decide("reduce_scatter", partial, fwd, n)
  out = _ring_reduce_scatter(lambda c: jnp.einsum("bsf,fd->bsd", _chunk(y, c, s), w),
                             axis_name, n, codec, dtype)
  return out, (y, w)


def _matmul_scatter_bwd(axis_name, fwd, bwd, res, dout):
  y, w = res
  n = collectives.axis_size(axis_name, "matmul_scatter", y.shape)
  s = dout.shape[SEQ]
  dy = jnp.zeros(y.shape, jnp.result_type(dout, w))
  dw = jnp.zeros(w.shape, jnp.float32)
  codec = collectives.decide("all_gather", dout, bwd, n)
  for c, d_c in _ring_gather(dout, axis_name, n, codec):
    dy = jax.lax.dynamic_update_slice_in_dim(dy, jnp.einsum("bsd,fd->bsf", d_c, w), c * s,
                                             axis=SEQ)
    dw += jnp.einsum("bsf,bsd->fd", _chunk(y, c, s), d_c, preferred_element_type=jnp.float32)
  return dy.astype(y.dtype), dw.astype(w.dtype)


matmul_scatter.defvjp(_matmul_scatter_fwd, _matmul_scatter_bwd)
