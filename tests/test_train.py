"""Trainer: loss falls, Ctrl-C + resume == uninterrupted, non-finite stop, CLI and sampling,
the optimizer's weight-decay mask."""
import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from taco_jax.configs import tiny
from taco_jax import data
from taco_jax.apps import sample
from taco_jax.tp import layout as layout_lib
from taco_jax.train import checkpoint, optim
from taco_jax.train.loop import NonFiniteLossError, train
from taco_jax.train.metrics import read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[1]


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


def test_interrupt_then_resume_equals_uninterrupted(tmp_path, cache_dir, monkeypatch):
  c = micro(cache_dir, steps=8, eval_every=4)
  straight = train(c, tmp_path / 'a')
  real_batch_at = data.batch_at

  def ctrl_c_at_step_3(tokens, step, **kw):
    if kw.get('stream', 0) == 0 and step == 3:
      signal.raise_signal(signal.SIGINT)  # Ctrl-C during step 4 (batch index 3)
    return real_batch_at(tokens, step, **kw)

  monkeypatch.setattr(data, 'batch_at', ctrl_c_at_step_3)
  first = train(c, tmp_path / 'b')
  assert first['status'] == 'interrupted' and first['last_checkpoint'] == 4
  monkeypatch.setattr(data, 'batch_at', real_batch_at)
  resumed = train(c, tmp_path / 'b')
  assert resumed['start_step'] == 4 and resumed['status'] == 'completed'
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
  (tmp_path / 'config.json').write_text(json.dumps(stored))
  longer = micro(cache_dir, steps=3)
  assert train(longer, tmp_path)['step'] == 3  # more steps: allowed, with a warning
  assert 'learning-rate schedule changes' in capsys.readouterr().err


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, cache_dir, monkeypatch):
  real_batch_at = data.batch_at

  def poisoned(tokens, step, **kw):  # out-of-range ids: the embedding lookup gives NaN
    b = real_batch_at(tokens, step, **kw)
    return b + 10_000 if kw.get('stream', 0) == 0 and step == 3 else b

  monkeypatch.setattr(data, 'batch_at', poisoned)
  with pytest.raises(NonFiniteLossError, match=r'at step 4.*checkpoint \(step 2\)'):
    train(micro(cache_dir, steps=8, checkpoint_every=2), tmp_path)
  ckpt = checkpoint.Checkpoints(tmp_path)
  assert ckpt.latest_step() == 2
  ckpt.close()


def test_cli_from_another_directory_then_sample(tmp_path, cache_dir):
  """`--config=configs/tiny.py` resolves to the installed configs when run elsewhere."""
  workdir = tmp_path / 'wd'
  overrides = ['n_layers=1', 'd_model=32', 'n_heads=2', 'd_ff=64', 'max_seq_len=16']
  args = [f'--config.model.{o}' for o in overrides] + [
      '--config.data.seq_len=16', '--config.data.batch_size=4',
      '--config.data.max_corpus_bytes=2000000', f'--config.data.cache_dir={cache_dir}',
      '--config.train.steps=3', '--config.optim.warmup_steps=1', '--config.train.eval_batches=1',
      '--config.train.progress_bar=False', '--cpu_devices=2']
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  proc = subprocess.run([sys.executable, '-m', 'taco_jax.train', '--config=configs/tiny.py',
                         f'--workdir={workdir}', *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout[proc.stdout.index('{'):])['step'] == 3
  model, step = sample.load_model(workdir)
  assert step == 3 and model.cfg.max_seq_len == 16
  out = sample.generate(model, data.encode('def'), 20, temperature=1.0, top_k=5)
  assert len(out) == 23 and list(out[:3]) == list(data.encode('def'))
  assert sample.generate(model, [1, 2], 3, temperature=0).tolist() == \
      sample.generate(model, [1, 2], 3, temperature=0).tolist()  # greedy is deterministic


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
  config_lib.validate_config(c)
  assert config_lib.notes(c) == ['optim.warmup_steps=50 > train.steps=10: the warm-up is '
                                 'clamped to the run (10 steps)']
  lr = optim.lr_schedule(c.optim, 10)
  assert float(lr(5)) == pytest.approx(c.optim.lr / 2, rel=1e-6)  # fp32 schedule
  assert float(lr(10)) == pytest.approx(c.optim.lr, rel=1e-6)
  assert metrics.peak_flops('NVIDIA H100 PCIe') == 756e12
  assert metrics.peak_flops('NVIDIA H200') == 989.4e12 and metrics.peak_flops('cpu') is None
  assert metrics.configured_peak(c.train, 'cpu') is None
  assert metrics.mfu(1e3, 1e6, None) is None
  c.train.peak_flops = 1e12
  assert metrics.mfu(1e3, 1e6, metrics.configured_peak(c.train, 'cpu')) == pytest.approx(1e-3)
