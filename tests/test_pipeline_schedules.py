"""The 1F1B and interleaved pipeline schedules (`parallel.schedule`) against the
single-device model, their hand-offs in the compiled step, their memory, and their checks.

One tiny fp32 GPT (16 layers, so that every mesh's pp divides into 2 chunks per stage) and
one batch, whose single-device loss and gradients are computed once. The cheap default runs
1F1B and the interleaved schedule on every mesh once, m rotating through pp, 2 pp and an
odd m (3) so that each schedule and each mesh meets all three; the full product, GPipe
included, is marked slow (GPipe, the reference schedule, is also checked against the
single-device model on five meshes by tests/test_parallel_step.py).
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from taco_jax.models.decoder import loss_fn
from taco_jax import testing
from taco_jax.codec import CompressionConfig
from taco_jax.tp import mesh as mesh_lib, layout as layout_lib, schedules
from taco_jax.testing import hlo
from taco_jax.tp import step as step_lib
from taco_jax.plan import CompressionPlan
from taco_jax.tp.mesh import make_mesh

CFG = layout_lib.model_config(dict(vocab_size=64, n_layers=16, d_model=32, n_heads=4, d_ff=64,
                                  max_seq_len=16, dtype="float32"))
SEQ, BATCH = 16, 48  # BATCH: divisible by dp * m for every case below
MESHES = [(1, 2, 4), (2, 2, 2), (1, 4, 2), (1, 8, 1)]  # (dp, pp, tp)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]  # (schedule, virtual_stages)
M_KINDS = ("pp", "2pp", "odd")
F32_TOL = 64 * testing.unit_roundoff(jnp.float32)  # as tests/test_parallel_step.py
FAST_COMPILE = {"xla_backend_optimization_level": 0}
CODEC = CompressionConfig(format="e4m3", group_size=32)


def _m(kind: str, pp: int) -> int:
  return {"pp": pp, "2pp": 2 * pp, "odd": 3}[kind]


def _tokens(n=BATCH):
  return jax.random.randint(jax.random.key(1), (n, SEQ + 1), 0, CFG.vocab_size)


def _leaves(tree):
  return [(jax.tree_util.keystr(p), np.asarray(x, np.float64))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _parallel(state):
  return layout_lib.to_parallel(nnx.state(state, nnx.Param).to_pure_dict())


@pytest.fixture(scope="module")
def reference():
  """(params, loss, grads) of the single-device model, params/grads in the parallel layout."""
  model = layout_lib.single_device_model(CFG, seed=0)
  gd, state = nnx.split(model)

  @jax.jit
  def value_and_grad(state, tokens):
    f = lambda st: loss_fn(nnx.merge(gd, st), tokens)[0]  # noqa: E731
    return jax.value_and_grad(f)(state)

  loss, grads = value_and_grad(state, _tokens())
  return _parallel(model), float(loss), jax.device_get(_parallel(grads))


def _check(reference, layout, schedule, v, m):
  ref_params, ref_loss, ref_grads = reference
  dp, pp, tp = layout
  tokens = _tokens()
  mesh = make_mesh(dp, pp, tp)
  params = layout_lib.shard_params(CFG, ref_params, mesh)
  spec = step_lib.ParallelSpec(CFG, dp, pp, tp, m, schedule=schedule, virtual_stages=v)
  tokens = jax.device_put(tokens, step_lib.batch_sharding(mesh))
  exe = jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens).compile(
      FAST_COMPILE)
  loss, grads = exe(params, tokens)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(jax.device_get(grads)), _leaves(ref_grads),
                               strict=True):
    err = np.max(np.abs(g - r))
    assert err <= F32_TOL * np.max(np.abs(r)), (schedule, layout, m, path, err)


def _rotated():
  """1F1B and interleaved on every mesh once; m's kind rotates so each schedule and each
  mesh meets m = pp, 2 pp and an odd m."""
  return [(lay, sch, v, M_KINDS[(i + 2 * j) % 3]) for j, lay in enumerate(MESHES)
          for i, (sch, v) in enumerate(SCHEDULES[1:])]


def _id(p):
  (dp, pp, tp), sch, v, kind = p
  return f"{sch}-dp{dp}-pp{pp}-tp{tp}-m={kind}"


@pytest.mark.parametrize("case", _rotated(), ids=_id)
def test_schedule_matches_single_device(reference, case):
  layout, schedule, v, kind = case
  _check(reference, layout, schedule, v, _m(kind, layout[1]))


_ALL = [(lay, sch, v, k) for lay, (sch, v), k in itertools.product(MESHES, SCHEDULES, M_KINDS)
        if (lay, sch, v, k) not in _rotated()]


@pytest.mark.slow
@pytest.mark.parametrize("case", _ALL, ids=_id)
def test_schedule_matches_single_device_every_m(reference, case):
  layout, schedule, v, kind = case
  _check(reference, layout, schedule, v, _m(kind, layout[1]))


PER_MICROBATCH = 2  # sequences per micro-batch of the compiled-program tests


@functools.cache
def _compiled(schedule, m, plan=CompressionPlan(), v=1):
  """(compiled step, its collectives) on (1, 2, 1), m micro-batches of PER_MICROBATCH."""
  mesh = make_mesh(1, 2, 1, devices=jax.devices()[:2])
  params = layout_lib.abstract_params(CFG, mesh)
  tokens = jax.ShapeDtypeStruct((m * PER_MICROBATCH, SEQ + 1), jnp.int32,
                                sharding=step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(CFG, 1, 2, 1, m, plan, schedule=schedule, virtual_stages=v)
  exe = jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens).compile(
      FAST_COMPILE)
  return exe, hlo.collectives(exe.as_text(), mesh)


def _handoffs(colls):
  """The pipeline hand-offs: collective-permutes of [micro-batch, T, D] activations (or
  their wire rows)."""
  return [c for c in colls if c.kind == "collective-permute" and c.axes == {"pipeline"}
          and c.shape[:2] == (PER_MICROBATCH, SEQ)]


def test_handoffs_are_u8_when_compressed_and_none_is_when_off():
  """1F1B: both directions' hand-offs (activations forward, their gradients back) move FP8
  wire rows with `compression.pp` on, and nothing in the step is u8 with it off (the
  interleaved schedule sends through the same two ppermutes, on a ring)."""
  _, off = _compiled("1f1b", 2)
  _, on = _compiled("1f1b", 2, CompressionPlan(pp=CODEC))
  assert len(_handoffs(off)) == 2 and all(c.dtype == "f32" for c in _handoffs(off))
  assert not [c.line for c in off if c.fp8]
  assert len(_handoffs(on)) == 2 and all(c.dtype == "u8" for c in _handoffs(on)), on
  assert not [c for c in on if c.fp8 and c.axes != {"pipeline"}]


def test_1f1b_memory_does_not_grow_with_the_microbatches():
  """At a fixed micro-batch size, GPipe's compiled temporaries grow by one micro-batch's
  activations per micro-batch (it keeps all m); 1F1B's do not grow from m = pp to 4 pp (it
  keeps at most 2 (pp - 1) = pp of them at pp = 2, in a fixed set of slots)."""
  temp = {(s, m): _compiled(s, m)[0].memory_analysis().temp_size_in_bytes
          for s in ("gpipe", "1f1b") for m in (2, 8)}
  per_microbatch = (temp["gpipe", 8] - temp["gpipe", 2]) / 6
  assert per_microbatch > 0
  assert temp["1f1b", 8] - temp["1f1b", 2] < per_microbatch / 4, (temp, per_microbatch)
  assert temp["1f1b", 8] < temp["gpipe", 2] + per_microbatch, temp


@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)])
def test_tick_tables(pp, v):
  """Every (micro-batch, chunk) runs forward once and backward once, each after what it
  depends on; 1F1B keeps at most 2 (pp - 1) micro-batches per stage whatever m, and the
  idle share is GPipe's for 1F1B and (pp - 1) / (v m + pp - 1) interleaved."""
  for m in (pp, 2 * pp, 4 * pp + 1):
    t = schedules.ticks(pp, v, m)
    fwd, bwd = {}, {}
    for tick, s in zip(*np.nonzero(t.fwd_mode)):
      fwd[t.fwd_mb[tick, s], t.fwd_chunk[tick, s] * pp + s] = tick
      if t.fwd_mode[tick, s] == schedules.FUSED:
        bwd[t.fwd_mb[tick, s], t.fwd_chunk[tick, s] * pp + s] = tick
    for tick, s in zip(*np.nonzero(t.bwd_on)):
      bwd[t.bwd_mb[tick, s], t.bwd_chunk[tick, s] * pp + s] = tick
    items = {(i, c) for i in range(m) for c in range(v * pp)}
    assert set(fwd) == items and set(bwd) == items
    for i, c in items:  # a hand-off is used the tick after it was sent
      assert c == 0 or fwd[i, c] == fwd[i, c - 1] + 1
      assert c == v * pp - 1 or bwd[i, c] == bwd[i, c + 1] + 1
    kept = schedules.kept_microbatches(t)
    assert t.slots == max(kept)
    if v == 1:
      assert kept == [min(m, 2 * (pp - 1 - s)) for s in range(pp)], kept
      assert np.isclose(schedules.bubble_fraction("1f1b", pp, m),
                        schedules.bubble_fraction("gpipe", pp, m))
    if m % pp == 0:
      assert np.isclose(schedules.bubble_fraction("interleaved", pp, m, v),
                        (pp - 1) / (v * m + pp - 1))


