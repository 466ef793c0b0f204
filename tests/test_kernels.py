"""The fused Pallas codec kernels (interpret mode on CPU) against their jnp references.

Codes must be bit-exact (compared as uint8), scales within 1 ulp, decodes bit-exact; the
fused decode-and-sum within the fp32 reassociation bound below. Inputs are small (interpret
mode is slow) but exercise several grid steps, ragged last row blocks and all options.
"""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import pallas_kernels  # noqa: F401  (registers the modules below)

from taco_jax.pallas_kernels import wire
from taco_jax.testing import cuda_lowering

enc = sys.modules["taco_jax.pallas_kernels.encode"]
dec = sys.modules["taco_jax.pallas_kernels.decode"]

# Small tiles so that a few thousand elements still make several programs.
TILES = dict(block_rows=8, block_groups=2)

# (rows, D, G, dtype, fmt, hadamard, dual_scale, h_iota): rows not a multiple of the row
# block, D = 1..4 groups, both formats, both transforms, both scale modes, H loaded or built.
CASES = [
    (37, 256, 128, jnp.bfloat16, "e4m3", True, True, False),
    (20, 96, 32, jnp.float32, "e5m2", True, True, True),
    (5, 512, 256, jnp.float32, "e4m3", True, False, False),
    (33, 512, 128, jnp.bfloat16, "e5m2", False, True, False),
    (8, 256, 256, jnp.bfloat16, "e4m3", False, False, True),
    (19, 128, 32, jnp.float32, "e4m3", True, True, False),
]
IDS = [f"r{c[0]}-d{c[1]}-g{c[2]}-{jnp.dtype(c[3]).name}-{c[4]}-h{int(c[5])}-ds{int(c[6])}"
       f"-iota{int(c[7])}" for c in CASES]


def _activations(seed, rows, d, dtype):
  """Heavy-tailed values, per-row magnitudes spread over ~6 decades, an outlier column."""
  rng = np.random.default_rng(seed)
  x = rng.standard_t(2, size=(rows, d)) * np.exp(rng.normal(0.0, 3.0, size=(rows, 1)))
  x[:, rng.integers(d)] *= 100.0
  return jnp.asarray(x, dtype)


def _u8(codes):
  return np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8))


def assert_within_ulps(actual, expected, ulps: int, what: str):
  """fp32 arrays equal to ``ulps`` units in the last place (NaNs in the same places)."""
  a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=what)
  ok = ~np.isnan(e)
  dist = np.abs(a[ok].view(np.int32).astype(np.int64) - e[ok].view(np.int32).astype(np.int64))
  assert dist.max(initial=0) <= ulps, f"{what}: {dist.max()} ulps apart"


def fp32_reassociation_bound(terms_N):
  """Largest difference between two fp32 evaluations of ``sum_i a_i * b_i`` (N terms) that
  differ only in rounding order and in which products are FMA-contracted (XLA CPU contracts
  multiply-adds depending on fusion): each evaluation is within ``N * 2^-24 * sum|term|``
  of the exact sum (N roundings of at most 2^-24 relative), so two differ by twice that."""
  terms_N = np.abs(np.asarray(terms_N, np.float64))
  n = terms_N.shape[0]
  return 2 * n * 2.0**-24 * terms_N.sum(axis=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_encode_decode_kernels_match_reference(case):
  rows, d, g, dtype, fmt, hadamard, dual_scale, h_iota = case
  x = _activations(CASES.index(case), rows, d, dtype)
  opts = dict(group_size=g, fmt=fmt, hadamard=hadamard, dual_scale=dual_scale)
  codes, alpha, scale = enc.encode_pallas(x, interpret=True, h_iota=h_iota, **opts, **TILES)
  codes_r, alpha_r, scale_r = enc.encode_reference(x, **opts)
  np.testing.assert_array_equal(_u8(codes), _u8(codes_r))
  assert_within_ulps(alpha, alpha_r, 1, "alpha")
  assert_within_ulps(scale, scale_r, 1, "scale")

  out_dtype = jnp.float32 if dtype == jnp.bfloat16 else jnp.bfloat16
  out = dec.decode_pallas(codes_r, alpha_r, scale_r, group_size=g, hadamard=hadamard,
                          out_dtype=out_dtype, interpret=True, h_iota=h_iota, **TILES)
  out_r = dec.decode_reference(codes_r, alpha_r, scale_r, group_size=g, hadamard=hadamard,
                               out_dtype=out_dtype)
  assert out.dtype == out_dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_r, np.float32))


@pytest.mark.parametrize("n, case", [(2, CASES[0]), (3, CASES[1]), (4, CASES[3])],
                         ids=["n2-" + IDS[0], "n3-" + IDS[1], "n4-" + IDS[3]])
