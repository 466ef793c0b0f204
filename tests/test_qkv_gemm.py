"""The split QKV GEMM (`pallas_kernels.qkv_gemm`) in jax's Mosaic GPU interpret mode
against its reference and XLA's slices, its sm_90 lowering at the 1.3B shapes, and its
errors. In the all-gather kernels: `tests/test_collective_matmul.py`; in the model:
`tests/test_parallel_step.py`'s fused blocks."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax import testing
from taco_jax.pallas_kernels import gemm, qkv_gemm

# small tiles the interpreter runs quickly: 2 x 3 CTA tiles of [128, 64] over 2 SMs, each
# epilogue sub-tile of 32 columns inside a head's part of 32
TILING = gemm.Tiling(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32, split="m")


def test_split_qkv_gemm_is_its_reference_and_xlas_slices():
  """On fresh inputs of ``[2, 128]`` rows and 2 heads of 32 (q, k, v: 192 columns, so
  that tiles start inside a head and parts of two heads share one), each of q, k, v is
  the reference's to bf16 rounding, under the interpreter's race detector (the bias loaded
  into shared memory as a tile starts, each sub-tile's store to its part); the reference is
  XLA's bias and slices of the fp32 product. Its base, `gemm.AddBias`, alone stores
  acc + b."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
  kx, kw, kb = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(kx, (2, 128, 128), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (128, 192), jnp.float32) / 128 ** 0.5).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (192,), jnp.float32)
  interpreter.reset_gpu_interpret_mode_state()
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
    got = qkv_gemm.matmul_bias_split(x, w, b, head_dim=32, num_sms=2, tiling=TILING)
    biased, = gemm.matmul_epilogue(x, w, gemm.AddBias(b), num_sms=2, tiling=TILING)
  assert not interpreter.get_races().races_found
  # its base on its own: the plain store of acc + b
  np.testing.assert_allclose(np.asarray(biased, np.float32), np.asarray(
      gemm.AddBias(b).reference(jnp.dot(x, w, preferred_element_type=jnp.float32),
                                jnp.bfloat16)[0], np.float32), rtol=2e-2, atol=2e-2)
  want = qkv_gemm.matmul_bias_split_reference(x, w, b, head_dim=32)
  y = (jnp.dot(x, w, preferred_element_type=jnp.float32) + b).astype(jnp.bfloat16)
  y = y.reshape(2, 128, 2, 3, 32)
  for p, (g, r) in enumerate(zip(got, want)):
    assert g.shape == r.shape == (2, 128, 64) and g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(r, y[:, :, :, p].reshape(2, 128, 64))


def test_split_qkv_gemm_lowers_for_hopper_and_refuses_bad_input():
  """At the 1.3B QKV's shapes (TP=1, heads of 128) the kernel lowers for sm_90; heads its
  sub-tiles straddle, widths that are not whole heads, a bias of the wrong width and
  operands that do not contract are clear errors."""
  pytest.importorskip("jax_cuda13_plugin", reason="jax-cuda13-plugin not installed")
  sd = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  x, w, b = sd((8, 2048, 2048), bf16), sd((2048, 6144), bf16), sd((6144,), jnp.float32)
  text = testing.cuda_lowering(
      functools.partial(qkv_gemm.matmul_bias_split, head_dim=128, num_sms=132), x, w, b)
  assert "mosaic_gpu" in text
  z = jnp.zeros
  kw = dict(num_sms=2, tiling=TILING)
  x, w = z((128, 128), bf16), z((128, 192), bf16)
  for call, match in (
      (lambda: qkv_gemm.matmul_bias_split(x, w, z(192), head_dim=16, **kw),
       "sub-tiles of 32 columns straddle heads of 16"),
      (lambda: qkv_gemm.matmul_bias_split(x, w, z(192), head_dim=128, **kw),
       "192 columns are not whole heads of 3 x 128"),
      (lambda: qkv_gemm.matmul_bias_split(x, w, z(96), head_dim=32, **kw),
       r"bias \(96,\) is not \(192,\)"),
      (lambda: qkv_gemm.matmul_bias_split(z((128, 64), bf16), w, z(192), head_dim=32, **kw),
       "do not contract")):
    with pytest.raises(ValueError, match=match):
      call()
