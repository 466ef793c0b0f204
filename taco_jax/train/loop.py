"""The single-device training loop: `train(config, workdir) -> summary`.

Order of work: validate the config, load and check the data (all errors before any
compilation), store config.json, build or restore (params, opt_state), compile the step,
then loop. Batch i is `data.batch_at(train_tokens, i, seed=config.seed, ...)`, so resuming
from a checkpoint at step k continues with exactly the batches (and losses) of an
uninterrupted run. Ctrl-C stops at the next step boundary and saves a checkpoint; a
non-finite loss or grad norm raises `NonFiniteLossError` without saving the bad state.
"""
from __future__ import annotations

import contextlib
import json
import math
import pathlib
import signal
import threading
import time

import jax
import numpy as np
from absl import logging
from tqdm import tqdm

from models.gpt import GPTConfig, flops_per_token
from taco_jax import data
from taco_jax.train import checkpoint, metrics, optim, step as step_lib
from taco_jax.train.config import config_to_json, parallel_reason, validate_config


class NonFiniteLossError(RuntimeError):
  """The loss (or gradient norm) became NaN/inf; the last good checkpoint is kept."""


def load_data(config, workdir) -> data.Corpus:
  d = config.data
  corpus = data.load_corpus(d.path, cache_dir=d.cache_dir or workdir,
                            val_fraction=d.val_fraction, max_corpus_bytes=d.max_corpus_bytes,
                            bin_dtype=d.bin_dtype)
  data.check_corpus(corpus, seq_len=d.seq_len, vocab_size=config.model.vocab_size)
  return corpus


def store_config(config, workdir: pathlib.Path, has_checkpoint: bool) -> None:
  """Writes workdir/config.json; refuses to resume a checkpoint of a different model."""
  path = workdir / 'config.json'
  if has_checkpoint and path.exists():
    old = json.loads(path.read_text()).get('model')
    if old != config.model.to_dict():
      raise ValueError(f'{workdir} holds checkpoints of a different model ({old}); use a new '
                       '--workdir or the same config.model')
  path.write_text(config_to_json(config))


@contextlib.contextmanager
def sigint_as_flag():
  """Within: the first Ctrl-C sets the returned event; a second one interrupts at once."""
  stop = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield stop
    return

  def handler(signum, frame):
    if stop.is_set():
      raise KeyboardInterrupt
    stop.set()

  old = signal.signal(signal.SIGINT, handler)
  try:
    yield stop
  finally:
    signal.signal(signal.SIGINT, old)


def _on_device(tree):
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), tree)


