"""Trainer: loss falls, Ctrl-C + resume == uninterrupted, non-finite stop, checkpoints and
sampling, the optimizer's weight-decay mask. (The CLI, run from another directory, is the
README's: tests/test_readme.py.)"""
import json
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from taco_jax import data
from taco_jax.apps import sample
from taco_jax.configs import tiny
from taco_jax.models import model_config
from taco_jax.models.decoder import loss_fn
from taco_jax.models.gpt import GPT
from taco_jax.testing import reference
from taco_jax.tp import layout as layout_lib, step as step_lib
from taco_jax.tp.mesh import make_mesh
from taco_jax.train import checkpoint, optim, pgle, trainer
from taco_jax.train.trainer import NonFiniteLossError, train
from taco_jax.train.metrics import read_jsonl


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('corpus'))


def micro(cache_dir, **train):
  c = tiny.get_micro_config()
  c.data.cache_dir = cache_dir
  c.train.update(train)
  return c


def losses(workdir):
  return {r['step']: (r['loss'], r['grad_norm']) for r in read_jsonl(workdir / 'metrics.jsonl')
          if 'loss' in r}


def test_loss_falls(tmp_path, cache_dir):
  c = micro(cache_dir, steps=40, log_every=10)
  s = train(c, tmp_path)
  assert s['status'] == 'completed' and s['step'] == 40 and s['last_checkpoint'] == 40
  assert s['attention'] == 'xla'  # model.attention=auto on CPU
  first = read_jsonl(tmp_path / 'metrics.jsonl')[0]['loss']
  assert first > 5.0 and s['train_loss'] < 3.6 and s['val_loss'] < 3.8  # ln 256 = 5.55
  assert json.loads((tmp_path / 'config.json').read_text())['model']['d_model'] == 32


def test_interrupt_then_resume_equals_uninterrupted(tmp_path, cache_dir, monkeypatch, capsys):
  """...with PGLE and XLA's overlap options on in the interrupted run: its steps 2-3 are
  profiled, the step compiled again for step 4 on, and the resumed run compiles once, with
  the profile cached in its workdir (under the options it was compiled with). Off GPU the
  profile is empty: a stand-in takes its place, which the CPU compiler accepts and ignores."""
  c = micro(cache_dir, steps=8, eval_every=4)
  straight = train(c, tmp_path / 'a')
  real_batch_at, real_stop = data.batch_at, pgle.Trace.stop

  def ctrl_c_at_step_3(tokens, step, **kw):
    if kw.get('stream', 0) == 0 and step == 3:
      signal.raise_signal(signal.SIGINT)  # Ctrl-C during step 4 (batch index 3)
    return real_batch_at(tokens, step, **kw)

  monkeypatch.setattr(data, 'batch_at', ctrl_c_at_step_3)
  monkeypatch.setattr(pgle.Trace, 'stop', lambda self: real_stop(self) or b'profile')
  c.parallel.update(pgle=True, xla_overlap=True, collectives_in_flight=2)
  first = train(c, tmp_path / 'b')
  assert first['status'] == 'interrupted' and first['last_checkpoint'] == 4
  assert first['pgle']['status'] == 'profiled' and first['pgle']['profiled_steps'] == [2, 3]
  assert 'PGLE: profiling steps 2..3' in capsys.readouterr().out
  monkeypatch.setattr(data, 'batch_at', real_batch_at)
  resumed = train(c, tmp_path / 'b')
  assert resumed['start_step'] == 4 and resumed['status'] == 'completed'
  out = capsys.readouterr().out
  assert f"resumed from step 4 in {tmp_path / 'b'}" in out
  assert f"PGLE: step compiled with the profile cached in {tmp_path / 'b' / 'pgle'}" in out
  assert resumed['pgle']['status'] == 'cached' and resumed['xla_options'] == first['xla_options']
  key = json.loads((tmp_path / 'b' / 'pgle' / 'key.json').read_text())
  assert key['options'][step_lib.COLLECTIVES_IN_FLIGHT] == 2  # what the step compiled with
  a, b = losses(tmp_path / 'a'), losses(tmp_path / 'b')
  assert sorted(a) == sorted(b) == list(range(1, 9))
  np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(resumed['val_loss'], straight['val_loss'], rtol=1e-6)


