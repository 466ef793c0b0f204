"""TACO decode and fused decode-and-sum: the inverse of ``encode``.

``x_hat = H_G(q * s) / sqrt(G) / alpha`` per group (H is symmetric and orthogonal after
the 1/sqrt(G)). ``decode_sum_reference`` decodes N stacked chunks and sums them in fp32:
the receive side of a compressed reduce-scatter.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.common import check_2d, hadamard_matrix


def _decode_f32(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool):
  rows, d = codes_RD.shape
  q_RKG = codes_RD.astype(jnp.float32).reshape(rows, d // group_size, group_size)
  y_RKG = q_RKG * scale_RK[..., None]
  if hadamard:
    h_GG = jnp.asarray(hadamard_matrix(group_size))
    y_RKG = jnp.dot(y_RKG, h_GG, precision=jax.lax.Precision.HIGHEST) * (group_size**-0.5)
  return (y_RKG / alpha_RK[..., None]).reshape(rows, d)


def decode_reference(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool = True,
                     out_dtype=jnp.bfloat16):
  """Decodes one encoded array back to ``out_dtype``."""
  check_2d(codes_RD, group_size, "decode_reference")
  return _decode_f32(codes_RD, alpha_RK, scale_RK, group_size=group_size,
                     hadamard=hadamard).astype(out_dtype)


def decode_sum_reference(codes_NRD, alpha_NRK, scale_NRK, *, group_size: int,
                         hadamard: bool = True, out_dtype=jnp.bfloat16):
  """Decodes N stacked encoded chunks and returns their fp32 sum cast to ``out_dtype``."""
  n = codes_NRD.shape[0]
  total = jnp.zeros(codes_NRD.shape[1:], jnp.float32)
  for i in range(n):
    total = total + _decode_f32(codes_NRD[i], alpha_NRK[i], scale_NRK[i],
                                group_size=group_size, hadamard=hadamard)
  return total.astype(out_dtype)


def decode(codes_RD, alpha_RK, scale_RK, *, group_size: int, hadamard: bool = True,
           out_dtype=jnp.bfloat16, implementation: str = "xla", interpret: bool = False):
  """Dispatches to the reference (``"xla"``) or the fused kernel (``"pallas"``)."""
  if implementation == "xla":
    return decode_reference(codes_RD, alpha_RK, scale_RK, group_size=group_size,
                            hadamard=hadamard, out_dtype=out_dtype)
  raise NotImplementedError(f"decode implementation {implementation!r}")


def decode_sum(codes_NRD, alpha_NRK, scale_NRK, *, group_size: int, hadamard: bool = True,
               out_dtype=jnp.bfloat16, implementation: str = "xla", interpret: bool = False):
  """Dispatches to the reference (``"xla"``) or the fused kernel (``"pallas"``)."""
  if implementation == "xla":
    return decode_sum_reference(codes_NRD, alpha_NRK, scale_NRK, group_size=group_size,
                                hadamard=hadamard, out_dtype=out_dtype)
  raise NotImplementedError(f"decode_sum implementation {implementation!r}")
