"""Compressed collectives on 8 fake CPU devices, with rank-valued inputs.

Rank r (along the collective's axis) holds ``x_r = (r + 1) * pattern``, so every answer has
a closed form. ``compression=None`` must equal the ``jax.lax`` collective exactly; FP8
answers must lie within ``taco_jax.testing``'s bound, derived from the format.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import CompressionConfig
from taco_jax import collectives as tc
from taco_jax.testing import (assert_within, fp8_roundtrip_bound, fp8_sum_bound, mesh_1d,
                              mesh_3d)

E4M3 = CompressionConfig(hadamard=True)
CONFIGS = {
    "e4m3": E4M3,
    "e5m2_g64": CompressionConfig(format="e5m2", group_size=64),
    "e4m3_nohadamard": CompressionConfig(hadamard=False, dual_scale=False),
}


def pattern(shape, dtype, seed=0):
  """Random but fixed, with a realistic spread: N(0,1) times a log-normal scale per row."""
  rng = np.random.default_rng(seed)
  p = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)))
  return jnp.asarray(p, dtype)


def rank_inputs(p, n):
  """What rank r holds: (r + 1) * p, computed exactly as on the device."""
  return [np.asarray(p * jnp.asarray(r + 1, p.dtype), np.float64) for r in range(n)]


def run(mesh, axis, body, p, *, check_vma=True):
  """Runs body(x_r) on every device; returns [devices, ...] outputs and each device's rank."""
  names = mesh.axis_names

  def f(p):
    r = jax.lax.axis_index(axis)
    return jax.tree.map(lambda y: y[None], body(p * (r + 1).astype(p.dtype)))

  out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(names),
                              check_vma=check_vma))(p)
  ranks = np.indices(mesh.devices.shape)[names.index(axis)].ravel()  # P(names) order
  return jax.tree.map(lambda y: np.asarray(y.astype(jnp.float32), np.float64), out), ranks


# --- one case per collective: (body, lax body, local shape, expected(xs, rank), bound) -----


def _chunks(a, n, d):
  return np.split(a, n, axis=d)


def case(kind, n, cfg, axis, dtype):
  """Returns (body, lax_body, pattern, expected_fn, bound_fn) for one collective."""
  if kind in ("all_gather", "all_gather_last"):
    dim = 0 if kind == "all_gather" else -1
    shape = (4, 3, 160) if dim == -1 else (4, 3, 256)
    body = lambda x, c: tc.all_gather(x, axis, axis=dim, compression=c)
    lax_body = lambda x: jax.lax.all_gather(x, axis, axis=dim % 3, tiled=True)
    expect = lambda xs, r: np.concatenate(xs, axis=dim)
    bound = lambda xs, r: np.concatenate(
        [fp8_roundtrip_bound(x, cfg, dtype) for x in xs], axis=dim)
  elif kind in ("reduce_scatter", "reduce_scatter_last"):
    dim = 1 if kind == "reduce_scatter" else 2
    shape = (3, 2 * n, 128) if dim == 1 else (3, 2, 40 * n)
    body = lambda x, c: tc.reduce_scatter(x, axis, scatter_dimension=dim, compression=c)
    lax_body = lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    expect = lambda xs, r: _chunks(sum(xs), n, dim)[r]
    bound = lambda xs, r: fp8_sum_bound(
        np.stack([_chunks(x, n, dim)[r] for x in xs]), cfg, dtype)
  elif kind in ("all_reduce_one_shot", "all_reduce_two_shot"):
    alg = kind[len("all_reduce_"):]
    shape = (3, 5, 192)  # 15 rows: two-shot pads them to a multiple of the axis size
    body = lambda x, c: tc.all_reduce(x, axis, compression=c, algorithm=alg)
    lax_body = lambda x: jax.lax.psum(x, axis)
    expect = lambda xs, r: sum(xs)
    bound = lambda xs, r: fp8_sum_bound(np.stack(xs), cfg, dtype,
                                        recompress=alg == "two_shot")
  elif kind == "ppermute":
    perm = [(i, (i + 1) % n) for i in range(n - 1)]  # rank 0 receives nothing
    src = {d: s for s, d in perm}
    shape = (4, 96)
    body = lambda x, c: tc.ppermute(x, axis, perm, compression=c)
    lax_body = lambda x: jax.lax.ppermute(x, axis, perm)
    expect = lambda xs, r: xs[src[r]] if r in src else np.zeros_like(xs[0])
    bound = lambda xs, r: (fp8_roundtrip_bound(xs[src[r]], cfg, dtype) if r in src
                           else np.zeros_like(xs[0]))
  else:
    raise ValueError(kind)
  return body, lax_body, pattern(shape, dtype), expect, bound