def test_resume_refuses_a_different_seed_data_or_optimizer(tmp_path, cache_dir, capsys):
  c = micro(cache_dir, steps=2)
  train(c, tmp_path)
  for section, field, value in [(None, 'seed', 7), ('data', 'batch_size', 4),
                                ('data', 'include', '*.py'), ('optim', 'lr', 1e-4)]:
    changed = micro(cache_dir, steps=2)
    (changed if section is None else changed[section])[field] = value
    with pytest.raises(ValueError, match=f'different {section or field}'):
      train(changed, tmp_path)
  stored = json.loads((tmp_path / 'config.json').read_text())
  del stored['data']['include']  # a run stored before the field existed had its default
  for family in ('tp_forward', 'tp_backward', 'pp', 'dp', 'sites'):  # so did these
    del stored['compression'][family]
  (tmp_path / 'config.json').write_text(json.dumps(stored))
  longer = micro(cache_dir, steps=3)
  assert train(longer, tmp_path)['step'] == 3  # more steps: allowed, with a warning
  assert 'learning-rate schedule changes' in capsys.readouterr().err


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, cache_dir, monkeypatch):
  real_batch_at, real_step = data.batch_at, step_lib.make_train_step

  def poisoned(tokens, step, **kw):  # out-of-range ids, which the step below turns into NaN
    b = real_batch_at(tokens, step, **kw)
    return b + 10_000 if kw.get('stream', 0) == 0 and step == 3 else b

  def nan_on_poison(*args, **kw):
    step = real_step(*args, **kw)

    def f(params, opt_state, tokens):
      params, opt_state, m = step(params, opt_state, tokens)
      return params, opt_state, {**m, 'loss': jnp.where(tokens.max() > 255, jnp.nan, m['loss'])}
    return f

  monkeypatch.setattr(data, 'batch_at', poisoned)
  monkeypatch.setattr(step_lib, 'make_train_step', nan_on_poison)
  with pytest.raises(NonFiniteLossError, match=r'at step 4.*checkpoint \(step 2\)'):
    train(micro(cache_dir, steps=8, checkpoint_every=2), tmp_path)
  ckpt = checkpoint.Checkpoints(tmp_path)
  assert ckpt.latest_step() == 2
  ckpt.close()


def test_decay_mask_spares_stacked_norms():
  """Zero grads: AdamW moves only the decayed leaves (by lr * weight_decay * p)."""
  o = tiny.get_micro_config().optim
  o.update(warmup_steps=0, weight_decay=0.5, grad_clip=0.0)
  params = {'blocks': {'ln1': {'scale': jnp.ones((2, 4))}, 'w': jnp.ones((2, 4, 4))},
            'wte': jnp.ones((8, 4))}

  def after_one_step(decay_mask=None):
    tx = optim.make_optimizer(o, 10, decay_mask)
    upd, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.tree.map(lambda x: bool(jnp.all(x < 1)), optax.apply_updates(params, upd))

  decayed = {'blocks': {'ln1': {'scale': False}, 'w': True}, 'wte': True}
  assert after_one_step(layout_lib.decay_mask) == decayed  # callable mask
  assert after_one_step(decayed) == decayed  # pytree of bools
  assert after_one_step()['blocks']['ln1']['scale']  # default (ndim >= 2) decays the stacked norm


def test_stop_message_names_only_what_exists():
  from taco_jax.train.runner import nonfinite_message
  rec = {'loss': float('nan'), 'grad_norm': 1.0}
  msg = nonfinite_message(rec, 3, None, '/w/checkpoints', 'float32')
  assert 'No checkpoint was saved before it' in msg and 'step None' not in msg
  assert 'float32' not in msg and 'then resume' not in msg
  msg = nonfinite_message(rec, 3, 2, '/w/checkpoints', 'bfloat16')
  assert 'checkpoint (step 2) in /w/checkpoints is kept' in msg
  assert 'use model.dtype=float32 (now bfloat16), then resume' in msg


def test_short_runs_clamp_the_warm_up_and_mfu_needs_a_known_peak():
  from taco_jax.train import config as config_lib, metrics
  c = tiny.get_config()
  c.train.steps = 10  # warmup_steps = 50
  config_lib.validate(c)
  assert config_lib.notes(c) == ['optim.warmup_steps=50 > train.steps=10: the warm-up is '
                                 'clamped to the run (10 steps)']
  c.parallel.update(tp=2, tp_overlap="kernel")
  assert "launch outside XLA's CUDA graphs" in config_lib.notes(c)[-1]
  lr = optim.lr_schedule(c.optim, 10)
  assert float(lr(5)) == pytest.approx(c.optim.lr / 2, rel=1e-6)  # fp32 schedule
  assert float(lr(10)) == pytest.approx(c.optim.lr, rel=1e-6)
  assert metrics.peak_flops('NVIDIA H100 PCIe') == 756e12
  assert metrics.peak_flops('NVIDIA H200') == 989.4e12 and metrics.peak_flops('cpu') is None
  assert metrics.configured_peak(c.train, 'cpu') is None
  assert metrics.mfu(1e3, 1e6, None) is None
  c.train.peak_flops = 1e12
  assert metrics.mfu(1e3, 1e6, metrics.configured_peak(c.train, 'cpu')) == pytest.approx(1e-3)


