"""TACO encode: per-group RMS pre-scale, Hadamard transform, absmax post-scale, FP8 cast.

``encode_reference`` is the specification (and the CPU path); the fused Pallas kernel
``encode_pallas`` must produce the same codes bit for bit and the same scales. Both run
the per-group math of ``encode_groups`` on ``[groups, G]`` tiles: the reference on the
whole array, the kernel on one ``[block_rows * block_groups, G]`` tile per program.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from taco_jax.pallas_kernels import wire
from taco_jax.pallas_kernels.common import (ALPHA_MAX, ALPHA_MIN, FP8_DTYPES, FP8_MAX, SCALE_MAX,
                                   SCALE_MIN, check_2d, choose_blocks, dispatch, hadamard_dot,
                                   hadamard_iota, hadamard_matrix, needs_two_terms,
                                   pallas_call, pow2_floor_f32, row_mask, sum_of_squares)


def encode_groups(x_MG, h_GG, *, fmt: str, dual_scale: bool, lam: float,
                  two_term: bool = False, fixed_order: bool = True):
  """Encodes M groups (rows of ``x_MG``, fp32); returns ``(codes_MG, alpha_M, scale_M)``.

  ``h_GG``: the Hadamard matrix (``[2G, G]`` row-repeated with ``two_term``, see
  ``hadamard_dot``), or None for no transform. The math, in this order:

    alpha = clip(sqrt(M^2 / (mean(bf16(x)^2) + lam)), 1e-3, 1e3)   (1 if not dual_scale)
    p     = 2^floor(log2 alpha)                  exact power of two, alpha / p in [1, 2)
    y     = (H_G bf16(p x)) * ((alpha / p) / sqrt(G))   = H_G (alpha x) / sqrt(G)
    s     = clip(max|y| / M, 1e-12, 1e6)
    q     = fp8(clip(y * (1 / s), -M, M))

  Scaling by p (exact) before the dot keeps H x from overflowing fp32 for huge x and keeps
  the dot's operands bf16-exact for bf16 inputs. A group holding NaN or Inf gets NaN
  alpha, NaN scale and NaN codes, so it decodes to NaN, never to finite numbers. Every
  step lowers to Triton and means the same there: NaN is caught by a sum (the mean square,
  or x * 0 without dual scale; Triton's max drops NaNs), Inf by max|y| (one reduction
  fewer than a separate finiteness test). ``fixed_order`` (see
  ``sum_of_squares``) is off only in the compiled GPU kernel.
  """
  g = x_MG.shape[-1]
  fp8_max = FP8_MAX[fmt]
  if dual_scale:
    # Squares of bf16(x) are exact in fp32, so no FMA contraction can change them.
    xb_MG = x_MG.astype(jnp.bfloat16).astype(jnp.float32)
    mean_sq_M = sum_of_squares(xb_MG, fixed_order=fixed_order) * (1.0 / g)
    no_nan_M = mean_sq_M == mean_sq_M  # a sum keeps NaN (Triton's max would drop it)
    # sqrt(M^2 / ms), not M / sqrt(ms): XLA rewrites the latter to M * rsqrt(ms), whose
    # last bit depends on vectorization; IEEE division and sqrt do not.
    alpha_M = jnp.clip(jnp.sqrt((fp8_max * fp8_max) / (mean_sq_M + lam)), ALPHA_MIN,
                       ALPHA_MAX)
  else:
    alpha_M = jnp.ones(x_MG.shape[:1], jnp.float32)
    no_nan_M = jnp.sum(x_MG * 0.0, axis=-1) == 0.0  # x * 0 is NaN exactly for NaN and Inf
  if h_GG is None:
    y_MG = x_MG * alpha_M[:, None]
  else:
    p_M = pow2_floor_f32(alpha_M)
    t_MG = hadamard_dot(x_MG * p_M[:, None], h_GG, two_term=two_term)
    y_MG = t_MG * ((alpha_M / p_M) * (g**-0.5))[:, None]
  amax_M = jnp.max(jnp.abs(y_MG), axis=-1)
  # An Inf in x makes some |y| infinite; a finite x never does (p keeps H x in range).
  finite_M = no_nan_M & (amax_M < jnp.inf)
  scale_M = jnp.clip(amax_M * (1.0 / fp8_max), SCALE_MIN, SCALE_MAX)
  # One reciprocal per group, not a division per element (IEEE division is a long
  # instruction sequence on GPU); the rounding is the reference's too.
  q_MG = jnp.clip(y_MG * (1.0 / scale_M)[:, None], -fp8_max, fp8_max)
  q_MG = jnp.where(finite_M[:, None], q_MG, jnp.nan)
  alpha_M = jnp.where(finite_M, alpha_M, jnp.nan)
  scale_M = jnp.where(finite_M, scale_M, jnp.nan)
  return q_MG.astype(FP8_DTYPES[fmt]), alpha_M, scale_M


def encode_reference(x_RD, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
                     dual_scale: bool = True, lam: float = 1e-6):
  """Encodes ``x_RD`` group by group; returns ``(codes_RD fp8, alpha_RK, scale_RK)``.

  K = D / group_size groups per row; see ``encode_groups`` for the math.
  """
  check_2d(x_RD, group_size, "encode_reference")
  rows, d = x_RD.shape
  k = d // group_size
  two_term = needs_two_terms(x_RD.dtype)
  h_GG = jnp.asarray(hadamard_matrix(group_size, 1 + two_term)) if hadamard else None
  codes_MG, alpha_M, scale_M = encode_groups(
      x_RD.astype(jnp.float32).reshape(rows * k, group_size), h_GG, fmt=fmt,
      dual_scale=dual_scale, lam=lam, two_term=two_term)
  return codes_MG.reshape(rows, d), alpha_M.reshape(rows, k), scale_M.reshape(rows, k)


def _encode_kernel(x_ref, *refs, rows, group_size, groups, fmt, hadamard, dual_scale, lam,
                   h_iota, fixed_order, packed):
  two_term = needs_two_terms(x_ref.dtype)
  if hadamard and not h_iota:
    h_ref, *out_refs = refs
    h = h_ref[...]
  else:
    out_refs = refs
    h = hadamard_iota(group_size, 1 + two_term) if hadamard else None
  br, bkg = x_ref.shape
  bk = bkg // group_size
  ragged = rows % br != 0
  if ragged:
    x = plgpu.load(x_ref, mask=row_mask(rows, (br, bkg)), other=0.0)
  else:
    x = x_ref[...]
  codes, alpha, scale = encode_groups(
      x.astype(jnp.float32).reshape(br * bk, group_size), h, fmt=fmt, dual_scale=dual_scale,
      lam=lam, two_term=two_term, fixed_order=fixed_order)
  codes, alpha, scale = codes.reshape(br, bkg), alpha.reshape(br, bk), scale.reshape(br, bk)
  if packed:
    (wire_ref,) = out_refs
    wire.store_tile(wire_ref, codes, alpha, scale, j=pl.program_id(1), groups=groups,
                    rows=rows if ragged else None)
    return
  for ref, value in zip(out_refs, (codes, alpha, scale)):
    if ragged:
      plgpu.store(ref, value, mask=row_mask(rows, value.shape))
    else:
      ref[...] = value


@functools.partial(jax.jit, static_argnames=(
    "group_size", "fmt", "hadamard", "dual_scale", "lam", "interpret", "block_rows",
    "block_groups", "num_warps", "num_stages", "h_iota", "packed"))
def encode_pallas(x_RD, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
                  dual_scale: bool = True, lam: float = 1e-6, interpret: bool = False,
                  block_rows: int = 8, block_groups: int = 8, num_warps: int = 4,
                  num_stages: int = 2, h_iota: bool = False, packed: bool = False):
  """Fused encode, one pass: reads x once, writes codes and both scales once.

  ``packed``: returns the ``[rows, D + 8 K]`` uint8 wire rows (``pallas_kernels.wire``)
  instead of ``(codes, alpha, scale)``.

  Reference: ``encode_reference`` (same outputs; codes bit-exact in interpret mode).
  Grid over ``[block_rows, block_groups * G]`` tiles (powers of two; ``choose_blocks``);
  a last row block that overhangs is masked. ``interpret=True`` runs on CPU. H is read
  from memory (L2-resident) by every program, or with ``h_iota`` built in registers.
  """
  check_2d(x_RD, group_size, "encode_pallas")
  if not jnp.issubdtype(x_RD.dtype, jnp.floating):
    raise TypeError(f"encode expects a floating-point array, got dtype {x_RD.dtype}")
  rows, d = x_RD.shape
  k = d // group_size
  br, bk = choose_blocks(rows, k, block_rows, block_groups)
  tile = lambda i, j: (i, j)  # noqa: E731
  in_specs = [pl.BlockSpec((br, bk * group_size), tile)]
  operands = [x_RD]
  if hadamard and not h_iota:
    h = hadamard_matrix(group_size, 1 + needs_two_terms(x_RD.dtype))
    in_specs.append(pl.BlockSpec(h.shape, lambda i, j: (0, 0)))
    operands.append(jnp.asarray(h, jnp.bfloat16))
  kernel = functools.partial(_encode_kernel, rows=rows, group_size=group_size, groups=k,
                             fmt=fmt, hadamard=hadamard, dual_scale=dual_scale, lam=lam,
                             h_iota=h_iota, fixed_order=interpret, packed=packed)
  if packed:  # each program writes its codes and scales into its rows (wire.store_tile)
    w = wire.width(d, group_size)
    out_shape = jax.ShapeDtypeStruct((rows, w), jnp.uint8)
    out_specs = pl.BlockSpec((br, w), lambda i, j: (i, 0))
  else:
    out_shape = (jax.ShapeDtypeStruct((rows, d), FP8_DTYPES[fmt]),
                 jax.ShapeDtypeStruct((rows, k), jnp.float32),
                 jax.ShapeDtypeStruct((rows, k), jnp.float32))
    out_specs = (pl.BlockSpec((br, bk * group_size), tile), pl.BlockSpec((br, bk), tile),
                 pl.BlockSpec((br, bk), tile))
  return pallas_call(
      kernel, operands, out_shape,
      grid=(pl.cdiv(rows, br), k // bk),
      in_specs=in_specs,
      out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"taco_encode_{fmt}_g{group_size}",
  )


def encode(x_RD, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
           dual_scale: bool = True, lam: float = 1e-6, implementation: str = "xla",
           interpret: bool = False, packed: bool = False, **block_kwargs):
  """Dispatches to the reference (``"xla"``) or the fused kernel (``"pallas"``).

  ``packed``: return the uint8 wire rows (``pallas_kernels.wire``) instead of
  ``(codes, alpha, scale)``. ``block_kwargs`` (``block_rows``, ``block_groups``,
  ``num_warps``, ``num_stages``) tune the kernel and are ignored by the reference.
  """
  reference = (lambda x, **kw: wire.pack(*encode_reference(x, **kw))) if packed else \
      encode_reference
  return dispatch("encode", implementation, {"xla": reference, "pallas": encode_pallas}, x_RD,
                  group_size=group_size, fmt=fmt, hadamard=hadamard, dual_scale=dual_scale,
                  lam=lam, dtype=x_RD.dtype,
                  kernel_kwargs=dict(interpret=interpret, packed=packed, **block_kwargs))