def train(config, workdir: str | pathlib.Path) -> dict:
  """Trains (or resumes) per `config` in `workdir`; returns a summary dict."""
  validate_config(config)
  why = parallel_reason(config)
  if why:
    raise ValueError(f'{why}: this single-device loop cannot run it; `python -m taco_jax.train` '
                     '(taco_jax.train.cli.train) runs it on the 3D-parallel trainer')
  if config.compression.enabled:
    logging.warning('compression.enabled has no effect on a single device (no TP traffic)')
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  mcfg, d, t = GPTConfig.from_dict(config.model), config.data, config.train
  corpus = load_data(config, workdir)
  ckpt = checkpoint.Checkpoints(workdir, keep=t.keep_checkpoints)
  start = ckpt.latest_step() or 0
  store_config(config, workdir, has_checkpoint=start > 0)
  tx = optim.make_optimizer(config.optim, t.steps)
  if start:
    graphdef, p_abs, o_abs = step_lib.abstract_state(mcfg, tx)
    params, opt_state, _ = ckpt.restore(start, _on_device(p_abs), _on_device(o_abs))
    tqdm.write(f'resumed from {ckpt.directory} at step {start}')
  else:
    graphdef, params, opt_state = step_lib.init_state(step_lib.build_model(mcfg, config.seed), tx)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  fpt = flops_per_token(mcfg, d.seq_len)
  tokens_per_step = d.batch_size * d.seq_len
  batch = lambda i: data.batch_at(corpus.train, i, seed=config.seed, batch_size=d.batch_size,
                                  seq_len=d.seq_len)
  t0 = time.perf_counter()
  train_step = jax.jit(step_lib.make_train_step(graphdef, tx), donate_argnums=(0, 1)).lower(
      params, opt_state, batch(start)).compile()
  eval_step = jax.jit(step_lib.make_eval_step(graphdef))
  compile_s = time.perf_counter() - t0
  tqdm.write(f'{config.name}: {n_params:,} params, {fpt:.3g} FLOPs/token; corpus {corpus.source} '
             f'({len(corpus.train):,} train / {len(corpus.val):,} val tokens); step compiled in '
             f'{compile_s:.1f}s; workdir {workdir}')
  schedule = optim.lr_schedule(config.optim, t.steps)
  metrics.truncate_after(workdir / 'metrics.jsonl', start)
  writer = metrics.MetricsWriter(workdir)
  pbar = tqdm(total=t.steps, initial=start, disable=not t.progress_bar, dynamic_ncols=True,
              desc=config.name)
  summary = {'workdir': str(workdir), 'start_step': start, 'n_params': n_params,
             'compile_s': compile_s, 'train_loss': math.nan, 'val_loss': math.nan,
             'tokens_per_s': math.nan, 'mfu': math.nan}
  pending, clock = [], [time.perf_counter()]

  def flush():
    """Fetches pending step metrics, checks them, writes them."""
    if not pending:
      return
    host = jax.device_get([m for _, m in pending])
    dt = time.perf_counter() - clock[0]
    tps = len(pending) * tokens_per_step / dt
    for (s, _), m in zip(pending, host):
      rec = {k: float(v) for k, v in m.items()}
      rec.update(lr=float(schedule(s - 1)), tokens_per_s=tps,
                 mfu=metrics.mfu(tps, fpt, t.peak_flops))
      writer.write(s, **rec)
      if not (math.isfinite(rec['loss']) and math.isfinite(rec['grad_norm'])):
        pending.clear()
        raise NonFiniteLossError(
            f'loss={rec["loss"]} grad_norm={rec["grad_norm"]} at step {s}: stopping. The last '
            f'good checkpoint (step {ckpt.latest_step()}) in {ckpt.directory} is kept; lower '
            'optim.lr, raise optim.warmup_steps or use model.dtype=float32, then resume.')
    summary.update(train_loss=rec['loss'], tokens_per_s=tps, mfu=rec['mfu'])
    pbar.update(len(pending))
    pbar.set_postfix(loss=f'{rec["loss"]:.3f}', tok_s=f'{tps:.3g}', mfu=f'{rec["mfu"]:.2%}')
    pending.clear()
    clock[0] = time.perf_counter()

  def evaluate(s):
    losses = [eval_step(params, data.batch_at(corpus.val, i, seed=config.seed, stream=1,
                                              batch_size=d.batch_size, seq_len=d.seq_len))
              for i in range(t.eval_batches)]
    summary['val_loss'] = float(np.mean(jax.device_get(losses)))
    writer.write(s, val_loss=summary['val_loss'])
    pbar.write(f'step {s}: val_loss {summary["val_loss"]:.4f}')

  def save(s):
    flush()
    ckpt.save(s, params, opt_state, {'step': s, 'seed': config.seed, 'data': d.to_dict()})

  s, status, t_start = start, 'completed', time.perf_counter()
  try:
    with sigint_as_flag() as stop:
      while s < t.steps and not stop.is_set():
        params, opt_state, m = train_step(params, opt_state, batch(s))
        s += 1
        pending.append((s, m))
        if s % t.log_every == 0:
          flush()
        if t.eval_every and s % t.eval_every == 0 and s < t.steps:
          flush()
          evaluate(s)
          clock[0] = time.perf_counter()  # keep eval time out of the throughput
        if t.checkpoint_every and s % t.checkpoint_every == 0 and s < t.steps:
          save(s)
          clock[0] = time.perf_counter()
      if stop.is_set():
        status = 'interrupted'
        pbar.write(f'interrupted at step {s}: saving a checkpoint')
      else:
        flush()
        evaluate(s)
      save(s)
  except KeyboardInterrupt:  # a second Ctrl-C, or raised inside a step
    status = 'interrupted'
    if not any(x.is_deleted() for x in jax.tree.leaves((params, opt_state))):
      save(s)
  finally:
    pbar.close()
    ckpt.wait()
    ckpt.close()
    writer.close()
  summary.update(status=status, step=s, last_checkpoint=ckpt.latest_step(),
                 wall_s=time.perf_counter() - t_start)
  (workdir / 'summary.json').write_text(json.dumps(summary, indent=2))
  return summary