def test_decode_sum_kernel_matches_reference(n, case):
  rows, d, g, dtype, fmt, hadamard, dual_scale, h_iota = case
  encoded = [enc.encode_reference(_activations(100 + 10 * n + i, rows, d, dtype), group_size=g,
                                  fmt=fmt, hadamard=hadamard, dual_scale=dual_scale)
             for i in range(n)]
  codes, alpha, scale = (jnp.stack(parts) for parts in zip(*encoded))
  kw = dict(group_size=g, hadamard=hadamard, out_dtype=jnp.float32)
  out = dec.decode_sum_pallas(codes, alpha, scale, interpret=True, h_iota=h_iota, **kw, **TILES)
  out_r = dec.decode_sum_reference(codes, alpha, scale, **kw)
  terms = np.stack([dec.decode_reference(*e, **kw) for e in encoded])
  err = np.abs(np.asarray(out, np.float64) - np.asarray(out_r, np.float64))
  assert (err <= fp32_reassociation_bound(terms)).all(), err.max()


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]],
                         ids=[IDS[0], IDS[1], IDS[3]])
def test_wire_kernels_match_reference(case):
  """The packed encode writes ``wire.pack`` of the reference's outputs (codes bit-exact,
  scales within 1 ulp); the wire decode kernels return what the reference decodes from the
  unpacked rows (decode bit-exact, decode-and-sum within the reassociation bound)."""
  rows, d, g, dtype, fmt, hadamard, dual_scale, h_iota = case
  x = _activations(50 + CASES.index(case), rows, d, dtype)
  opts = dict(group_size=g, fmt=fmt, hadamard=hadamard, dual_scale=dual_scale)
  w = enc.encode_pallas(x, interpret=True, h_iota=h_iota, packed=True, **opts, **TILES)
  assert w.dtype == jnp.uint8 and w.shape == (rows, wire.width(d, g))
  codes, alpha, scale = wire.unpack(w, group_size=g, fmt=fmt)
  codes_r, alpha_r, scale_r = enc.encode_reference(x, **opts)
  np.testing.assert_array_equal(_u8(codes), _u8(codes_r))
  assert_within_ulps(alpha, alpha_r, 1, "alpha")
  assert_within_ulps(scale, scale_r, 1, "scale")

  kw = dict(group_size=g, hadamard=hadamard, out_dtype=jnp.float32)
  out = dec.decode_wire(w, fmt=fmt, implementation="pallas", interpret=True, h_iota=h_iota,
                        **kw, **TILES)
  np.testing.assert_array_equal(np.asarray(out), dec.decode_reference(codes, alpha, scale, **kw))

  w_N = jnp.stack([w, enc.encode(-3.0 * x, packed=True, **opts)])
  out = dec.decode_sum_wire(w_N, fmt=fmt, implementation="pallas", interpret=True, **kw,
                            **TILES)
  parts = [wire.unpack(w_i, group_size=g, fmt=fmt) for w_i in w_N]
  out_r = dec.decode_sum_wire(w_N, fmt=fmt, **kw)
  terms = np.stack([dec.decode_reference(*p, **kw) for p in parts])
  err = np.abs(np.asarray(out, np.float64) - np.asarray(out_r, np.float64))
  assert (err <= fp32_reassociation_bound(terms)).all(), err.max()


