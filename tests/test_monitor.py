"""`compression.log_errors`: per-family relative error of what was sent, as step metrics.

* Off, the step compiles to exactly the program it compiles to with the hooks removed
  (HLO text equality, compression off and on).
* The mechanism (errors carried out of the backward pass as the gradient of a probe) gives
  exactly the sender-side round-trip error of each message, checked on one region.
* On a 2x2x2 mesh every family's metric is finite, positive and within the codec's bound.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import collectives, mappings, monitor, testing
from taco_jax.configs.common import base_config
from taco_jax.codec import CompressionConfig, compress, decompress
from taco_jax.collectives import Decided
from taco_jax.tp import layers, layout as layout_lib, step as step_lib
from taco_jax.plan import FAMILIES, SITES, CompressionPlan, plan_from_config
from taco_jax.tp.mesh import TENSOR, make_mesh

CFG = layout_lib.model_config(dict(vocab_size=256, n_layers=2, d_model=64, n_heads=4,
                                  d_ff=128, max_seq_len=32, dtype="float32"))
CODEC = CompressionConfig(group_size=32, hadamard=True)
ON = CompressionPlan(CODEC, CODEC, CODEC, CODEC)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def rel_bound(cfg: CompressionConfig) -> float:
  """Bound on ||x_hat - x|| / ||x|| of one message: the per-group L2 bound of
  `testing.fp8_roundtrip_bound` (for a unit-norm group) holds for every group, hence for
  the whole message."""
  assert cfg.hadamard
  return float(testing.fp8_roundtrip_bound(np.eye(1, cfg.group_size), cfg).max())


@pytest.fixture(scope="module")
def setup():
  mesh = make_mesh(2, 2, 2)
  params = layout_lib.init_params(CFG, mesh, 0)
  tokens = jax.device_put(jax.random.randint(jax.random.key(0), (8, 33), 0, CFG.vocab_size),
                          step_lib.batch_sharding(mesh))
  tx = optax.adam(1e-3)
  return mesh, params, jax.jit(tx.init)(params), tokens, tx


def _step_text(spec, setup):
  mesh, params, opt, tokens, tx = setup
  return jax.jit(step_lib.make_train_step(spec, mesh, tx)).lower(params, opt, tokens).as_text()


@pytest.mark.parametrize("plan", [CompressionPlan(), ON], ids=["off", "compressed"])
def test_without_flag_the_program_is_unchanged(plan, setup, monkeypatch):
  spec = step_lib.ParallelSpec(CFG, 2, 2, 2, 2, plan)
  with_hooks = _step_text(spec, setup)
  monkeypatch.setattr(monitor, "region", lambda f, x, **_: f(x))
  monkeypatch.setattr(monitor, "sent", lambda *a: None)
  assert with_hooks == _step_text(spec, setup)
  if plan.any:  # and the flag does change it
    logged = step_lib.ParallelSpec(CFG, 2, 2, 2, 2, dataclasses.replace(ON, log_errors=True))
    assert _step_text(logged, setup) != with_hooks


def test_plan_reads_the_flag():
  section = lambda **kw: base_config("t").compression.to_dict() | dict(enabled=True, **kw)
  assert plan_from_config(section(log_errors=True)).log_errors
  assert not plan_from_config(section()).log_errors
  with pytest.raises(ValueError, match="log_errors"):
    plan_from_config(section(log_errors="yes"))


def _host_rel_err(x, cfg):
  """Round trip through two separate jits (the fp8 rounding really happens)."""
  c = jax.jit(lambda x: compress(x, cfg))(x)
  x_hat = np.asarray(jax.jit(lambda c: decompress(c, cfg, jnp.float32))(c), np.float64)
  x = np.asarray(x, np.float64)
  return np.linalg.norm(x_hat - x) / np.linalg.norm(x)


@pytest.mark.parametrize("fwd_min_bytes", [0, 1 << 40])
def test_probe_carries_each_messages_error(fwd_min_bytes):
  """gather_from_sp on 4 ranks: the forward message of rank r is x_r, the backward one is
  the cotangent w_r of its output; the probe's gradient sums their relative errors. A
  message below `min_bytes` goes uncompressed and is not counted."""
  n, bwd = 4, CompressionConfig("e5m2", 32)
  fwd = CompressionConfig(group_size=64, min_bytes=fwd_min_bytes)
  mesh = jax.make_mesh((n,), ("x",))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((n * 2, 4, 128)) * 3, jnp.float32)
  w = jnp.asarray(rng.standard_normal((n * 2, 4 * n, 128)), jnp.float32)

  def body(x, w):
    sends = (collectives.decide("all_gather", x, fwd, n),  # once per message, for both
             collectives.decide("reduce_scatter", w, bwd, n))  # w: the output's cotangent
    region = lambda x: mappings.gather_from_sp(x, "x", fwd_compression=Decided(sends[0]),
                                               bwd_compression=Decided(sends[1]))
    f = lambda x: jnp.sum(w * monitor.region(region, x, fwd=sends[0], bwd=sends[1],
                                             fwd_site="gather_from_sp/fwd",
                                             bwd_site="gather_from_sp/bwd"))
    _, _, probe_ct = monitor.value_and_grad(f, x, monitor.ErrorLog())
    return probe_ct[None]

  shard = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P("x")))
  got = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                         check_vma=False))(shard(x), shard(w)))
  rows = {s: i for i, s in enumerate(SITES)}
  for r in range(n):
    xr, wr = x[2 * r:2 * r + 2], w[2 * r:2 * r + 2]
    want = [_host_rel_err(xr, fwd), 1] if not fwd_min_bytes else [0, 0]
    np.testing.assert_allclose(got[r, rows["gather_from_sp/fwd"]], want, rtol=1e-5)
    np.testing.assert_allclose(got[r, rows["gather_from_sp/bwd"]], [_host_rel_err(wr, bwd), 1],
                               rtol=1e-5)
    others = np.delete(got[r], [rows["gather_from_sp/fwd"], rows["gather_from_sp/bwd"]], 0)
    assert not others.any()


def test_each_message_is_decided_once():
  """A compressed sequence-parallel layer pair (gather, matmul, scatter) traced forward
  and backward with the monitor on: each of its four messages is decided once
  (`collectives.decide`), that one decision serving its collective and the monitor."""
  n, ctx = 2, layers.TPContext(tp=2, dtype=jnp.float32, plan=CompressionPlan(CODEC, CODEC))
  x, w = jnp.ones((2, 8, 64)), jnp.ones((64, 64))

  def body(x, w):
    f = lambda x: jnp.sum(layers.scatter_seq(layers.gather_seq(x, ctx) @ w, ctx) ** 2)
    return monitor.value_and_grad(f, x, monitor.ErrorLog())[2][None]

  step = jax.jit(jax.shard_map(body, mesh=make_mesh(1, 1, n, jax.devices()[:n]),
                               in_specs=(P(None, TENSOR), P()), out_specs=P(TENSOR),
                               check_vma=False))
  with collectives.recording_decisions() as decisions:
    probe_ct = step.trace(x, w).lower().compile(compiler_options=FAST_COMPILE)(x, w)
  shard, full = 2 * 4 * 64 * 4, 2 * 8 * 64 * 4  # bytes of [B, T/n, D] and [B, T, D], fp32
  assert [d[:3] for d in decisions] == [
      ("all_gather", shard, True), ("reduce_scatter", full, True),  # gather
      ("reduce_scatter", full, True), ("all_gather", shard, True)]  # scatter
  assert [d.site for d in decisions] == [f"{r}/{d}" for r in ("gather_from_sp",
                                         "reduce_scatter_to_sp") for d in ("fwd", "bwd")]
  counted = {s: float(probe_ct[0, i, 1]) for i, s in enumerate(SITES) if probe_ct[0, i, 1]}
  assert counted == {f"{r}/{d}": 1.0 for r in ("gather_from_sp", "reduce_scatter_to_sp")
                     for d in ("fwd", "bwd")}


def test_step_metrics_per_family(setup):
  mesh, params, opt, tokens, tx = setup
  plan = CompressionPlan(CODEC, CODEC, CODEC, CODEC, log_errors=True)
  spec = step_lib.ParallelSpec(CFG, 2, 2, 2, 2, plan)
  logged = tuple(f for f in FAMILIES if f != "dp_params")  # no sharded optimizer: no gather
  assert step_lib.logged_families(spec) == logged
  step = jax.jit(step_lib.make_train_step(spec, mesh, tx)).lower(params, opt, tokens).compile(
      compiler_options=FAST_COMPILE)
  _, _, metrics = step(params, opt, tokens)
  bound = rel_bound(CODEC)
  for fam in logged:
    v = float(metrics[f"compression_error/{fam}"])
    assert np.isfinite(v) and 0 < v <= bound, (fam, v, bound)
  assert np.isfinite(float(metrics["loss"]))
