"""The optimizer sharded over "data" (`parallel.shard_optimizer`, `taco_jax.tp.zero`) against
the replicated one, its compiled collectives, FP8 weight differences and checkpoints.

One tiny fp32 GPT, a few AdamW steps on one batch (clipping on). d_model = 36 leaves the
norms, the final norm and the QKV biases without a dimension divisible by 8, so at dp = 8 they stay
replicated (all-reduced) beside the sharded leaves.
"""
import dataclasses
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from taco_jax import testing
from taco_jax.codec import CompressionConfig
from taco_jax.plan import SITES, CompressionPlan
from taco_jax.testing import hlo
from taco_jax.tp import layout as layout_lib, step as step_lib, zero
from taco_jax.tp.mesh import make_mesh
from taco_jax.train import checkpoint
from taco_jax.train.trainer import make_optimizer, memory_line, opt_state_target

CFG = layout_lib.model_config(dict(vocab_size=128, n_layers=2, d_model=36, n_heads=4, d_ff=72,
                                   max_seq_len=16, dtype="float32"))
BATCH, SEQ, STEPS = 8, 16, 4
LAYOUTS = [(8, 1, 1), (2, 1, 4), (2, 2, 2)]  # (dp, pp, tp)
TX = make_optimizer(ml_collections.ConfigDict(dict(
    lr=1e-2, min_lr_ratio=0.1, warmup_steps=0, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
    grad_clip=1.0)), STEPS)
CODEC = CompressionConfig(format="e4m3", group_size=32)
ON = CompressionPlan(dp=CODEC, dp_params=CODEC, log_errors=True)
F32_TOL = 64 * testing.unit_roundoff(jnp.float32)  # as tests/test_parallel_step.py
EPS = testing.unit_roundoff(CODEC.fp8_dtype)        # one FP8 rounding, relative
FAST_COMPILE = {"xla_backend_optimization_level": 0}
_ids = lambda m: "dp%d-pp%d-tp%d" % m  # noqa: E731


def _batches():
  """One batch, STEPS times: the loss falls every step."""
  return [jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CFG.vocab_size)] * STEPS


@pytest.fixture(scope="module")
def init():
  return jax.device_get(layout_lib.init_params(CFG, make_mesh(1, 1, 1, jax.devices()[:1])))


def _program(layout, shard, plan=CompressionPlan()):
  """(spec, mesh, compiled step, params target, opt_state target)."""
  dp, pp, tp = layout
  mesh = make_mesh(dp, pp, tp, jax.devices()[:dp * pp * tp])
  spec = step_lib.ParallelSpec(CFG, dp, pp, tp, 2 if pp > 1 else 1, plan,
                               shard_optimizer=shard)
  p_abs = layout_lib.abstract_params(CFG, mesh)
  o_abs = opt_state_target(TX, p_abs, mesh, spec)
  sh = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
  tok = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32, sharding=step_lib.batch_sharding(mesh))
  exe = jax.jit(step_lib.make_train_step(spec, mesh, TX), out_shardings=(
      sh(p_abs), sh(o_abs), None)).lower(p_abs, o_abs, tok).compile(FAST_COMPILE)
  return spec, mesh, exe, p_abs, o_abs


def _train(program, params, opt_state=None, batches=None):
  """Steps `program` from `params` (and a fresh state); every step's (params, opt_state),
  metrics and loss."""
  spec, mesh, exe, p_abs, o_abs = program
  params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, p_abs))
  if opt_state is None:
    opt_state = jax.jit(zero.init(spec, TX), out_shardings=jax.tree.map(
        lambda x: x.sharding, o_abs))(params)
  states, metrics = [(params, opt_state)], []
  for tokens in batches or _batches():
    params, opt_state, m = exe(params, opt_state,
                               jax.device_put(tokens, step_lib.batch_sharding(mesh)))
    states.append((params, opt_state))
    metrics.append({k: float(v) for k, v in m.items()})
  return dict(states=states, losses=[m["loss"] for m in metrics], metrics=metrics,
              colls=hlo.collectives(exe.as_text(), mesh))