KINDS = ["all_gather", "all_gather_last", "reduce_scatter", "reduce_scatter_last",
         "all_reduce_one_shot", "all_reduce_two_shot", "ppermute"]


def _check(mesh, axis, n, kind, cfg, dtype, check_vma):
  """One program computes the compressed, the uncompressed and the lax collective."""
  body, lax_body, p, expect, bound = case(kind, n, cfg, axis, dtype)
  (out, plain, ref), ranks = run(
      mesh, axis, lambda x: (body(x, cfg), body(x, None), lax_body(x)), p,
      check_vma=check_vma)
  np.testing.assert_array_equal(plain, ref)  # compression=None: bit-identical to lax
  xs = rank_inputs(p, n)
  rtol = 1e-5 if dtype == jnp.float32 else 2e-2  # the lax collective's own rounding
  for k, r in enumerate(ranks):
    np.testing.assert_allclose(plain[k], expect(xs, r), rtol=rtol, atol=1e-5)
    assert_within(out[k], expect(xs, r), bound(xs, r), f"{kind} rank {r} (device {k})")
  if kind.startswith("all_reduce"):  # every rank decodes the same bytes in the same order
    chex.assert_trees_all_equal(*list(out))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_collective_1d(n, kind):
  _check(mesh_1d(n), "x", n, kind, E4M3, jnp.float32, True)


@pytest.mark.parametrize("axis,check_vma", [("tensor", True), ("data", False)])
@pytest.mark.parametrize("kind", KINDS)
def test_collective_one_axis_of_3d_mesh(axis, kind, check_vma):
  _check(mesh_3d(), axis, 2, kind, E4M3, jnp.float32, check_vma)


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("kind", ["all_gather_last", "reduce_scatter_last",
                                  "all_reduce_two_shot"])
def test_configs_and_bf16(cfg, kind):
  _check(mesh_1d(4), "x", 4, kind, CONFIGS[cfg], jnp.bfloat16, True)


def test_min_bytes_threshold_uses_plain_collective():
  cfg = CompressionConfig(min_bytes=4 * 3 * 256 * 4 + 1)  # one byte over the message
  _, lax_body, p, _, _ = case("all_gather", 4, cfg, "x", jnp.float32)
  a, _ = run(mesh_1d(4), "x", lambda x: tc.all_gather(x, "x", compression=cfg), p)
  b, _ = run(mesh_1d(4), "x", lax_body, p)
  np.testing.assert_array_equal(a, b)


EMPTY_CASES = {
    "all_gather": lambda x, c: tc.all_gather(x, "x", compression=c),
    "all_gather_last": lambda x, c: tc.all_gather(x, "x", axis=-1, compression=c),
    "reduce_scatter": lambda x, c: tc.reduce_scatter(x, "x", compression=c),
    "reduce_scatter_last": lambda x, c: tc.reduce_scatter(x, "x", scatter_dimension=-1,
                                                          compression=c),
    "all_reduce_one_shot": lambda x, c: tc.all_reduce(x, "x", compression=c,
                                                      algorithm="one_shot"),
    "all_reduce_two_shot": lambda x, c: tc.all_reduce(x, "x", compression=c),
    "ppermute": lambda x, c: tc.ppermute(x, "x", [(0, 1)], compression=c),
}


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("shape", [(4, 0), (0, 128)])
def test_empty_shard(shape, implementation):
  """A compressed collective of an empty shard gives the empty result of the lax collective
  (its shape, dtype and, under check_vma=True, varying axes). Shapes are compared through
  eval_shape: XLA cannot lower a lax all-gather or reduce-scatter along an empty dimension,
  which the compressed one (a gather on a new leading axis) never does."""
  cfg = CompressionConfig(implementation=implementation)

  def body(x, c):
    ys = {k: f(x, c) for k, f in EMPTY_CASES.items()}
    return ys, {k: jax.typeof(y).manual_axis_type.varying for k, y in ys.items()}

  def run(c, lower):
    types = {}

    def f(x):
      ys, types[c] = body(x, c)
      return ys

    g = jax.jit(jax.shard_map(f, mesh=mesh_1d(2), in_specs=P(), out_specs=P("x")))
    x = jnp.ones(shape, jnp.bfloat16)
    return (g(x) if lower else jax.eval_shape(g, x)), types[c]

  out, out_types = run(cfg, lower=True)
  ref, ref_types = run(None, lower=False)
  assert out_types == ref_types
  for k in EMPTY_CASES:
    assert (out[k].shape, out[k].dtype) == (ref[k].shape, ref[k].dtype) and out[k].size == 0, k