def test_metrics_go_to_jsonl_without_tensorboardx(tmp_path, monkeypatch):
  from taco_jax.train import metrics
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)  # import fails as if not installed
  w = metrics.MetricsWriter(tmp_path)
  w.write(1, loss=2.5)
  w.close()
  assert read_jsonl(tmp_path / 'metrics.jsonl') == [{'step': 1, 'loss': 2.5}]
  assert not (tmp_path / 'tb').exists()


def test_loss_curve_is_the_single_device_models(tmp_path, cache_dir):
  """From the same seed and batches, the trainer (one device: the mesh (1, 1, 1)) follows
  the loss curve of `models.gpt` trained by a plain jitted step with the same optimizer."""
  c = micro(cache_dir, steps=6)
  train(c, tmp_path)
  tx = optim.make_optimizer(c.optim, c.train.steps)  # decays ndim >= 2: the same leaves
  graphdef, params, opt_state = reference.init_state(c.model, c.seed, tx)
  step, corpus, want = jax.jit(reference.train_step(graphdef, tx)), trainer.load_data(c), []
  for i in range(c.train.steps):
    params, opt_state, m = step(params, opt_state, data.batch_at(
        corpus.train, i, seed=c.seed, batch_size=c.data.batch_size, seq_len=c.data.seq_len))
    want.append(float(m['loss']))
  got = [losses(tmp_path)[s][0] for s in range(1, c.train.steps + 1)]
  np.testing.assert_allclose(got, want, rtol=2e-5)


MESHES = [(1, 1, 1), (8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2)]
# (4, 2, 1) adds no trainer path of its own: the trainer pipelines in (2, 2, 2) here, and a
# pipeline without tensor parallelism equals the single-device model in
# test_pipeline_schedules ((1, 8, 1)); nor does (8, 1, 1): (4, 1, 2) and (2, 2, 2) train over
# "data" here, and the step over "data" alone equals the single-device model in
# test_parallel_step ((8, 1, 1))
SLOW_MESHES = {(4, 2, 1), (8, 1, 1)}


@pytest.mark.parametrize('dp,pp,tp', [
    pytest.param(*m, id=f'{m}', marks=[pytest.mark.slow] if m in SLOW_MESHES else [])
    for m in MESHES])
def test_every_mesh_same_output_resume_and_checkpoint(tmp_path, cache_dir, capsys, dp, pp, tp):
  """Every mesh prints the same lines, writes the same checkpoint layout (global arrays),
  computes the single-device model's first loss and is read by `sample`; on eight devices
  the run resumes with the message test_interrupt_then_resume_equals_uninterrupted checks
  on one. (4, 1, 2) shards its optimizer over "data" (`parallel.shard_optimizer`)."""
  c = micro(cache_dir, steps=1, eval_batches=1)
  c.parallel.update(dp=dp, pp=pp, tp=tp, microbatches=2 if pp > 1 else 1,
                    shard_optimizer=(dp, pp, tp) == (4, 1, 2))
  first = train(c, tmp_path)
  out = capsys.readouterr().out.splitlines()
  n = dp * pp * tp
  assert out[0].startswith(f'micro: 34,688 params on {n} cpu device{"s" if n > 1 else ""}, '
                           f'mesh data={dp} x pipeline={pp} x tensor={tp}; workdir ')
  assert out[1].startswith('  python stdlib') and 'step compiled in' in out[1]
  how = 'sharded' if c.parallel.shard_optimizer else 'replicated'
  assert out[2].startswith('  memory per device: params ') and f'({how} over data)' in out[2]
  assert first['opt_state_bytes_per_device'] < 2.1 * first['params_bytes_per_device'] / (
      dp if c.parallel.shard_optimizer else 1)
  ckpt = checkpoint.Checkpoints(tmp_path)
  assert ckpt.restore_meta(1) == {'step': 1, 'mesh': {'data': dp, 'pipeline': pp, 'tensor': tp}}
  one_device = layout_lib.abstract_params(layout_lib.model_config(c.model),
                                          make_mesh(1, 1, 1, jax.devices()[:1]))
  assert ckpt.stored_shapes(1) == jax.tree.map(lambda x: tuple(x.shape), one_device)
  ckpt.close()
  model = GPT(model_config(c.model), rngs=nnx.Rngs(params=c.seed))
  corpus = trainer.load_data(c)
  loss0 = loss_fn(model, data.batch_at(corpus.train, 0, seed=c.seed, batch_size=8,
                                       seq_len=c.data.seq_len))[0]
  np.testing.assert_allclose(first['train_loss'], float(loss0), rtol=1e-5)
  assert sample.load_model(tmp_path)[1] == 1  # `sample` reads a run of any mesh
  if n == 8:  # one code path on every mesh; one device: test_interrupt_then_resume_...
    c.train.steps = 2
    second = train(c, tmp_path)
    assert second['start_step'] == 1 and second['step'] == 2
    assert f'resumed from step 1 in {tmp_path}' in capsys.readouterr().out


