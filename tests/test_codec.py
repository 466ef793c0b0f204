"""The codec API (``compress``/``decompress``/``decompress_sum``): error bounds derived from
the FP8 format (``taco_jax.testing``), padding, NaN/Inf, saturation, jit, config errors.

Most cases use the jnp reference (fast on CPU); a few go through the Pallas kernels in
interpret mode, which must give the same bits (tests/test_kernels.py checks that in depth).
"""
import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import codec
from taco_jax.codec import CompressionConfig, compress, decompress, decompress_sum
from taco_jax.testing import assert_within, fp8_roundtrip_bound, fp8_sum_bound


def _dist(name: str, shape, seed: int):
  rng = np.random.default_rng(seed)
  if name == "gaussian":
    x = rng.normal(size=shape)
  elif name == "student_t2":
    x = rng.standard_t(2, size=shape)
  elif name == "outlier_channels":  # a few hidden channels 100x larger, as in LLM activations
    x = rng.normal(size=shape)
    x[..., rng.choice(shape[-1], 3, replace=False)] *= 100.0
  elif name == "dense_near_zero":  # most values ~1e-4, a sparse few O(1)
    x = rng.normal(size=shape) * 1e-4
    few = rng.random(shape) < 0.01
    x[few] = rng.normal(size=int(few.sum()))
  elif name == "zeros":
    x = np.zeros(shape)
  else:
    raise ValueError(name)
  return x


DISTS = ["gaussian", "student_t2", "outlier_channels", "dense_near_zero", "zeros"]
CONFIGS = {
    "taco_g128": CompressionConfig(hadamard=True),
    "absmax_g128_dual": CompressionConfig(),
    "taco_g32_e5m2": CompressionConfig(format="e5m2", group_size=32),
    "absmax_g256": CompressionConfig(group_size=256, hadamard=False, dual_scale=False),
    "hadamard_nodual_g64": CompressionConfig(group_size=64, hadamard=True, dual_scale=False),
}


@functools.cache
def _jitted_roundtrip(cfg: CompressionConfig):
  # Two jits, so the codes are materialized between them (XLA may not skip the rounding).
  enc = jax.jit(lambda x: compress(x, cfg))
  dec = jax.jit(lambda c: decompress(c, cfg, jnp.float32))
  return lambda x: dec(enc(x))


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("dist", DISTS)
def test_roundtrip_within_format_bound(dist, cfg_name):
  cfg = dataclasses.replace(CONFIGS[cfg_name], implementation="xla")
  seed = DISTS.index(dist) * 10 + list(CONFIGS).index(cfg_name)
  x = jnp.asarray(_dist(dist, (6, 4, 512), seed), jnp.float32)
  out = _jitted_roundtrip(cfg)(x)
  assert out.shape == x.shape and out.dtype == jnp.float32
  assert_within(out, x, fp8_roundtrip_bound(x, cfg, jnp.float32), f"{dist}/{cfg_name}")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_odd_last_dim_is_padded_and_cut(implementation):
  cfg = CompressionConfig(group_size=128, implementation=implementation)
  x = jnp.asarray(_dist("student_t2", (3, 5, 300), 11), jnp.bfloat16)
  c = compress(x, cfg)
  assert c.codes.shape == (3, 5, 384) and c.alpha.shape == (3, 5, 3) and c.size == 300
  assert c.codes.dtype == jnp.float8_e4m3fn and c.scale.dtype == jnp.float32
  out = decompress(c, cfg, jnp.float32)
  assert out.shape == x.shape
  assert_within(out, x, fp8_roundtrip_bound(x, cfg, jnp.float32), "odd last dim")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_wire_rows_decode_like_compressed(implementation):
  """to_wire / from_wire / sum_from_wire (one buffer per message, what collectives send)
  give the bits of compress / decompress / decompress_sum, odd last dims included."""
  cfg = CompressionConfig(group_size=128, implementation=implementation)
  x = jnp.asarray(_dist("student_t2", (2, 3, 300), 12), jnp.bfloat16)
  w = codec.to_wire(x, cfg)
  assert w.dtype == jnp.uint8 and w.shape == (2, 3, 384 + 8 * 3)
  c = compress(x, cfg)
  np.testing.assert_array_equal(codec.from_wire(w, cfg, 300, jnp.float32),
                                decompress(c, cfg, jnp.float32))
  np.testing.assert_array_equal(codec.sum_from_wire(w, cfg, 300, jnp.float32),
                                decompress_sum(c, cfg, jnp.float32))


