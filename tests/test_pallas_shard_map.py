"""``implementation="pallas"`` inside ``jax.shard_map``, with ``check_vma`` True and False.

Every compressed collective and every mapping (value and gradient) runs once with the Pallas
kernels (interpret mode on CPU) and once with the jnp reference (``"xla"``) in the same
program. The kernels are the reference's math bit for bit, so both must give the same bits;
under ``check_vma=True`` they must also give the same varying-manual-axes types.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import CompressionConfig
from taco_jax import collectives as tc
from taco_jax import mappings as tm
from taco_jax.testing import mesh_1d

AXIS, N = "x", 2
PALLAS = CompressionConfig(implementation="pallas")
XLA = CompressionConfig(implementation="xla")
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # CPU codegen effort; same HLO


def _collectives(x, cfg):
  return dict(
      all_gather=tc.all_gather(x, AXIS, compression=cfg),
      all_gather_last=tc.all_gather(x, AXIS, axis=-1, compression=cfg),
      reduce_scatter=tc.reduce_scatter(x, AXIS, compression=cfg),
      all_reduce_one_shot=tc.all_reduce(x, AXIS, compression=cfg, algorithm="one_shot"),
      all_reduce_two_shot=tc.all_reduce(x, AXIS, compression=cfg, algorithm="two_shot"),
      ppermute=tc.ppermute(x, AXIS, [(0, 1)], compression=cfg),  # rank 0 receives nothing
  )


def _mappings(x, p, cfg):
  """(value, gradient) of each region; the cotangent is cos(value), so it has its type."""
  regions = dict(
      copy_to_tp=(lambda v: tm.copy_to_tp(v, AXIS, bwd_compression=cfg), p),
      reduce_from_tp=(lambda v: tm.reduce_from_tp(v, AXIS, fwd_compression=cfg), x),
      gather_from_sp=(lambda v: tm.gather_from_sp(v, AXIS, axis=0, fwd_compression=cfg,
                                                  bwd_compression=cfg), x),
      reduce_scatter_to_sp=(lambda v: tm.reduce_scatter_to_sp(
          v, AXIS, axis=0, fwd_compression=cfg, bwd_compression=cfg), x),
  )
  out = {}
  for name, (region, v) in regions.items():
    y, vjp = jax.vjp(region, v)
    out[name] = (y, *vjp(jnp.cos(y)))
  return out


def _varying(a) -> frozenset:
  return jax.typeof(a).manual_axis_type.varying


@pytest.mark.parametrize("check_vma", [True, False])
def test_pallas_collectives_and_mappings_match_reference(check_vma):
  p = jnp.asarray(np.random.default_rng(0).standard_normal((4, 128)), jnp.float32)

  def body(p):
    x = p * (jax.lax.axis_index(AXIS) + 1).astype(p.dtype)
    outs = [{**_collectives(x, cfg), **_mappings(x, p, cfg)} for cfg in (PALLAS, XLA)]
    flat_pallas, flat_xla = (jax.tree_util.tree_flatten_with_path(o)[0] for o in outs)
    for (path, a), (_, b) in zip(flat_pallas, flat_xla, strict=True):
      assert _varying(a) == _varying(b), jax.tree_util.keystr(path)
    return jax.tree.map(lambda a: a[None], outs)

  f = jax.jit(jax.shard_map(body, mesh=mesh_1d(N), in_specs=P(), out_specs=P(AXIS),
                            check_vma=check_vma))
  with tc.recording_decisions() as decisions:
    traced = f.trace(p)
  assert "pallas_call" in str(traced.jaxpr)  # the kernels run (the reference has none)
  pallas, xla = traced.lower().compile(compiler_options=FAST_COMPILE)(p)
  # Per implementation: 6 collectives, 6 region messages (the SP regions send forward and
  # backward); every one compressed (else both sides would be the plain collective).
  assert len(decisions) == 2 * 12 and all(d.compressed for d in decisions)
  assert jax.tree.structure(pallas) == jax.tree.structure(xla)
  for name in pallas:
    for a, b in zip(jax.tree.leaves(pallas[name]), jax.tree.leaves(xla[name])):
      np.testing.assert_array_equal(a, b, err_msg=name)