def test_wire_pack_unpack_and_unsent_rows():
  """unpack(pack(.)) is the identity on every bit (NaN, -0, subnormal scales included),
  all-zero wire rows (a message never sent) decode to zeros, and a width that is not
  D + 8 D / G is a clear error."""
  rng = np.random.default_rng(3)
  codes = jnp.asarray(rng.integers(0, 256, (5, 64), np.uint8)).view(jnp.float8_e4m3fn)
  special = np.array([np.nan, -0.0, 1e-45, -np.inf, 3.0e38], np.float32)
  alpha = jnp.asarray(np.resize(special, (5, 2)))
  scale = jnp.asarray(rng.normal(size=(5, 2)).astype(np.float32))
  back = wire.unpack(wire.pack(codes, alpha, scale), group_size=32, fmt="e4m3")
  for a, b in zip(back, (codes, alpha, scale)):
    np.testing.assert_array_equal(_u8(a), _u8(b))  # every byte
  zeros = jnp.zeros((3, wire.width(256, 128)), jnp.uint8)
  for impl in ("xla", "pallas"):
    out = dec.decode_wire(zeros, group_size=128, implementation=impl, interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  for impl in ("xla", "pallas"):
    with pytest.raises(ValueError, match="whole groups"):
      dec.decode_wire(jnp.zeros((3, 260), jnp.uint8), group_size=128, implementation=impl,
                      interpret=True)
  with pytest.raises(TypeError, match="uint8"):
    dec.decode_wire(jnp.zeros((3, 264), jnp.float32), group_size=128)


def _special_groups(dtype):
  """One row per kind of awkward group, G = 32: zeros, constant, denormal range, huge,
  mixed-sign huge, one spike, NaN, +Inf, -Inf (with finite neighbours)."""
  g = 32
  rng = np.random.default_rng(7)
  tiny = 1e-30 * np.logspace(0, -10, g)  # 1e-30 .. 1e-40 (fp32 subnormal below ~1.2e-38)
  huge = float(jnp.finfo(jnp.bfloat16).max)
  rows = [np.zeros(g), np.full(g, -3.25), tiny, np.full(g, huge),
          huge * np.sign(rng.normal(size=g)), np.eye(1, g, 5)[0] * 1e4,
          rng.normal(size=g), rng.normal(size=g), rng.normal(size=g)]
  x = np.stack(rows)
  x[6, 3], x[7, 0], x[8, 31] = np.nan, np.inf, -np.inf
  return jnp.asarray(x, dtype), [6, 7, 8]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_special_groups_kernel_and_reference(dtype):
  """Non-finite groups decode to non-finite values (never zeros or plausible numbers);
  zero, constant, denormal and huge groups round-trip without NaN; kernel == reference."""
  x, bad_rows = _special_groups(dtype)
  opts = dict(group_size=32, fmt="e4m3", hadamard=True, dual_scale=True)
  codes, alpha, scale = enc.encode_pallas(x, interpret=True, **opts, **TILES)
  codes_r, alpha_r, scale_r = enc.encode_reference(x, **opts)
  np.testing.assert_array_equal(_u8(codes), _u8(codes_r))
  assert_within_ulps(alpha, alpha_r, 1, "alpha")
  assert_within_ulps(scale, scale_r, 1, "scale")
  out = np.asarray(dec.decode_pallas(codes, alpha, scale, group_size=32, interpret=True,
                                     out_dtype=jnp.float32, **TILES))
  out_r = np.asarray(dec.decode_reference(codes_r, alpha_r, scale_r, group_size=32,
                                          out_dtype=jnp.float32))
  np.testing.assert_array_equal(out, out_r)
  good_rows = [r for r in range(x.shape[0]) if r not in bad_rows]
  assert np.isfinite(out[good_rows]).all()
  assert not np.isfinite(out[bad_rows]).any()
  np.testing.assert_array_equal(out[0], 0.0)
  assert np.abs(out[2]).max() <= 1e-29  # denormal range: flushed or kept, never amplified
  x32 = np.asarray(x, np.float32)
  np.testing.assert_allclose(out[1], x32[1], rtol=2.0**-4)  # constant: one big code
  assert (np.sign(out[3]) == 1).all()  # huge: saturates (docs/codec.md), stays finite


def test_kernels_lower_to_triton(monkeypatch):
  """The kernels lower to Triton IR for an H100 (no GPU needed): catches primitives the
  Triton backend does not support and non-power-of-two tiles before the GPU run does."""
  from jax._src.pallas.triton import gpu_info, pallas_call_registration
  h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100)
  sds = jax.ShapeDtypeStruct
  for rows, d, g, dtype, h_iota in [(1000, 1024, 128, jnp.bfloat16, False),
                                    (3, 512, 256, jnp.float32, True)]:
    k = d // g
    for fmt in ("e4m3", "e5m2"):
      cuda_lowering(functools.partial(enc.encode_pallas, group_size=g, fmt=fmt, h_iota=h_iota),
                    sds((rows, d), dtype))
    fp8 = jnp.float8_e4m3fn
    cuda_lowering(functools.partial(dec.decode_pallas, group_size=g, h_iota=h_iota),
                  sds((rows, d), fp8), sds((rows, k), jnp.float32), sds((rows, k), jnp.float32))
    cuda_lowering(functools.partial(dec.decode_sum_pallas, group_size=g, hadamard=not h_iota),
                  sds((3, rows, d), fp8), sds((3, rows, k), jnp.float32),
                  sds((3, rows, k), jnp.float32))
    # The wire format: packed encode, decode and decode-and-sum of wire rows.
    cuda_lowering(functools.partial(enc.encode_pallas, group_size=g, h_iota=h_iota, packed=True),
                  sds((rows, d), dtype))
    w = wire.width(d, g)
    for fn, shape in ((dec.decode_wire, (rows, w)), (dec.decode_sum_wire, (3, rows, w))):
      cuda_lowering(functools.partial(fn, group_size=g, h_iota=h_iota, implementation="pallas"),
                    sds(shape, jnp.uint8))


def test_kernel_rejects_bad_shapes_and_dtypes():
  with pytest.raises(ValueError, match="expects"):
    enc.encode_pallas(jnp.zeros((4, 100)), group_size=32, interpret=True)
  with pytest.raises(TypeError, match="floating"):
    enc.encode_pallas(jnp.zeros((4, 64), jnp.int32), group_size=32, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    enc.encode_pallas(jnp.zeros((4, 64)), group_size=32, interpret=True, block_rows=6)