@pytest.fixture(scope="module", params=LAYOUTS, ids=_ids)
def run(request, init):
  out = {"layout": request.param}
  for name, shard in (("replicated", False), ("sharded", True)):
    out[name + "_program"] = program = _program(request.param, shard)
    out[name] = _train(program, init)
  return out


def _assert_close(got, want, signal=None):
  """Every leaf within F32_TOL of its largest value; where `signal` (a tree of bool
  arrays) is given, only its True elements."""
  signal = jax.tree.leaves(signal) if signal is not None else [True] * len(jax.tree.leaves(want))
  for (path, g), w, keep in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                                signal, strict=True):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    err = np.max(np.where(keep, np.abs(g - w), 0.0), initial=0.0)
    assert err <= F32_TOL * np.max(np.abs(w), initial=0.0), (jax.tree_util.keystr(path), err)


def _signal(opt_state):
  """Per parameter element: whether its gradient is more than rounding noise, i.e. its
  Adam second moment is above F32_TOL of its leaf's largest. The key bias's gradient is 0
  but for rounding (softmax ignores a shift shared by all keys); Adam scales that noise to
  updates of lr * noise / eps, which no two programs round alike."""
  rms = jax.tree.map(lambda v: np.sqrt(np.asarray(v, np.float64)),
                     optax.tree_utils.tree_get(opt_state, "nu"))
  return jax.tree.map(lambda r: r > F32_TOL * np.max(r, initial=0.0), rms)


def test_uncompressed_equals_the_replicated_optimizer(run):
  """Parameters, both moments and losses after STEPS steps: the same to fp32 rounding (the
  gradient's data sum runs in another order), and the state's global arrays are the
  replicated optimizer's (checkpoints do not depend on the layout)."""
  (p_rep, o_rep), (p_sh, o_sh) = run["replicated"]["states"][-1], run["sharded"]["states"][-1]
  np.testing.assert_allclose(run["sharded"]["losses"], run["replicated"]["losses"],
                             rtol=F32_TOL)
  signal = _signal(o_rep)
  noise = sum(np.sum(~x) for x in jax.tree.leaves(signal))
  assert noise <= CFG.n_layers * CFG.d_model, noise  # the key biases at most
  _assert_close(p_sh, p_rep, signal)
  assert jax.tree.structure(o_sh) == jax.tree.structure(o_rep)
  _assert_close(o_sh, o_rep)


@pytest.mark.parametrize("run", [(8, 1, 1)], indirect=True, ids=_ids)
def test_codecs_a_threshold_leaves_plain_send_the_uncompressed_messages(run, init):
  """Codecs configured for both DP directions but too small a message for their threshold
  (`min_bytes`): the step keeps a master, yet sends fp32 leaf by leaf and its parameters
  are the uncompressed sharded step's, bit for bit."""
  plain = dataclasses.replace(CODEC, min_bytes=1 << 40)
  program = _program(run["layout"], True, CompressionPlan(dp=plain, dp_params=plain))
  got = _train(program, init)
  assert zero.keeps_master(program[0])
  assert {c.dtype for c in got["colls"] if c.axes == {"data"}} == {"f32"}
  want = run["sharded"]["states"][-1][0]
  for g, w in zip(jax.tree.leaves(got["states"][-1][0]), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _over_data(colls, kind):
  return [c for c in colls if c.kind == kind and c.axes == {"data"}]


def _local_elements(program, sharded: bool) -> int:
  """Per-device elements of the parameter leaves that `shard_dims` splits (or keeps)."""
  spec, _, _, p_abs, _ = program
  leaves = [x for x, k in zip(jax.tree.leaves(p_abs), zero.shard_dims(spec))
            if (k is not None) == sharded]
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in leaves)


