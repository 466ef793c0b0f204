"""Collective matmuls (`taco_jax.tp.overlap`) against the regions they replace
(`mappings.gather_from_sp` + matmul, matmul + `mappings.reduce_scatter_to_sp`): values and
gradients, plain and with an FP8 codec, on axes of 2 and 4 devices."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import mappings, testing
from taco_jax.codec import CompressionConfig
from taco_jax.tp import overlap

B, S, D, F = 2, 4, 64, 32  # per device: batch, sequence shard, model width, local width
FP8 = CompressionConfig(group_size=32)


def _regions(kind, codec):
  """(ring version, direct version) of one layer kind, as f(x, w) inside the shard_map."""
  if kind == "column":
    ring = lambda x, w: overlap.gather_matmul(x, w, "x", codec, codec)  # noqa: E731
    direct = lambda x, w: jnp.einsum("btd,df->btf", mappings.gather_from_sp(  # noqa: E731
        x, "x", fwd_compression=codec, bwd_compression=codec), w)
  else:
    ring = lambda y, w: overlap.matmul_scatter(y, w, "x", codec, codec)  # noqa: E731
    direct = lambda y, w: mappings.reduce_scatter_to_sp(  # noqa: E731
        jnp.einsum("btf,fd->btd", y, w), "x", fwd_compression=codec, bwd_compression=codec)
  return ring, direct


def _value_and_grads(f, n, x, w, ct):
  """f's output and the gradients of <f(x, w), ct> over a 1-D mesh of n devices; x, w and
  ct carry a leading per-device axis."""
  mesh = testing.mesh_1d(n)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"),
                     check_vma=False)
  def run(x, w, ct):
    out, vjp = jax.vjp(f, x[0], w[0])
    dx, dw = vjp(ct[0])
    return jax.tree.map(lambda a: a[None], (out, dx, dw))

  return jax.jit(run)(x, w, ct)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("codec", [None, FP8], ids=["plain", "fp8"])
def test_ring_matches_the_direct_region(kind, n, codec):
  rng = np.random.default_rng(n)
  if kind == "column":
    x = rng.normal(size=(n, B, S, D))
    w = rng.normal(size=(n, D, F)) / np.sqrt(D)
    ct = rng.normal(size=(n, B, n * S, F))
  else:
    x = rng.normal(size=(n, B, n * S, F))
    w = rng.normal(size=(n, F, D)) / np.sqrt(F)
    ct = rng.normal(size=(n, B, S, D))
  x, w, ct = (jnp.asarray(a, jnp.float32) for a in (x, w, ct))
  ring, direct = _regions(kind, codec)
  got = _value_and_grads(ring, n, x, w, ct)
  want = _value_and_grads(direct, n, x, w, ct)
  exact = _value_and_grads(_regions(kind, None)[1], n, x, w, ct)
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
  for name, g, e, x0 in zip(("value", "dx", "dw"), got, want, exact):
    assert g.shape == e.shape, name
    if codec is None or (kind, name) in {("column", "value"), ("column", "dw"),
                                         ("row", "dx"), ("row", "dw")}:
      # plain, or the ring delivers exactly the codes the direct collective delivers
      np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5, err_msg=name)
    else:  # a ring reduce-scatter rounds each of its n - 1 running sums to FP8
      assert 0 < rel(g, x0) <= 1.5 * np.sqrt(n - 1) * rel(e, x0), name


def test_indivisible_sequence_is_a_clear_error():
  mesh = testing.mesh_1d(4)
  y, w = jnp.ones((4, B, 6, F)), jnp.ones((4, F, D))
  run = jax.shard_map(lambda y, w: overlap.matmul_scatter(y[0], w[0], "x", None, None)[None],
                      mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False)
  with pytest.raises(ValueError, match="sequence length 6 .* not divisible by the size 4"):
    run(y, w)


def test_head_logits_backward_runs_its_matmuls_in_the_compute_dtype():
  from taco_jax.tp.layers import head_logits
  kh, kw, kg = jax.random.split(jax.random.key(0), 3)
  h, w = jax.random.normal(kh, (2, 8, 32)), jax.random.normal(kw, (48, 32))
  g = jax.random.normal(kg, (2, 8, 48))
  plain = lambda h, w: jnp.einsum("btd,vd->btv", h, w)  # noqa: E731
  got = jax.vjp(head_logits, h, w)[1](g)
  want = jax.vjp(plain, h, w)[1](g)
  for a, b in zip(got, want):  # fp32 operands: autodiff's own result
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda h, w: jax.grad(lambda h, w: head_logits(h, w).sum(),
                                               argnums=(0, 1))(h, w))(hb, wb)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 2, jaxpr  # the backward's two (the forward's sits in the custom_vjp)
  assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  assert head_logits(hb, wb).dtype == jnp.float32
