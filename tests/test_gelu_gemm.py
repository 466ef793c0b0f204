"""The GELU GEMMs (`pallas_kernels.gelu_gemm`) in jax's Mosaic GPU interpret mode against
their references, their sm_90 lowering at the 1.3B shapes, their errors, and the MLP's
custom VJP (`models.gelu_mlp`) against autodiff of XLA's GELU."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax import testing
from taco_jax.models import gelu_mlp
from taco_jax.pallas_kernels import gelu_gemm, gemm

# small tiles the interpreter runs quickly: 2 x 3 tiles of [64, 128] over 2 SMs
TILING = gemm.Tiling(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32)


def _bf16(key, shape, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("approx_math", [False, True])
def test_gelu_gemms_are_their_references(approx_math):
  """Both kernels, on fresh inputs of ``[2, 64, 128]`` rows (leading dimensions kept), give
  their references' values to bf16 rounding (the bias's gradient, which the backward's
  epilogue sums from its fp32 product, to fp32 rounding), under the interpreter's race
  detector (the bias and h tiles loaded into shared memory as a tile starts, the product
  stored from where h was); with the GPU's fast tanh as well (the interpreter computes it
  exactly: what it checks is the epilogues' data flow)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
  kx, kw, kb, kg, kv = jax.random.split(jax.random.key(11), 5)
  x, w = _bf16(kx, (2, 64, 128)), _bf16(kw, (128, 384), 128 ** -0.5)
  b = 0.5 * jax.random.normal(kb, (384,), jnp.float32)
  g, w2 = _bf16(kg, (2, 64, 128)), _bf16(kv, (384, 128), 128 ** -0.5)
  kw = dict(num_sms=2, tiling=TILING, approx_math=approx_math)
  interpreter.reset_gpu_interpret_mode_state()
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
    h, a = gelu_gemm.matmul_bias_gelu(x, w, b, **kw)
    dh, db = gelu_gemm.matmul_gelu_grad(g, w2, h, **kw)
    _, db_xla = gelu_gemm.matmul_gelu_grad(g, w2, h, bias_grad=False, **kw)
  assert not interpreter.get_races().races_found
  want_h, want_a = gelu_gemm.matmul_bias_gelu_reference(x.reshape(128, 128), w, b)
  assert h.shape == a.shape == dh.shape == (2, 64, 384)
  _close(h.reshape(128, 384), want_h)
  _close(a.reshape(128, 384), want_a)
  want_dh, want_db = gelu_gemm.matmul_gelu_grad_reference(
      g.reshape(128, 128), w2, h.reshape(128, 384))
  _close(dh.reshape(128, 384), want_dh)
  # the bias's gradient: the epilogue's sums of the fp32 product, and XLA's sum of dh
  assert db.shape == db_xla.shape == (384,) and db.dtype == jnp.float32
  np.testing.assert_allclose(db, want_db, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(db_xla, want_db, rtol=2e-2, atol=5e-2)
  # the references are the math they name
  _close(want_a, jax.nn.gelu(want_h.astype(jnp.float32), approximate=True))
  _close(gelu_gemm.gelu_grad(want_h.astype(jnp.float32)),
         jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(
             want_h.astype(jnp.float32).ravel()).reshape(want_h.shape))


def test_gelu_gemms_lower_for_hopper_and_refuse_bad_input():
  """At the 1.3B model's MLP shapes (TP=1) both kernels lower for sm_90 (shared memory,
  layouts: what the interpreter does not check); shapes the tiles do not divide, a bias or
  an h of the wrong shape are clear errors."""
  pytest.importorskip("jax_cuda13_plugin", reason="jax-cuda13-plugin not installed")
  sd = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  x, w, b = sd((8, 2048, 2048), bf16), sd((2048, 8192), bf16), sd((8192,), jnp.float32)
  for fn, args in ((gelu_gemm.matmul_bias_gelu, (x, w, b)),
                   (gelu_gemm.matmul_gelu_grad, (x, sd((8192, 2048), bf16),
                                                 sd((8, 2048, 8192), bf16)))):
    text = testing.cuda_lowering(functools.partial(fn, num_sms=132, approx_math=True), *args)
    assert "mosaic_gpu" in text
  z = jnp.zeros
  with pytest.raises(ValueError, match="rows 100 is not a multiple of the tile 128"):
    gelu_gemm.matmul_bias_gelu(z((100, 128), bf16), z((128, 256), bf16), z((256,)), num_sms=2)
  with pytest.raises(ValueError, match="do not contract"):
    gelu_gemm.matmul_bias_gelu(z((128, 128), bf16), z((64, 256), bf16), z((256,)), num_sms=2)
  with pytest.raises(ValueError, match="bias"):
    gelu_gemm.matmul_bias_gelu(z((128, 128), bf16), z((128, 256), bf16), z((128,)), num_sms=2)
  with pytest.raises(ValueError, match="h "):
    gelu_gemm.matmul_gelu_grad(z((128, 128), bf16), z((256, 128), bf16), z((128, 128), bf16),
                               num_sms=2)
  assert "not a Hopper GPU" in gelu_mlp.kernel_problem((128, 128), (128, 256)) or (
      "no GPU" in gelu_mlp.kernel_problem((128, 128), (128, 256)))


def test_gelu_gemms_lower_once_however_many_layers_call_them():
  """The kernels run on the jitted GEMM core (``gemm.lowered_once``): three layers' calls of
  the same shapes put one copy of each kernel's Mosaic GPU module into the step's lowering,
  as one layer's do (unjitted, every call lowered its own: at the 350M's shapes 90 s of the
  trainer's compile against 24)."""
  pytest.importorskip("jax_cuda13_plugin", reason="jax-cuda13-plugin not installed")
  sd, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  kw = dict(num_sms=132, approx_math=True)

  def layers(count):
    def f(x, w, b, w2):
      outs = []
      for _ in range(count):
        h, a = gelu_gemm.matmul_bias_gelu(x, w, b, **kw)
        outs.append(gelu_gemm.matmul_gelu_grad(x, w2, h, **kw))
      return outs
    args = sd((256, 128), bf16), sd((128, 256), bf16), sd((256,), jnp.float32), sd(
        (256, 128), bf16)
    return testing.cuda_lowering(f, *args)
  one, three = layers(1), layers(3)
  assert one.count("mosaic_gpu") == three.count("mosaic_gpu") > 0
  assert len(three) < 1.1 * len(one)


def test_gelu_mlp_vjp_is_autodiff_of_xlas_gelu():
  """``gelu_mlp``'s custom VJP (the kernels' references on CPU) gives the value and the four
  gradients of ``gelu(x @ w_in + b) @ w_out`` by autodiff, in fp32 to rounding."""
  ks = jax.random.split(jax.random.key(12), 5)
  x = jax.random.normal(ks[0], (2, 8, 32))
  w_in, w_out = jax.random.normal(ks[1], (32, 64)) / 6, jax.random.normal(ks[2], (64, 32)) / 8
  b = 0.1 * jax.random.normal(ks[3], (64,))
  dy = jax.random.normal(ks[4], (2, 8, 32))
  xla = lambda *a: jax.nn.gelu(a[0] @ a[1] + a[2], approximate=True) @ a[3]  # noqa: E731
  fused = lambda *a: gelu_mlp.gelu_mlp(*a, gelu_mlp.LocalMatmuls(kernels=False))  # noqa: E731
  (y, vjp), (y_ref, vjp_ref) = (jax.vjp(f, x, w_in, b, w_out) for f in (fused, xla))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(vjp(dy), vjp_ref(dy), strict=True):
    assert g.dtype == r.dtype
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