def test_hlo_reduce_scatter_and_all_gather_over_data(run):
  """Sharded, the step sends over "data" fp32 reduce-scatters (the gradients) and
  all-gathers (the parameters) of the split leaves, each element once; the only
  all-reduces over "data" left carry the leaves that stay replicated (none at dp = 2).
  Replicated, the all-reduces carry everything. (hlo.collectives skips scalars: the
  gradient norm's partial sums.)"""
  dp = run["layout"][0]
  program, colls = run["sharded_program"], run["sharded"]["colls"]
  split, kept = _local_elements(program, True), _local_elements(program, False)
  rs, ag = _over_data(colls, "reduce-scatter"), _over_data(colls, "all-gather")
  assert {c.dtype for c in rs + ag} == {"f32"}
  assert dp * sum(c.elements for c in rs) == sum(c.elements for c in ag) == split
  assert sum(c.elements for c in _over_data(colls, "all-reduce")) == kept
  assert (kept > 0) == (dp == 8)
  assert not _over_data(colls, "all-to-all")
  full = _over_data(run["replicated"]["colls"], "all-reduce")
  assert sum(c.elements for c in full) == split + kept


def _data_copies_identical(tree, mesh):
  """Every leaf: the copies on the devices of one (pipeline, tensor) position, that is on
  every data rank, are the same bits."""
  for x in jax.tree.leaves(tree):
    by_position = {}
    for s in x.addressable_shards:
      by_position.setdefault(str(s.index), []).append(np.asarray(s.data).view(np.uint32))
    for copies in by_position.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])
    assert len(copies) == mesh.shape["data"]


def _gather_bound(delta, k, dp):
  """Per-element bound on the rounding of `delta` (global, pp = tp = 1) sent as chunks of
  axis `k` in groups of CODEC.group_size (`testing.fp8_roundtrip_bound`)."""
  rows = np.asarray(zero._split(delta, k, dp))
  g = CODEC.group_size
  n = rows.shape[1]
  padded = np.pad(rows, [(0, 0), (0, -n % g)])
  bound = testing.fp8_roundtrip_bound(padded, CODEC)[:, :n]
  return np.asarray(zero._join(bound, delta.shape, k, dp))


@pytest.mark.parametrize("run", [(8, 1, 1)], indirect=True, ids=_ids)
def test_compressed_data_ranks_identical_and_loss_follows(run, init):
  """dp = 8, gradients reduce-scattered and weight differences gathered in FP8: the
  parameters on the 8 data ranks are the same bits after every step; they differ from the
  fp32 master by at most one rounding of the last step's difference; the loss follows the
  uncompressed run within EPS times what that run's loss has fallen; the wire is u8; each
  family's logged error (`compression.log_errors`) is within one message's FP8 bound."""
  program = _program((8, 1, 1), True, ON)
  spec, mesh = program[0], program[1]
  out = _train(program, init)
  assert zero.keeps_master(spec)
  dims = zero.shard_dims(spec)
  for (p_prev, _), (params, state) in zip(out["states"], out["states"][1:]):
    _data_copies_identical(params, mesh)
    for p0, p, m, k in zip(jax.tree.leaves(p_prev), jax.tree.leaves(params),
                           jax.tree.leaves(state["master"]), dims, strict=True):
      p0, p, m = (np.asarray(x, np.float64) for x in (p0, p, m))
      if k is None:  # replicated: updated on every rank, nothing sent
        np.testing.assert_array_equal(p, m)
      else:
        testing.assert_within(p, m, _gather_bound(m - p0, k, 8), "gathered vs master")
  plain = run["sharded"]["losses"]
  assert out["losses"][0] == plain[0]
  for got, want in zip(out["losses"][1:], plain[1:]):
    assert abs(got - want) <= EPS * (plain[0] - want), (got, want)
  # per group ||x_hat - x|| <= (u + sqrt(G) d / M) ||x||: d = e4m3's half subnormal
  # spacing 2^-10, M = 448 (taco_jax.testing's derivation, without the transform)
  bound = EPS + np.sqrt(CODEC.group_size) * 2.0**-10 / 448
  for m in out["metrics"]:
    for fam in ("dp", "dp_params"):
      assert 0 < m[f"compression_error/{fam}"] <= bound, (fam, m)
  stats = (len(SITES), 2)  # the logged errors' sums, fp32
  data = [c for c in out["colls"] if c.axes == {"data"} and c.shape != stats]
  assert {c.kind for c in data} == {"all-to-all", "all-gather"}  # reduce-scatters, gather
  assert all(c.dtype == "u8" for c in data), [c.line for c in data if c.dtype != "u8"]