def _shard_map_call(body, shape, n=4):
  f = jax.shard_map(body, mesh=mesh_1d(n), in_specs=P(), out_specs=P(), check_vma=False)
  return jax.jit(f)(jnp.ones(shape, jnp.float32))


@pytest.mark.parametrize("compression", [None, E4M3])
def test_error_unknown_axis(compression):
  with pytest.raises(ValueError, match=r"all_gather: unknown mesh axis 'tensor'.*\(8, 128\)"):
    _shard_map_call(lambda x: tc.all_gather(x, "tensor", compression=compression), (8, 128))


@pytest.mark.parametrize("compression", [None, E4M3])
def test_error_not_divisible(compression):
  with pytest.raises(ValueError, match=r"dimension 0 of shape \(6, 128\) has size 6.*"
                                       r"size 4 of mesh axis 'x'"):
    _shard_map_call(lambda x: tc.reduce_scatter(x, "x", compression=compression), (6, 128))


def test_all_to_all_is_the_lax_collective_and_its_transpose():
  """`all_to_all` sends rank i's chunk j of the split axis to rank j, concatenated in rank
  order along the other axis: the tiled lax op, value and gradient (an all-to-all back)."""
  mesh, n = mesh_1d(4), 4
  p = pattern((2, 16, 8), jnp.float32)
  ours, ranks = run(mesh, "x", lambda x: tc.all_to_all(x, "x", split_axis=1, concat_axis=2), p)
  xs = rank_inputs(p, n)
  for y, r in zip(ours, ranks):
    np.testing.assert_array_equal(y, np.concatenate([_chunks(x, n, 1)[r] for x in xs], axis=2))

  def grad(x):
    return jax.grad(lambda x: jnp.sum(
        tc.all_to_all(x, "x", split_axis=1, concat_axis=2) ** 2))(x)
  grads, _ = run(mesh, "x", grad, p)
  for g, x in zip(grads, (xs[r] for r in ranks)):
    np.testing.assert_allclose(g, 2 * x, rtol=1e-6)  # d/dx sum(all_to_all(x)^2) = 2x


def test_all_to_all_errors():
  with pytest.raises(ValueError, match=r"all_to_all: dimension 0 of shape \(6, 128\) has size 6"):
    _shard_map_call(lambda x: tc.all_to_all(x, "x", split_axis=0, concat_axis=1), (6, 128))
  with pytest.raises(ValueError, match=r"all_to_all: concat_axis=2 is out of range"):
    _shard_map_call(lambda x: tc.all_to_all(x, "x", split_axis=0, concat_axis=2), (8, 128))


@pytest.mark.parametrize("min_bytes", [0, 1 << 30])  # compressed / below the threshold
def test_compressed_collective_rejects_integers_at_any_size(min_bytes):
  """A codec takes floating-point input only: a compressed collective refuses integers
  naming itself, also where the message is small enough to go plain (compression=None
  sends them)."""
  cfg = CompressionConfig(min_bytes=min_bytes)
  for name, f in EMPTY_CASES.items():
    x = jnp.ones((4, 128), jnp.int32)
    g = jax.shard_map(lambda x: f(x, None), mesh=mesh_1d(2), in_specs=P(), out_specs=P("x"),
                      check_vma=False)
    assert jax.eval_shape(g, x).dtype == jnp.int32
    g = jax.shard_map(lambda x: f(x, cfg), mesh=mesh_1d(2), in_specs=P(), out_specs=P("x"),
                      check_vma=False)
    collective = name.split("_last")[0].removesuffix("_one_shot").removesuffix("_two_shot")
    with pytest.raises(TypeError, match=f"^{collective}: compression needs a floating-point "
                                        "input, got dtype int32"):
      jax.eval_shape(g, x)


