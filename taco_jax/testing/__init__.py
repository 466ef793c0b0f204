"""Test helpers: error bounds of the FP8 codec derived from the format, never tuned by hand.

Derivation (one group of G elements, codes in a format with m mantissa bits and max M):

* Encode: ``y = H(alpha x)/sqrt(G)``, ``s = max|y|/M``, ``q = fp8(y/s)``. Rounding to the
  nearest fp8 value costs a relative error <= u = 2^-(m+1) for normal values (e4m3: 2^-4,
  e5m2: 2^-3) plus an absolute error <= d (half the subnormal spacing: e4m3 2^-10, e5m2
  2^-17) near zero. So ``|q_i s - y_i| <= u |y_i| + s d``.
* Decode applies the orthogonal ``H/sqrt(G)`` and divides by alpha, so in the L2 norm of
  the group ``||x_hat - x|| <= u ||x|| + sqrt(G) s d / alpha`` and, as ``s/alpha <=
  ||x||/M``, ``||x_hat - x|| <= (u + sqrt(G) d / M) ||x||``. Without the transform the same
  holds element by element: ``|x_hat_i - x_i| <= u |x_i| + d max|x|/M``.
* With the transform each element's error is at most the group's L2 error (not tight, but
  rigorous). The transforms' arithmetic adds ~2^-17 + G^1.5 2^-24 relative (``_f32_slack``);
  the final cast to the output dtype adds its unit roundoff times |value|.

Sums of N decoded chunks (reduce-scatter, all-reduce) add the bounds of the N terms plus
the fp32 summation error; a two-shot all-reduce re-encodes the sum once more.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from taco_jax.codec import CompressionConfig
from taco_jax.testing import hlo

_MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
_MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def unit_roundoff(dtype) -> float:
  """Largest relative rounding error of a cast to ``dtype`` (half an ulp at 1)."""
  return float(jnp.finfo(dtype).eps) / 2


def _f32_slack(group_size: int) -> float:
  # fp32 inputs enter the transform as two bf16 terms (relative error <= 2^-17, see
  # pallas_kernels.hadamard_dot); encode and decode each run a G-term fp32 sum per element
  # (error <= G u sum|x_i| <= G^1.5 u ||x||, u = 2^-24) plus a few scalings.
  return 2.0**-17 + 4 * (group_size**1.5 + 4) * 2.0**-24


def fp8_roundtrip_bound(x, cfg: CompressionConfig, out_dtype=jnp.float32) -> np.ndarray:
  """Per-element bound on ``|decompress(compress(x, cfg), cfg, out_dtype) - x|``.

  ``x``: the array exactly as handed to ``compress`` (groups along its last axis, the last
  one zero-padded). Returns a float64 array of x's shape.
  """
  x = np.abs(np.asarray(x, np.float64))
  g = cfg.group_size
  size = x.shape[-1]
  padded = -(-size // g) * g
  xg = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - size)])
  xg = xg.reshape(*x.shape[:-1], padded // g, g)
  u = 2.0 ** -(_MANTISSA_BITS[cfg.format] + 1)
  d = _MIN_SUBNORMAL[cfg.format] / 2
  fmax = _FP8_MAX[cfg.format]
  norm = np.sqrt(np.sum(xg * xg, axis=-1, keepdims=True))
  amax = np.max(xg, axis=-1, keepdims=True)
  if cfg.hadamard:
    bound = (u + np.sqrt(g) * d / fmax + _f32_slack(g)) * norm * np.ones_like(xg)
  else:
    bound = u * xg + (d / fmax + _f32_slack(g)) * amax
  bound = bound.reshape(*x.shape[:-1], padded)[..., :size]
  return bound + unit_roundoff(out_dtype) * (x + bound)


def fp8_sum_bound(xs, cfg: CompressionConfig, out_dtype=jnp.float32, *,
                  recompress: bool = False) -> np.ndarray:
  """Bound on the error of ``sum_i x_i`` when each x_i (stacked on axis 0 of ``xs``) is
  sent compressed, decoded in fp32 and summed in fp32 (reduce-scatter, one-shot all-reduce).

  ``recompress=True``: the fp32 sum is encoded once more and decoded to ``out_dtype`` (the
  all-gather half of a two-shot all-reduce; same grouping as the x_i).
  """
  xs = np.asarray(xs, np.float64)
  n = xs.shape[0]
  err = sum(fp8_roundtrip_bound(xs[i], cfg, jnp.float32) for i in range(n))
  err = err + n * 2.0**-24 * np.sum(np.abs(xs), axis=0)  # fp32 summation
  total = np.abs(np.sum(xs, axis=0))
  if recompress:
    err = err + fp8_roundtrip_bound(total + err, cfg, jnp.float32)
  return err + unit_roundoff(out_dtype) * (total + err)


def assert_within(actual, expected, bound, what: str = "") -> None:
  """Asserts ``|actual - expected| <= bound`` element by element, with a useful message."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  err = np.abs(actual - expected)
  bad = ~(err <= bound)
  if bad.any():
    i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
    raise AssertionError(
        f"{what}: {bad.sum()} of {err.size} elements exceed the FP8 bound; worst at {i}: "
        f"actual {actual[i]}, expected {expected[i]}, error {err[i]}, bound {bound[i]}")


# --- HLO inspection ------------------------------------------------------------------------

def hlo_collectives(hlo_text: str) -> list[dict]:
  """The collective instructions of an HLO module's text (lowered or compiled), one dict
  each: ``op`` (e.g. "all-gather"), ``dtypes`` (set of result element types) and ``bytes``
  (the result's size; a tuple result, as CPU all-to-alls have, is summed). A view of
  ``taco_jax.testing.hlo.collectives``, which parses them."""
  ops = {}
  for c in hlo.collectives(hlo_text):
    op = ops.setdefault(c.line, dict(op=c.kind, dtypes=set(), bytes=0))
    op["dtypes"].add(c.dtype)
    op["bytes"] += c.bytes
  return list(ops.values())


def cuda_lowering(f, *args) -> str:
  """``jit(f)``'s module lowered for CUDA, as text: its Mosaic GPU kernels through their
  sm_90 lowering (layouts, shared memory) and its Triton calls, on a machine without a GPU
  (Mosaic GPU's bindings come with jax-cuda13-plugin, which `make install` adds)."""
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@functools.cache
def mesh_1d(n: int):
  """A 1-D mesh ("x",) over the first n devices."""
  return jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


@functools.cache
def mesh_3d():
  """The (2, 2, 2) ("data", "pipeline", "tensor") mesh of the 8 test devices."""
  return jax.make_mesh((2, 2, 2), ("data", "pipeline", "tensor"),
                       axis_types=(AxisType.Auto,) * 3)