@pytest.mark.parametrize("run", [(2, 1, 4)], indirect=True, ids=_ids)
def test_checkpoint_saved_on_dp4_restores_on_dp2(run, tmp_path):
  """The (2, 1, 4) run's state after two steps, laid out as a (4, 1, 2) sharded step holds
  it (moments split 4 ways over "data"), saved, restored onto the (2, 1, 4) targets: the
  same values, and the next step is the uninterrupted run's, bit for bit. (The dp = 4
  step itself runs in tests/test_train.py's (4, 1, 2) trainer, which shards its optimizer.)"""
  dp4 = make_mesh(4, 1, 2)
  spec4 = step_lib.ParallelSpec(CFG, 4, 1, 2, shard_optimizer=True)
  p4 = layout_lib.abstract_params(CFG, dp4)
  targets = (p4, opt_state_target(TX, p4, dp4, spec4))
  saved = jax.device_put(run["sharded"]["states"][2], jax.tree.map(lambda x: x.sharding,
                                                                   targets))
  assert any(x.sharding.spec != t.sharding.spec for x, t in zip(
      jax.tree.leaves(saved), jax.tree.leaves(run["sharded"]["states"][2])))
  ckpt = checkpoint.Checkpoints(tmp_path)
  ckpt.save(2, *saved, {"step": 2, "mesh": dict(dp4.shape)})
  ckpt.wait()
  _, _, _, p_abs, o_abs = run["sharded_program"]
  restored = ckpt.restore(2, p_abs, o_abs)[:2]
  ckpt.close()
  for got, want, target in zip(jax.tree.leaves(restored), jax.tree.leaves(saved),
                               jax.tree.leaves((p_abs, o_abs)), strict=True):
    assert got.sharding == target.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  resumed = _train(run["sharded_program"], *restored, batches=_batches()[2:3])
  for got, want in zip(jax.tree.leaves(resumed["states"][-1]),
                       jax.tree.leaves(run["sharded"]["states"][3]), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_memory_and_config_errors():
  """The optimizer state per device shrinks dp-fold but for the replicated leaves; a codec
  for the parameter gather without the sharded optimizer is refused."""
  mesh = make_mesh(8, 1, 1)
  p_abs = layout_lib.abstract_params(CFG, mesh)
  spec = step_lib.ParallelSpec(CFG, 8, 1, 1, shard_optimizer=True)
  rep = zero.bytes_per_device(opt_state_target(TX, p_abs, mesh))
  sh = zero.bytes_per_device(opt_state_target(TX, p_abs, mesh, spec))
  dims = zero.shard_dims(spec)
  size = lambda replicated: sum(x.size for x, k in zip(jax.tree.leaves(p_abs), dims)  # noqa
                                if (k is None) == replicated)
  counts = rep - 2 * 4 * (size(True) + size(False))  # step counts: the rest, replicated
  assert sh == counts + 2 * 4 * (size(True) + size(False) // 8)
  assert "optimizer state" in memory_line(p_abs, p_abs, spec) and "sharded over data" in \
      memory_line(p_abs, p_abs, spec)
  with pytest.raises(ValueError, match="compression.dp_params compresses the sharded "
                     "optimizer's parameter all-gather: set parallel.shard_optimizer=True"):
    step_lib.ParallelSpec(CFG, 8, 1, 1, plan=ON)