def test_schedule_errors():
  def errs(**kw):
    args = dict(dp=1, pp=2, tp=1, microbatches=2) | kw
    return "\n".join(mesh_lib.layout_errors(CFG, **args))

  assert errs(schedule="1f1b") == "" and errs(schedule="interleaved", virtual_stages=2) == ""
  assert "parallel.schedule='zb' must be one of ('gpipe', '1f1b', 'interleaved')" in errs(
      schedule="zb")
  assert "parallel.virtual_stages=2 needs parallel.schedule='interleaved'" in errs(
      schedule="1f1b", virtual_stages=2)
  assert "needs parallel.virtual_stages >= 2 chunks per stage, got 1" in errs(
      schedule="interleaved")
  assert "parallel.virtual_stages=0 must be a positive integer" in errs(virtual_stages=0)
  assert "needs parallel.pp >= 2, got 1" in errs(schedule="interleaved", virtual_stages=2,
                                                 pp=1)
  assert ("model.n_layers=16 is not divisible by parallel.pp * parallel.virtual_stages = "
          "2*3 = 6") in errs(schedule="interleaved", virtual_stages=3)
  assert "compression.log_errors=True measures the messages of the GPipe step" in errs(
      schedule="1f1b", log_errors=True)
  for overlap in ("ring", "kernel"):  # their permutes / barriers would hang in a branch
    assert f"where parallel.tp_overlap={overlap!r} cannot run" in errs(
        schedule="1f1b", tp_overlap=overlap)
  assert errs(schedule="gpipe", tp_overlap="ring") == ""
  with pytest.raises(ValueError, match=r"parallel.virtual_stages=2 needs parallel.schedule"):
    step_lib.ParallelSpec(CFG, 1, 2, 1, 2, virtual_stages=2)