def test_error_bad_algorithm():
  with pytest.raises(ValueError, match="algorithm"):
    _shard_map_call(lambda x: tc.all_reduce(x, "x", algorithm="ring"), (8, 128))


def test_benchmark_smoke(tmp_path):
  """benchmarks/bench_collectives.py --smoke, cut to one tiny size and one repetition."""
  import importlib.util
  import json
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_collectives.py"
  spec = importlib.util.spec_from_file_location("bench_collectives", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  args = bench.parse_args(["--smoke", "--out-dir", str(tmp_path)])
  args.sizes_mib, args.iters, args.inner = "0.0625", 1, 1
  args.collectives = "all_reduce"  # the CLI smoke run covers all three
  report = bench.run(args)
  assert {(r["collective"], r["variant"]) for r in report["results"]} == {
      ("all_reduce", v) for v in ("bf16", "raw_fp8", "compressed")}
  assert all(r["median_ms"] > 0 for r in report["results"])
  json.dumps(report)  # serializable
  assert "threshold" in bench.table(report)


def test_compressed_collective_refuses_grad():
  f = jax.shard_map(lambda x: tc.all_gather(x, "x", compression=E4M3), mesh=mesh_1d(4),
                    in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(TypeError, match="all_gather: a compressed collective has no gradient"):
    jax.eval_shape(jax.grad(lambda x: f(x).sum()), jax.ShapeDtypeStruct((8, 128), jnp.float32))


def test_size_one_axis_is_the_identity_compressed_or_not():
  """Over a mesh axis of one device nothing is sent, so a compressed collective (and a
  mappings region, forward and gradient) returns its input bit for bit: no FP8 round trip."""
  from taco_jax import mappings
  mesh = jax.make_mesh((1, 8), ("one", "x"))
  x, ct = pattern((8, 4, 256), jnp.float32), pattern((8, 4, 256), jnp.float32, seed=1)
  cfg = E4M3
  regions = [lambda x: mappings.gather_from_sp(x, "one", fwd_compression=cfg,
                                               bwd_compression=cfg),
             lambda x: mappings.reduce_scatter_to_sp(x, "one", fwd_compression=cfg,
                                                     bwd_compression=cfg),
             lambda x: mappings.reduce_from_tp(mappings.copy_to_tp(x, "one", bwd_compression=cfg),
                                               "one", fwd_compression=cfg)]

  def body(x, ct):
    ys = [tc.all_gather(x, "one", axis=1, compression=cfg),
          tc.reduce_scatter(x, "one", scatter_dimension=1, compression=cfg),
          tc.all_reduce(x, "one", compression=cfg),
          tc.ppermute(x, "one", [(0, 0)], compression=cfg)]
    grads = []
    for region in regions:
      y, vjp = jax.vjp(region, x)
      ys.append(y)
      grads.append(vjp(ct)[0])
    return jnp.stack(ys), jnp.stack(grads)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                            out_specs=P(None, "x"), check_vma=False))
  ys, grads = f(*jax.device_put((x, ct), jax.NamedSharding(mesh, P("x"))))
  for y in ys:
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g), np.asarray(ct))


def test_free_communication_stands_in_locally_with_the_same_shapes():
  """`free_communication("x")`: the collectives over "x" send nothing (no collective in the
  program) and return the local stand-ins: the shard broadcast, the local slice, the input,
  the own chunk repeated."""
  mesh = mesh_1d(8)
  x = pattern((2, 16, 128), jnp.float32)

  def body(x):
    return (tc.all_gather(x, "x", axis=1, compression=E4M3),
            tc.reduce_scatter(x, "x", scatter_dimension=1), tc.all_reduce(x, "x"),
            tc.all_to_all(x, "x", split_axis=1, concat_axis=2))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("x"), check_vma=False))
  with tc.free_communication("x"):
    lowered = f.lower(x)
  text = lowered.as_text()
  assert not any(op in text for op in ("all_gather", "reduce_scatter", "all_reduce",
                                       "all_to_all"))
  gathered, scattered, reduced, exchanged = lowered.compile()(x)
  np.testing.assert_array_equal(exchanged, np.tile(x[:, :2], (8, 1, 8)))
  np.testing.assert_array_equal(gathered, np.tile(x, (8, 8, 1)))
  np.testing.assert_array_equal(scattered, np.tile(x[:, :2], (8, 1, 1)))
  np.testing.assert_array_equal(reduced, np.tile(x, (8, 1, 1)))
