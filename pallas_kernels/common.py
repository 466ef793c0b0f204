"""Constants and small pieces shared by the encode and decode kernels and references."""
import functools

import jax.numpy as jnp
import numpy as np

FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

# Clip ranges of the two scales, as in the TACO authors' kernels.
ALPHA_MIN, ALPHA_MAX = 1e-3, 1e3
SCALE_MIN, SCALE_MAX = 1e-12, 1e6


@functools.cache
def hadamard_matrix(group_size: int) -> np.ndarray:
  """The Sylvester Hadamard matrix H_G (entries +-1, symmetric), float32."""
  if group_size < 1 or group_size & (group_size - 1):
    raise ValueError(f"Hadamard size must be a power of two, got {group_size}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < group_size:
    h = np.block([[h, h], [h, -h]])
  return h


def check_2d(x, group_size: int, what: str) -> None:
  if x.ndim != 2 or x.shape[1] % group_size:
    raise ValueError(
        f"{what} expects [rows, groups * {group_size}], got shape {x.shape}")
