"""TACO decode and fused decode-and-sum: the inverse of ``encode``.

``x_hat = (H_G q) * (s / sqrt(G) / alpha)`` per group (H is symmetric and orthogonal after
the 1/sqrt(G); the scales are applied after the transform, where they are one multiply per
element, so the dot sees the fp8 codes themselves, exact in bf16). ``decode_sum_reference``
decodes N stacked chunks and sums them in fp32: the receive side of a compressed
reduce-scatter. The kernels ``decode_pallas``/``decode_sum_pallas`` run the same
``decode_groups`` on one tile per program.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from taco_jax.pallas_kernels import wire
from taco_jax.pallas_kernels.common import (check_2d, choose_blocks, dispatch, hadamard_dot,
                                            hadamard_iota, hadamard_matrix, pallas_call,
                                            row_mask)


def group_multiplier(alpha, scale):
  """What a group's codes are multiplied by to decode them without the transform:
  ``scale / alpha``. alpha = 0 only in all-zero wire rows (a message never sent, e.g. what
  ppermute's non-receivers hold): they decode to zeros, not 0 / 0."""
  return jnp.where(alpha == 0, 0.0, scale / alpha)


def decode_groups(codes_MG, alpha_M, scale_M, h_GG):
  """Decodes M groups to fp32 ``[M, G]``; ``h_GG`` is None for no transform."""
  g = codes_MG.shape[-1]
  q_MG = codes_MG.astype(jnp.float32)
  if h_GG is None:
    return q_MG * group_multiplier(alpha_M, scale_M)[:, None]
  return hadamard_dot(q_MG, h_GG) * jnp.where(alpha_M == 0, 0.0,
                                              scale_M * (g**-0.5) / alpha_M)[:, None]


def _decode_f32(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool):
  rows, d = codes_RD.shape
  k = d // group_size
  h_GG = jnp.asarray(hadamard_matrix(group_size)) if hadamard else None
  out_MG = decode_groups(codes_RD.reshape(rows * k, group_size), alpha_RK.reshape(rows * k),
                         scale_RK.reshape(rows * k), h_GG)
  return out_MG.reshape(rows, d)


def decode_reference(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool = True,
                     out_dtype=jnp.bfloat16):
  """Decodes one encoded array back to ``out_dtype``."""
  check_2d(codes_RD, group_size, "decode_reference")
  return _decode_f32(codes_RD, alpha_RK, scale_RK, group_size=group_size,
                     hadamard=hadamard).astype(out_dtype)


def decode_sum_reference(codes_NRD, alpha_NRK, scale_NRK, *, group_size: int,
                         hadamard: bool = True, out_dtype=jnp.bfloat16):
  """Decodes N stacked encoded chunks and returns their fp32 sum (chunk 0 first) cast to
  ``out_dtype``."""
  check_2d(codes_NRD[0], group_size, "decode_sum_reference")
  n = codes_NRD.shape[0]
  total = jnp.zeros(codes_NRD.shape[1:], jnp.float32)
  for i in range(n):
    total = total + _decode_f32(codes_NRD[i], alpha_NRK[i], scale_NRK[i],
                                group_size=group_size, hadamard=hadamard)
  return total.astype(out_dtype)


def _load(ref, rows, ragged, other):
  """Loads a ``[block_rows, cols]`` tile; with ``ragged``, rows past the end read ``other``."""
  if not ragged:
    return ref[...]
  return plgpu.load(ref, mask=row_mask(rows, ref.shape[-2:]),
                    other=jnp.full((), other, ref.dtype))


def _decode_sum_kernel(*refs, rows, group_size, groups, hadamard, n, stacked, h_iota,
                       packed_fmt):
  """Decodes the tile of each of the ``n`` chunks and sums them in fp32 (chunk 0 first).

  Inputs: ``codes, alpha, scale`` refs, or with ``packed_fmt`` (the codes' format) one ref
  of wire rows (``pallas_kernels.wire``); then H (unless ``h_iota``), then the output."""
  n_in = 1 if packed_fmt else 3
  in_refs, refs = refs[:n_in], refs[n_in:]
  if hadamard and not h_iota:
    h_ref, out_ref = refs
    h = h_ref[...]
  else:
    (out_ref,) = refs
    h = hadamard_iota(group_size) if hadamard else None
  br, bkg = out_ref.shape
  bk = bkg // group_size
  ragged = rows % br != 0
  total = jnp.zeros((br * bk, group_size), jnp.float32)
  for i in range(n):
    # Rows past the end decode to zeros (never stored): wire rows read zero bytes (alpha = 0,
    # see decode_groups), separate arrays alpha = scale = 1 and zero codes.
    if packed_fmt:
      codes, alpha, scale = wire.load_tile(
          in_refs[0], j=pl.program_id(1), group_size=group_size, bk=bk, groups=groups,
          fmt=packed_fmt, rows=rows if ragged else None,
          chunk=jnp.int32(i) if stacked else None)
    else:
      chunk = [ref.at[jnp.int32(i)] if stacked else ref for ref in in_refs]
      codes, alpha, scale = (_load(ref, rows, ragged, other)
                             for ref, other in zip(chunk, (0.0, 1.0, 1.0)))
    total = total + decode_groups(codes.reshape(br * bk, group_size), alpha.reshape(br * bk),
                                  scale.reshape(br * bk), h)
  out = total.reshape(br, bkg).astype(out_ref.dtype)
  if ragged:
    plgpu.store(out_ref, out, mask=row_mask(rows, (br, bkg)))
  else:
    out_ref[...] = out


@functools.partial(jax.jit, static_argnames=(
    "group_size", "hadamard", "out_dtype", "interpret", "block_rows", "block_groups",
    "num_warps", "num_stages", "stacked", "h_iota", "packed_fmt"))
def _decode_sum_call(*inputs, group_size, hadamard, out_dtype, interpret, block_rows,
                     block_groups, num_warps, num_stages, stacked, h_iota, packed_fmt=None):
  """``inputs``: (codes, alpha, scale), or (wire rows,) with ``packed_fmt``."""
  n = inputs[0].shape[0] if stacked else 1
  rows, d = inputs[0].shape[-2:]
  if packed_fmt:
    d = wire.message_width(d, group_size)
  k = d // group_size
  br, bk = choose_blocks(rows, k, block_rows, block_groups)
  lead = (n,) if stacked else ()
  tile = (lambda i, j: (0, i, j)) if stacked else (lambda i, j: (i, j))
  if packed_fmt:  # whole wire rows; each program reads its own columns (wire.load_tile)
    row_block = (lambda i, j: (0, i, 0)) if stacked else (lambda i, j: (i, 0))
    in_specs = [pl.BlockSpec(lead + (br, inputs[0].shape[-1]), row_block)]
  else:
    in_specs = [pl.BlockSpec(lead + (br, bk * group_size), tile),
                pl.BlockSpec(lead + (br, bk), tile), pl.BlockSpec(lead + (br, bk), tile)]
  operands = list(inputs)
  if hadamard and not h_iota:
    in_specs.append(pl.BlockSpec((group_size, group_size), lambda i, j: (0, 0)))
    operands.append(jnp.asarray(hadamard_matrix(group_size), jnp.bfloat16))
  kernel = functools.partial(_decode_sum_kernel, rows=rows, group_size=group_size, groups=k,
                             hadamard=hadamard, n=n, stacked=stacked, h_iota=h_iota,
                             packed_fmt=packed_fmt)
  return pallas_call(
      kernel, operands, jax.ShapeDtypeStruct((rows, d), out_dtype),
      grid=(pl.cdiv(rows, br), k // bk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((br, bk * group_size), lambda i, j: (i, j)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"taco_decode{'_sum' if stacked else ''}_g{group_size}",
  )


def decode_pallas(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool = True,
                  out_dtype=jnp.bfloat16, interpret: bool = False, block_rows: int = 8,
                  block_groups: int = 8, num_warps: int = 4, num_stages: int = 2,
                  h_iota: bool = False):
  """Fused decode, one pass: reads codes and scales once, writes x_hat once.

  Reference: ``decode_reference``. Tiling as in ``encode_pallas``.
  """
  check_2d(codes_RD, group_size, "decode_pallas")
  return _decode_sum_call(codes_RD, alpha_RK, scale_RK, group_size=group_size,
                          hadamard=hadamard, out_dtype=jnp.dtype(out_dtype),
                          interpret=interpret, block_rows=block_rows,
                          block_groups=block_groups, num_warps=num_warps,
                          num_stages=num_stages, stacked=False, h_iota=h_iota)


def decode_sum_pallas(codes_NRD, alpha_NRK, scale_NRK, *, group_size: int,
                      hadamard: bool = True, out_dtype=jnp.bfloat16, interpret: bool = False,
                      block_rows: int = 8, block_groups: int = 8, num_warps: int = 4,
                      num_stages: int = 2, h_iota: bool = False):
  """Fused decode-and-sum of N stacked chunks: each tile of every chunk is decoded and
  accumulated in fp32 registers, and the sum is written once.

  Reference: ``decode_sum_reference`` (same order of the fp32 sum: chunk 0 first).
  """
  if codes_NRD.ndim != 3:
    raise ValueError(f"decode_sum expects [N, rows, D] codes, got shape {codes_NRD.shape}")
  check_2d(codes_NRD[0], group_size, "decode_sum_pallas")
  return _decode_sum_call(codes_NRD, alpha_NRK, scale_NRK, group_size=group_size,
                          hadamard=hadamard, out_dtype=jnp.dtype(out_dtype),
                          interpret=interpret, block_rows=block_rows,
                          block_groups=block_groups, num_warps=num_warps,
                          num_stages=num_stages, stacked=True, h_iota=h_iota)


def decode(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool = True,
           out_dtype=jnp.bfloat16, implementation: str = "xla", interpret: bool = False,
           **block_kwargs):
  """Dispatches to the reference (``"xla"``) or the fused kernel (``"pallas"``)."""
  return dispatch("decode", implementation, {"xla": decode_reference, "pallas": decode_pallas},
                  codes_RD, alpha_RK, scale_RK, group_size=group_size, hadamard=hadamard,
                  out_dtype=out_dtype, kernel_kwargs=dict(interpret=interpret, **block_kwargs))


def decode_sum(codes_NRD, alpha_NRK, scale_NRK, *, group_size: int, hadamard: bool = True,
               out_dtype=jnp.bfloat16, implementation: str = "xla", interpret: bool = False,
               **block_kwargs):
  """Dispatches to the reference (``"xla"``) or the fused kernel (``"pallas"``)."""
  return dispatch("decode_sum", implementation,
                  {"xla": decode_sum_reference, "pallas": decode_sum_pallas}, codes_NRD,
                  alpha_NRK, scale_NRK, group_size=group_size, hadamard=hadamard,
                  out_dtype=out_dtype, kernel_kwargs=dict(interpret=interpret, **block_kwargs))


def decode_wire(wire_RW, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
                out_dtype=jnp.bfloat16, implementation: str = "xla", interpret: bool = False,
                **block_kwargs):
  """``decode`` of packed wire rows ``[rows, D + 8 K]`` (``pallas_kernels.wire``): the
  kernel reads the codes and scales straight from them; the reference unpacks (XLA fuses
  the unpacking into the decode)."""
  return _decode_wire(wire_RW, False, group_size=group_size, fmt=fmt, hadamard=hadamard,
                      out_dtype=out_dtype, implementation=implementation,
                      interpret=interpret, **block_kwargs)


def decode_sum_wire(wire_NRW, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
                    out_dtype=jnp.bfloat16, implementation: str = "xla",
                    interpret: bool = False, **block_kwargs):
  """``decode_sum`` of N stacked chunks of packed wire rows ``[N, rows, D + 8 K]``."""
  if wire_NRW.ndim != 3:
    raise ValueError(f"decode_sum_wire expects [N, rows, width] wire rows, got shape "
                     f"{wire_NRW.shape}")
  return _decode_wire(wire_NRW, True, group_size=group_size, fmt=fmt, hadamard=hadamard,
                      out_dtype=out_dtype, implementation=implementation,
                      interpret=interpret, **block_kwargs)


def _decode_wire(w, stacked, *, group_size, fmt, hadamard, out_dtype, implementation,
                 interpret, block_rows=8, block_groups=8, num_warps=4, num_stages=2,
                 h_iota=False):
  if w.dtype != jnp.uint8:
    raise TypeError(f"wire rows must be uint8, got {w.dtype}")
  # A width that is no message of whole groups fails in wire.message_width on both paths.
  ref = decode_sum_reference if stacked else decode_reference
  table = {"xla": lambda w, **kw: ref(*wire.unpack(w, group_size=group_size, fmt=fmt), **kw),
           "pallas": lambda w, out_dtype, **kw: _decode_sum_call(
               w, out_dtype=jnp.dtype(out_dtype), stacked=stacked, packed_fmt=fmt, **kw)}
  return dispatch("decode", implementation, table, w, group_size=group_size,
                  hadamard=hadamard, out_dtype=out_dtype,
                  kernel_kwargs=dict(interpret=interpret, block_rows=block_rows,
                                     block_groups=block_groups, num_warps=num_warps,
                                     num_stages=num_stages, h_iota=h_iota))
