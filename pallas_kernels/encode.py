"""TACO encode: per-group RMS pre-scale, Hadamard transform, absmax post-scale, FP8 cast.

``encode_reference`` is the specification (and the CPU path); the fused Pallas kernel
must produce the same codes bit for bit and the same scales.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.common import (ALPHA_MAX, ALPHA_MIN, FP8_DTYPES, FP8_MAX, SCALE_MAX,
                                   SCALE_MIN, check_2d, hadamard_matrix)


def encode_reference(x_RD, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
                     dual_scale: bool = True, lam: float = 1e-6):
  """Encodes ``x_RD`` group by group; returns ``(codes_RD fp8, alpha_RK, scale_RK)``.

  K = D / group_size groups per row. A group holding NaN or Inf gets a NaN scale, so it
  decodes to NaN rather than to plausible finite numbers.
  """
  check_2d(x_RD, group_size, "encode_reference")
  rows, d = x_RD.shape
  fp8_max = FP8_MAX[fmt]
  x_RKG = x_RD.astype(jnp.float32).reshape(rows, d // group_size, group_size)
  finite_RK = jnp.isfinite(jnp.max(jnp.abs(x_RKG), axis=-1))
  if dual_scale:
    mean_sq_RK = jnp.mean(x_RKG * x_RKG, axis=-1)
    alpha_RK = jnp.clip(fp8_max / jnp.sqrt(mean_sq_RK + lam), ALPHA_MIN, ALPHA_MAX)
  else:
    alpha_RK = jnp.ones((rows, d // group_size), jnp.float32)
  y_RKG = x_RKG * alpha_RK[..., None]
  if hadamard:
    h_GG = jnp.asarray(hadamard_matrix(group_size))
    y_RKG = jnp.dot(y_RKG, h_GG, precision=jax.lax.Precision.HIGHEST) * (group_size**-0.5)
  scale_RK = jnp.clip(jnp.max(jnp.abs(y_RKG), axis=-1) / fp8_max, SCALE_MIN, SCALE_MAX)
  scale_RK = jnp.where(finite_RK, scale_RK, jnp.nan)
  q_RKG = jnp.clip(y_RKG / scale_RK[..., None], -fp8_max, fp8_max)
  codes_RD = q_RKG.astype(FP8_DTYPES[fmt]).reshape(rows, d)
  return codes_RD, alpha_RK, scale_RK


def encode(x_RD, *, group_size: int, fmt: str = "e4m3", hadamard: bool = True,
           dual_scale: bool = True, lam: float = 1e-6, implementation: str = "xla",
           interpret: bool = False):
  """Dispatches to the reference (``"xla"``) or the fused kernel (``"pallas"``)."""
  if implementation == "xla":
    return encode_reference(x_RD, group_size=group_size, fmt=fmt, hadamard=hadamard,
                            dual_scale=dual_scale, lam=lam)
  raise NotImplementedError(f"encode implementation {implementation!r}")
