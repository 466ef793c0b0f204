"""The Pallas kernels lower to Triton for an H100/H200 (sm_90) without a GPU present.

Lowering runs jax's Pallas->Triton translation, which rejects ops Triton cannot express;
it catches most GPU-only failures here, in CI. (PTX compilation still needs a GPU.)
"""
import functools
import types

import jax
import jax.numpy as jnp
import pytest

from taco_jax import pallas_kernels, testing
from taco_jax.pallas_kernels.decode import decode_pallas, decode_sum_pallas
from taco_jax.pallas_kernels.encode import encode_pallas
from jax._src.pallas.triton import pallas_call_registration

HOPPER = types.SimpleNamespace(compute_capability=90)


@pytest.fixture(autouse=True)
def pretend_hopper(monkeypatch):
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: HOPPER)


def triton_calls(fn, *args) -> int:
  """Lowers ``fn`` for CUDA and counts the Triton kernels in the module."""
  hlo = testing.cuda_lowering(fn, *args)
  return hlo.count("@__gpu$xla.gpu.triton")


def encoded_shapes(shape, dtype, **kw):
  x = jax.ShapeDtypeStruct(shape, dtype)
  return x, jax.eval_shape(functools.partial(pallas_kernels.encode_reference, **kw), x)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("group_size", [32, 128, 512])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_encode_and_decode_lower_to_triton(fmt, group_size, dtype):
  kw = dict(group_size=group_size, fmt=fmt)
  x, (codes, alpha, scale) = encoded_shapes((1000, 4 * group_size), dtype, **kw)
  encode = functools.partial(encode_pallas, **kw)
  decode = functools.partial(decode_pallas, group_size=group_size,
                             out_dtype=dtype)
  assert triton_calls(encode, x) == 1
  assert triton_calls(decode, codes, alpha, scale) == 1


@pytest.mark.parametrize("hadamard,dual_scale", [(False, False), (False, True), (True, False)])
def test_codec_variants_lower_to_triton(hadamard, dual_scale):
  kw = dict(group_size=128, hadamard=hadamard)
  x, (codes, alpha, scale) = encoded_shapes((64, 512), jnp.bfloat16, dual_scale=dual_scale, **kw)
  assert triton_calls(functools.partial(encode_pallas, dual_scale=dual_scale,
                                        **kw), x) == 1
  assert triton_calls(functools.partial(decode_pallas, **kw),
                      codes, alpha, scale) == 1


@pytest.mark.parametrize("n", [2, 4, 8])
def test_decode_sum_lowers_to_one_triton_kernel(n):
  _, encoded = encoded_shapes((n * 256, 1024), jnp.bfloat16, group_size=128)
  stacked = [jax.ShapeDtypeStruct((n, 256) + a.shape[1:], a.dtype) for a in encoded]
  decode_sum = functools.partial(decode_sum_pallas, group_size=128)
  assert triton_calls(decode_sum, *stacked) == 1


def test_kernels_lower_inside_shard_map_with_check_vma():
  """Inside ``jax.shard_map(check_vma=True)`` every kernel's outputs vary over the manual
  axes its inputs vary over (Pallas rejects outputs whose varying axes are unstated)."""
  from jax.sharding import PartitionSpec as P

  from taco_jax.testing import mesh_1d
  kw = dict(group_size=128, hadamard=False)

  def body(x_RD):
    w_RW = encode_pallas(x_RD, packed=True, **kw)
    codes, alpha, scale = encode_pallas(x_RD, **kw)
    outs = (w_RW, codes, alpha, scale, decode_pallas(codes, alpha, scale, **kw),
            pallas_kernels.decode_sum_wire(w_RW[None], implementation="pallas", **kw))
    assert all(jax.typeof(o).manual_axis_type.varying == {"x"} for o in outs)
    return outs[-2] + outs[-1]  # needs all four kernels

  f = jax.shard_map(body, mesh=mesh_1d(2), in_specs=P("x"), out_specs=P("x"), check_vma=True)
  assert triton_calls(f, jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)) == 4


@pytest.mark.parametrize("dtype,group_size,hadamard,kernels", [
    (jnp.float32, 256, True, 0),    # two-term H [512, 256] bf16: 256 KiB of shared memory
    (jnp.bfloat16, 256, True, 1),   # H [256, 256] bf16: 128 KiB
    (jnp.float32, 128, True, 1),
    (jnp.float32, 512, False, 1),   # no transform, no H
])
def test_codec_takes_the_reference_where_the_kernel_cannot_hold_the_transform(
    dtype, group_size, hadamard, kernels):
  from taco_jax.pallas_kernels.common import transform_misfit
  from taco_jax.pallas_kernels.encode import encode
  x = jax.ShapeDtypeStruct((64, 4 * group_size), dtype)
  kw = dict(group_size=group_size, hadamard=hadamard, implementation="pallas")
  assert triton_calls(functools.partial(encode, **kw), x) == kernels
  assert (transform_misfit(group_size, hadamard, dtype) is None) == bool(kernels)
  codes, alpha, scale = encoded_shapes(x.shape, dtype, group_size=group_size,
                                       hadamard=hadamard)[1]
  decode = functools.partial(pallas_kernels.decode, **kw)
  assert triton_calls(decode, codes, alpha, scale) == 1  # codes are bf16-exact: one-term H