def test_a_checkpoint_of_replicated_arrays_compiles_nothing(tmp_path):
  """Saving an array replicated over 8 devices, then restoring it: orbax's per-replica
  slices would compile a program per device on the first save (`checkpoint`). A program
  the suite's persistent compilation cache hands back counts as compiled too."""
  mesh = make_mesh(8, 1, 1)
  x = jax.device_put(jnp.arange(128.0).reshape(16, 8) + 0.5, jax.NamedSharding(mesh, jax.P()))
  compiles = []
  compiled = ("/jax/core/compile/backend_compile_duration",
              "/jax/compilation_cache/cache_retrieval_time_sec")

  def count(event, _secs, **_):
    compiles.extend([event] if event in compiled else [])
  ckpt = checkpoint.Checkpoints(tmp_path)
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    ckpt.save(1, {"w": x}, {"m": x}, {"step": 1})
    ckpt.wait()
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert compiles == []
  params, opt_state, meta = ckpt.restore(1, {"w": x}, {"m": x})
  ckpt.close()
  np.testing.assert_array_equal(params["w"], x)
  assert opt_state["m"].sharding == x.sharding and meta == {"step": 1}


def test_checkpoints_of_the_old_single_device_trainer_load(tmp_path):
  """A workdir of taco-jax 0.1's single-device trainer (one nnx state per model, metadata
  without a mesh) restores stacked, moments included, and `sample` reads it."""
  c = tiny.get_micro_config()
  cfg = model_config(c.model)
  params = nnx.state(GPT(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  tx_old = optim.make_optimizer(c.optim, c.train.steps)  # its decay mask: ndim >= 2
  opt_state = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, tx_old.init(params))
  ckpt = checkpoint.Checkpoints(tmp_path)
  ckpt.save(3, params, opt_state, {'step': 3, 'seed': 0, 'data': c.data.to_dict()})
  ckpt.wait()
  (tmp_path / 'config.json').write_text(json.dumps(c.to_dict()))
  mesh = make_mesh(1, 1, 1, jax.devices()[:1])
  tx = trainer.make_optimizer(c.optim, c.train.steps)
  p_abs = layout_lib.abstract_params(cfg, mesh)
  got, got_opt = checkpoint.restore_state(ckpt, 3, cfg, p_abs,
                                          trainer.opt_state_target(tx, p_abs, mesh), tx)
  ckpt.close()
  want = layout_lib.to_parallel(nnx.to_pure_dict(params))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  jax.tree.map(lambda m, p: np.testing.assert_array_equal(m, np.ones_like(p)),
               got_opt[1][0].mu, want)  # adamw's first moment, stacked like the params
  model, step = sample.load_model(tmp_path)
  assert step == 3
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
               nnx.to_pure_dict(params))
  # generation runs past the model's context (the README's `sample` command runs the CLI)
  prompt = data.encode('def')
  out = sample.generate(model, prompt, model.cfg.max_seq_len + 4, temperature=1.0, top_k=5)
  assert len(out) == len(prompt) + model.cfg.max_seq_len + 4 and list(out[:3]) == list(prompt)
  assert sample.generate(model, [1, 2], 3, temperature=0).tolist() == \
      sample.generate(model, [1, 2], 3, temperature=0).tolist()  # greedy is deterministic


def test_moved_modules_name_their_new_place():
  with pytest.raises(ModuleNotFoundError, match=r'taco_jax.parallel moved: use taco_jax.tp '
                     r'\(model -> taco_jax.tp.layout; train -> taco_jax.train'):
    import taco_jax.parallel.model  # noqa: F401
  with pytest.raises(ModuleNotFoundError, match='taco_jax.sample moved: use taco_jax.apps.sample'):
    import taco_jax.sample  # noqa: F401