def test_pallas_and_xla_codecs_agree_bitwise():
  x = jnp.asarray(_dist("outlier_channels", (2, 9, 256), 12), jnp.bfloat16)
  cx, cp = (CompressionConfig(group_size=64, implementation=i) for i in ("xla", "pallas"))
  a, b = compress(x, cx), compress(x, cp)
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(a.codes, jnp.uint8)),
                                np.asarray(jax.lax.bitcast_convert_type(b.codes, jnp.uint8)))
  np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
  np.testing.assert_array_equal(np.asarray(decompress(a, cx)), np.asarray(decompress(b, cp)))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_decompress_sum_is_sum_of_decompresses(implementation):
  cfg = CompressionConfig(group_size=32, implementation=implementation)
  xs = jnp.asarray(_dist("gaussian", (4, 6, 200), 13), jnp.float32)  # 4 chunks
  c = compress(xs, cfg)
  total = decompress_sum(c, cfg, jnp.float32)
  assert total.shape == xs.shape[1:]
  parts = np.stack([np.asarray(decompress(jax.tree.map(lambda a, i=i: a[i], c), cfg,
                                          jnp.float32)) for i in range(4)], dtype=np.float64)
  # fp32 sums of the same 4 terms in possibly different rounding order (FMA contraction).
  slack = 2 * 4 * 2.0**-24 * np.abs(parts).sum(axis=0)
  assert_within(total, parts.sum(axis=0), slack, "decompress_sum vs sum of decompress")
  assert_within(total, np.asarray(xs).sum(axis=0), fp8_sum_bound(xs, cfg), "vs exact sum")


