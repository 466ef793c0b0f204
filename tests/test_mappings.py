"""Megatron regions: values and gradients, uncompressed (exact) and FP8 (within the bound).

Each region runs inside a manual shard_map on rank-valued inputs; every device takes the
gradient of its local loss inside the shard_map (how Megatron-style code differentiates),
so the region's backward collective is what aggregates across ranks. A second test takes
the gradient of the whole SPMD program from outside with ``check_vma=True`` and compares it
bit for bit with ``jax.grad`` of the same program written with plain ``jax.lax`` collectives.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import CompressionConfig
from taco_jax import mappings as tm
from taco_jax.testing import (assert_within, fp8_roundtrip_bound, fp8_sum_bound, mesh_1d,
                              mesh_3d)

FWD = CompressionConfig(format="e4m3")
BWD = CompressionConfig(format="e5m2", group_size=64)  # gradients: wider range
F32 = jnp.float32


def rand(shape, seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,))),
                     F32)


def f32(a):
  return np.asarray(a, np.float32).astype(np.float64)


def region(name, n, axis, fwd, bwd):
  """Returns (reg, x_of, ct_of, p, c, w, value, value_bound, grad, grad_bound).

  ``reg(x)`` is the region, rank r's input is ``x_of(p, r)`` and the cotangent it feeds
  into the region's output is ``ct_of(c_r, w, r)``; value/grad and their FP8 bounds are
  the closed forms for rank r.
  """
  p_shape, c_shape = {"copy_to_tp": ((6, 128), (6, 128)),
                      "reduce_from_tp": ((6, 128), (6, 128)),
                      "gather_from_sp": ((2, 4, 160), (2, 4 * n, 160)),
                      "reduce_scatter_to_sp": ((2, 4 * n, 160), (2, 4, 160))}[name]
  p, c, w = rand(p_shape, 1), rand((n,) + c_shape, 2), rand(p_shape, 3)
  x_of = lambda p, r: p * (r + 1)
  ct_of = lambda c_r, w, r: c_r * (r + 1)
  cts = [f32(c[j]) * np.float32(j + 1) for j in range(n)]  # ct of rank j, as on the device
  chunk = lambda a, r: np.split(a, n, axis=1)[r]
  if name == "copy_to_tp":
    reg = lambda x: tm.copy_to_tp(x, axis, bwd_compression=bwd)
    x_of = lambda p, r: p  # replicated input
    value, value_b = (lambda xs, r: xs[r]), (lambda xs, r: np.zeros(p_shape))
    grad = lambda r: sum(cts)
    grad_b = lambda r: fp8_sum_bound(np.stack(cts), bwd or FWD, F32, recompress=True)
  elif name == "reduce_from_tp":
    reg = lambda x: tm.reduce_from_tp(x, axis, fwd_compression=fwd)
    ct_of = lambda c_r, w, r: w  # the output is replicated, so is its cotangent
    value = lambda xs, r: sum(xs)
    value_b = lambda xs, r: fp8_sum_bound(np.stack(xs), fwd or FWD, F32, recompress=True)
    grad, grad_b = (lambda r: f32(w)), (lambda r: np.zeros(p_shape))  # identity: exact
  elif name == "gather_from_sp":
    reg = lambda x: tm.gather_from_sp(x, axis, axis=1, fwd_compression=fwd,
                                      bwd_compression=bwd)
    value = lambda xs, r: np.concatenate(xs, axis=1)
    value_b = lambda xs, r: np.concatenate([fp8_roundtrip_bound(x, fwd or FWD, F32)
                                            for x in xs], axis=1)
    grad = lambda r: chunk(sum(cts), r)
    grad_b = lambda r: fp8_sum_bound(np.stack([chunk(t, r) for t in cts]), bwd or FWD, F32)
  elif name == "reduce_scatter_to_sp":
    reg = lambda x: tm.reduce_scatter_to_sp(x, axis, axis=1, fwd_compression=fwd,
                                            bwd_compression=bwd)
    value = lambda xs, r: chunk(sum(xs), r)
    value_b = lambda xs, r: fp8_sum_bound(np.stack([chunk(x, r) for x in xs]),
                                          fwd or FWD, F32)
    grad = lambda r: np.concatenate(cts, axis=1)
    grad_b = lambda r: np.concatenate([fp8_roundtrip_bound(t, bwd or FWD, F32)
                                       for t in cts], axis=1)
  else:
    raise ValueError(name)
  return reg, x_of, ct_of, p, c, w, value, value_b, grad, grad_b


REGIONS = ["copy_to_tp", "reduce_from_tp", "gather_from_sp", "reduce_scatter_to_sp"]


def check_region(name, mesh, axis, compressed, check_vma):
  n = mesh.shape[axis]
  fwd, bwd = (FWD, BWD) if compressed else (None, None)
  reg, x_of, ct_of, p, c, w, value, value_b, grad, grad_b = region(name, n, axis, fwd, bwd)

  def body(p, c, w):
    r = jax.lax.axis_index(axis).astype(F32)
    y, vjp = jax.vjp(reg, x_of(p, r))
    (g,) = vjp(ct_of(c[0], w, r))
    return jax.tree.map(lambda a: a[None], (y, g))

  names = mesh.axis_names
  y, g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis), P()),
                               out_specs=P(names), check_vma=check_vma))(p, c, w)
  ranks = np.indices(mesh.devices.shape)[names.index(axis)].ravel()
  xs = [f32(x_of(p, np.float32(r))) for r in range(n)]  # as computed on the device
  for dev, r in enumerate(ranks):
    if compressed:
      assert_within(y[dev], value(xs, r), value_b(xs, r), f"{name} value, rank {r}")
      assert_within(g[dev], grad(r), grad_b(r), f"{name} grad, rank {r}")
    else:
      np.testing.assert_allclose(y[dev], value(xs, r), rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(g[dev], grad(r), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", REGIONS)
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("check_vma", [True, False])
def test_region_value_and_grad(name, compressed, check_vma):
  check_region(name, mesh_1d(4), "x", compressed, check_vma)


@pytest.mark.parametrize("name", REGIONS)
def test_region_on_tensor_axis_of_3d_mesh(name):
  check_region(name, mesh_3d(), "tensor", True, True)


# --- whole-program gradients vs plain lax collectives (check_vma=True) --------------------


def _program(name, plain):
  """(shard_map body, in_specs, out_spec) of a tiny Megatron-like program on axis "x"."""
  def body(x, w):
    if name == "copy_to_tp":  # replicated x -> column-parallel: partial outputs per rank
      h = x if plain else tm.copy_to_tp(x, "x")
      return h @ w
    if name == "reduce_from_tp":  # row-parallel partial sums -> replicated
      h = x @ w
      return jax.lax.psum(h, "x") if plain else tm.reduce_from_tp(h, "x")
    if name == "gather_from_sp":  # sequence-sharded x -> full sequence, column-parallel
      h = (jax.lax.all_gather(x, "x", axis=0, tiled=True) if plain
           else tm.gather_from_sp(x, "x", axis=0))
      return h @ w
    h = x @ w  # row-parallel partial sums -> sequence-sharded
    return (jax.lax.psum_scatter(h, "x", scatter_dimension=0, tiled=True) if plain
            else tm.reduce_scatter_to_sp(h, "x", axis=0))
  specs = {"copy_to_tp": ((P(), P(None, "x")), P(None, "x")),
           "reduce_from_tp": ((P(None, "x"), P("x")), P()),
           "gather_from_sp": ((P("x"), P(None, "x")), P(None, "x")),
           "reduce_scatter_to_sp": ((P(None, "x"), P("x")), P("x"))}[name]
  return body, *specs


@pytest.mark.parametrize("name", REGIONS)
def test_whole_program_grad_equals_lax(name):
  mesh = mesh_1d(4)
  x, w, ct = rand((16, 64), 3), rand((64, 32), 4), rand((16, 32), 5)

  def loss(plain, x, w):
    body, in_specs, out_spec = _program(name, plain)
    y = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                      check_vma=True)(x, w)
    return jnp.sum(y * ct)

  ours = jax.jit(jax.grad(functools.partial(loss, False), argnums=(0, 1)))(x, w)
  lax_ = jax.jit(jax.grad(functools.partial(loss, True), argnums=(0, 1)))(x, w)
  chex.assert_trees_all_equal(ours, lax_)
  dense = jax.grad(lambda x, w: jnp.sum((x @ w) * ct), argnums=(0, 1))(x, w)
  chex.assert_trees_all_close(ours, dense, rtol=1e-5, atol=1e-5)