def test_codec_under_jit():
  cfg = CompressionConfig(format="e5m2", group_size=64, implementation="xla")
  x = jnp.asarray(_dist("student_t2", (8, 192), 14), jnp.bfloat16)

  @jax.jit
  def roundtrip(x):
    return decompress(compress(x, cfg), cfg, jnp.float32)

  out = roundtrip(x)
  assert_within(out, x, fp8_roundtrip_bound(x, cfg, jnp.float32), "jit")
  # Codes are a real output of compress, so jit cannot delete the fp8 rounding.
  eager = decompress(compress(x, cfg), cfg, jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(eager))
  assert float(jnp.max(jnp.abs(out - x.astype(jnp.float32)))) > 0


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("shape", [(4, 0), (0, 128), (2, 0, 3), (0,)])
def test_empty_arrays_encode_and_decode_to_empty(shape, implementation):
  """An empty shard (no rows, or an empty last dimension) has nothing to encode: empty codes
  and scales of the shapes the rules give, and empty results of x's shape."""
  cfg = CompressionConfig(group_size=32, implementation=implementation)
  x = jnp.ones(shape, jnp.bfloat16)
  padded = -(-shape[-1] // 32) * 32
  c = compress(x, cfg)
  assert c.codes.shape == (*shape[:-1], padded) and c.codes.dtype == cfg.fp8_dtype
  assert c.alpha.shape == c.scale.shape == (*shape[:-1], padded // 32)
  assert decompress(c, cfg, jnp.float32).shape == shape
  w = codec.to_wire(x, cfg)
  assert w.shape == (*shape[:-1], padded + 8 * padded // 32) and w.dtype == jnp.uint8
  assert codec.from_wire(w, cfg, shape[-1], jnp.float32).shape == shape
  if len(shape) > 1 and shape[0]:  # the sums take N >= 1 messages on axis 0
    assert decompress_sum(c, cfg, jnp.float32).shape == shape[1:]
    assert codec.sum_from_wire(w, cfg, shape[-1], jnp.float32).shape == shape[1:]
  else:
    with pytest.raises(ValueError, match="N >= 1 messages stacked on axis 0"):
      decompress_sum(c, cfg)
    with pytest.raises(ValueError, match="N >= 1 messages stacked on axis 0"):
      codec.sum_from_wire(w, cfg, shape[-1])


def test_compressed_records_its_encoding():
  """The codes carry the settings they were encoded with (static pytree metadata, kept by
  jit and tree maps); a config that would decode them differently is refused by name,
  one that differs only in how the scales were chosen decodes the same bits."""
  enc = CompressionConfig(group_size=64, implementation="xla")
  x = jnp.asarray(_dist("gaussian", (3, 2, 192), 16), jnp.float32)
  c = jax.jit(lambda x: compress(x, enc))(x)
  assert (c.size, c.format, c.group_size, c.hadamard, c.dual_scale, c.lam) == (
      192, "e4m3", 64, False, True, 1e-6)
  out = decompress(c, enc, jnp.float32)
  other = dataclasses.replace(enc, dual_scale=False, lam=0.5, implementation="pallas")
  np.testing.assert_array_equal(decompress(c, other, jnp.float32), out)
  for change, needle in ((dict(hadamard=True), "hadamard=False, but the config given "
                                                "decodes with hadamard=True"),
                         (dict(group_size=128), "group_size=64, but the config given decodes "
                                                "with group_size=128"),
                         (dict(format="e5m2"), "format='e4m3', but the config given decodes "
                                               "with format='e5m2'")):
    bad = dataclasses.replace(enc, **change)
    with pytest.raises(ValueError, match=f"decompress: the codes were encoded with {needle}"):
      decompress(c, bad)
    with pytest.raises(ValueError, match=f"decompress_sum: the codes were encoded with "
                                         f"{needle}"):
      decompress_sum(c, bad)
  with pytest.raises(ValueError, match=r"decompress: codes float8_e4m3fn\[3, 2, 192\], alpha "
                                       r"\[3, 2, 2\] and scale \[3, 2, 3\] of size 192 are not "
                                       r"e4m3 codes of groups of 64"):
    decompress(dataclasses.replace(c, alpha=c.alpha[..., :2]), enc)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_group_decodes_nonfinite(bad):
  cfg = CompressionConfig(group_size=32, implementation="xla")
  x = np.asarray(_dist("gaussian", (2, 96), 15), np.float32)
  x[1, 40] = bad  # group 1 of row 1
  out = np.asarray(decompress(compress(jnp.asarray(x), cfg), cfg, jnp.float32))
  assert not np.isfinite(out[1, 32:64]).any()
  assert np.isfinite(out[0]).all() and np.isfinite(out[1, :32]).all()
  assert np.isfinite(out[1, 64:]).all()


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("fmt, fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_saturation_threshold(fmt, fmax, hadamard):
  """With alpha at its floor (1e-3) and s at its ceiling (1e6), the largest representable
  transformed value is fmax * 1e6 / 1e-3: a group saturates iff max|H x| / sqrt(G) exceeds
  it (docs/codec.md; without Hadamard: max|x|). A constant group c has
  H x / sqrt(G) = (sqrt(G) c, 0, ...)."""
  g = 128
  # the largest constant that still round-trips
  limit = fmax * 1e6 / 1e-3 / (np.sqrt(g) if hadamard else 1.0)
  cfg = CompressionConfig(format=fmt, group_size=g, hadamard=hadamard, implementation="xla")
  x = jnp.asarray(np.array([[0.5 * limit] * g, [4.0 * limit] * g, [3.39e38] * g]), jnp.float32)
  out = np.asarray(decompress(compress(x, cfg), cfg, jnp.float32))
  assert np.isfinite(out).all()
  assert_within(out[0], x[0], fp8_roundtrip_bound(x[:1], cfg)[0], "below the limit")
  np.testing.assert_allclose(out[1:], limit, rtol=2e-3)  # clipped to the limit, not NaN


def test_config_and_input_errors():
  for g in (48, 16, 1024, 100):
    with pytest.raises(ValueError, match="power of two"):
      CompressionConfig(group_size=g)
  with pytest.raises(ValueError, match="format"):
    CompressionConfig(format="e3m4")
  with pytest.raises(TypeError, match="floating"):
    compress(jnp.ones((4, 128), jnp.int32), CompressionConfig())
  with pytest.raises(ValueError, match="implementation"):
    CompressionConfig(implementation="triton")


def test_bits_per_element_and_auto_dispatch():
  assert CompressionConfig(group_size=128).bits_per_element == 8.5
  cfg = CompressionConfig()
  on_gpu = jax.default_backend() == "gpu"
  assert cfg.resolved_implementation() == ("pallas" if on_gpu else "xla")
  hadamard = CompressionConfig(hadamard=True)
  for n in (2, 4, 8):  # decode-and-sum: XLA's fusion measured faster from N = 4 without H
    assert cfg.resolved_implementation(sum_of=n) == ("pallas" if on_gpu and n < 4 else "xla")
    assert hadamard.resolved_implementation(sum_of=n) == ("pallas" if on_gpu else "xla")
  with mock.patch.object(jax, "default_backend", lambda: "gpu"):
    assert [cfg.resolved_implementation(sum_of=n) for n in (0, 2, 4)] == ["pallas", "pallas",
                                                                         "xla"]
    assert hadamard.resolved_implementation(sum_of=8) == "pallas"
  assert codec.CompressionConfig(implementation="pallas").kernel_kwargs()["interpret"] == (
      jax.default_backend() != "gpu")


@pytest.mark.slow
def test_bench_codec_smoke(tmp_path):
  """The benchmark runs end to end on CPU (interpret mode) and writes its JSON (~40 s)."""
  import json

  from benchmarks import bench_codec
  path = bench_codec.main(["--smoke", "--out-dir", str(tmp_path)])
  result = json.load(open(path))
  assert {"environment", "config", "copy", "matmul", "sweep", "bandwidth",
          "fidelity"} <= set(result)
  assert all(r["check"] for r in result["bandwidth"])
