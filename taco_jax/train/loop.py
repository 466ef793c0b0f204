"""The single-device training loop: `train(config, workdir) -> summary`.

Order of work: validate the config, load and check the data (all errors before any
compilation), store config.json, build or restore (params, opt_state), compile the step,
then loop. Batch i is `data.batch_at(train_tokens, i, seed=config.seed, ...)`, so resuming
from a checkpoint at step k continues with exactly the batches (and losses) of an
uninterrupted run. The steps run in `taco_jax.train.runner.run_steps` (shared with the
3D-parallel trainer): Ctrl-C stops at the next step boundary and saves a checkpoint; a
non-finite loss or grad norm raises `NonFiniteLossError` without saving the bad state.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
from absl import logging
from tqdm import tqdm

from taco_jax.models import model_config
from taco_jax.models.decoder import flops_per_token
from taco_jax import data
from taco_jax.train import checkpoint, metrics, optim, step as step_lib
from taco_jax.train.config import config_to_json, parallel_reason, validate_config
# NonFiniteLossError is imported from here by the CLI and the tests.
from taco_jax.train.runner import (NonFiniteLossError, corpus_line, finished_summary,  # noqa: F401
                                   run_header, run_steps, start_message)


def load_data(config) -> data.Corpus:
  """The config's corpus, checked against its sequence length and vocabulary."""
  d = config.data
  corpus = data.load_corpus(d.path, cache_dir=d.cache_dir or data.default_cache_dir(),
                            val_fraction=d.val_fraction, max_corpus_bytes=d.max_corpus_bytes,
                            bin_dtype=d.bin_dtype, include=d.get('include', '*'))
  data.check_corpus(corpus, seq_len=d.seq_len, vocab_size=config.model.vocab_size)
  return corpus


# Sections whose change would make a resumed run differ from an uninterrupted one.
RESUME_MUST_MATCH = ('model', 'seed', 'data', 'optim', 'compression')
# Fields that change nothing a run computes: where the corpus cache lives, whether the
# compression error is also measured.
_RESUME_IGNORED = {('data', 'cache_dir'), ('compression', 'log_errors')}
# Fields added after runs were stored: a config.json without them had their default.
_ADDED_LATER = {('data', 'include'): '*'}


def _resume_view(c: dict) -> dict:
  view = {k: ({f: v for f, v in c[k].items() if (k, f) not in _RESUME_IGNORED}
              if isinstance(c.get(k), dict) else c.get(k)) for k in RESUME_MUST_MATCH}
  for (k, f), default in _ADDED_LATER.items():
    if isinstance(view.get(k), dict):
      view[k].setdefault(f, default)
  return view


def _differences(before: dict, after: dict, sections) -> str:
  """'optim.lr 0.002 -> 0.001, ...' for the fields of `sections` that differ (the first few)."""
  def flat(d, p):
    if not isinstance(d, dict):
      return {p: d}
    return {f: v for k, x in d.items() for f, v in flat(x, f'{p}.{k}').items()}

  out = []
  for k in sections:
    b, a = flat(before[k], k), flat(after[k], k)
    out += [f'{f} {b.get(f)!r} -> {a.get(f)!r}' for f in sorted(set(b) | set(a))
            if b.get(f) != a.get(f)]
  return ', '.join(out[:4]) + (f' and {len(out) - 4} more' if len(out) > 4 else '')


def store_config(config, workdir: pathlib.Path, has_checkpoint: bool) -> None:
  """Writes workdir/config.json. Resuming a checkpoint with a different model, seed, data,
  optimizer or compression is an error (the run would not continue as it began); a
  different `train.steps` is allowed with a warning (the learning-rate schedule is
  reshaped)."""
  path = workdir / 'config.json'
  if has_checkpoint and path.exists():
    old = json.loads(path.read_text())
    new = json.loads(config_to_json(config))
    before, after = _resume_view(old), _resume_view(new)
    changed = [k for k in RESUME_MUST_MATCH if before[k] != after[k]]
    if changed:
      raise ValueError(
          f'{workdir} holds checkpoints of {old.get("name", "a run")!r} with different '
          f'{", ".join(changed)} settings ({_differences(before, after, changed)}); '
          'give this run its own --workdir, or the same settings to resume that one')
    if old.get('train', {}).get('steps') != new['train']['steps']:
      print(f'warning: resuming with train.steps={new["train"]["steps"]} (was '
            f'{old.get("train", {}).get("steps")}): the learning-rate schedule changes',
            file=sys.stderr)
  path.write_text(config_to_json(config))


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
  mcfg, d, t = model_config(config.model), config.data, config.train
  corpus = load_data(config)
  ckpt = checkpoint.Checkpoints(workdir, keep=t.keep_checkpoints)
  start = ckpt.latest_step() or 0
  store_config(config, workdir, has_checkpoint=start > 0)
  if start >= t.steps:
    ckpt.close()
    tqdm.write(f'{config.name}: {start_message(workdir, start, t.steps)}')
    return finished_summary(workdir, start)
  tx = optim.make_optimizer(config.optim, t.steps)
  if start:
    graphdef, p_abs, o_abs = step_lib.abstract_state(mcfg, tx)
    params, opt_state, _ = ckpt.restore(start, _on_device(p_abs), _on_device(o_abs))
  else:
    graphdef, params, opt_state = step_lib.init_state(step_lib.build_model(mcfg, config.seed), tx)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  tqdm.write(run_header(config.name, n_params, workdir))
  if start:
    tqdm.write(start_message(workdir, start, t.steps))
  fpt = flops_per_token(mcfg, d.seq_len)
  attention = mcfg.attention_backend(d.seq_len)
  tokens_per_step = d.batch_size * d.seq_len
  batch = lambda i, stream=0, src=corpus.train: data.batch_at(
      src, i, seed=config.seed, stream=stream, batch_size=d.batch_size, seq_len=d.seq_len)
  t0 = time.perf_counter()
  train_step = jax.jit(step_lib.make_train_step(graphdef, tx), donate_argnums=(0, 1)).lower(
      params, opt_state, batch(start)).compile()
  eval_step = jax.jit(step_lib.make_eval_step(graphdef))
  compile_s = time.perf_counter() - t0
  tqdm.write(f'  {corpus_line(corpus)}, {fpt:.3g} FLOPs/token, {attention} attention; step '
             f'compiled in {compile_s:.1f}s')
  writer = metrics.MetricsWriter(workdir, start)
  pbar = tqdm(total=t.steps, initial=start, disable=not t.progress_bar, dynamic_ncols=True,
              desc=config.name)
  summary = {'workdir': str(workdir), 'start_step': start, 'n_params': n_params,
             'attention': attention, 'compile_s': compile_s, 'train_loss': None,
             'val_loss': None, 'tokens_per_s': None, 'mfu': None}
  peak = metrics.configured_peak(t, jax.devices()[0].device_kind)
  t_start = time.perf_counter()
  run_steps(params, opt_state, start=start, train_cfg=t, train_step=train_step,
            eval_step=eval_step, train_batch=batch, val_batch=lambda i: batch(i, 1, corpus.val),
            ckpt=ckpt, checkpoint_meta=lambda s: {'step': s, 'seed': config.seed,
                                                  'data': d.to_dict()},
            schedule=optim.lr_schedule(config.optim, t.steps), tokens_per_step=tokens_per_step,
            mfu=lambda tps: metrics.mfu(tps, fpt, peak), summary=summary,
            writer=writer, pbar=pbar, model_dtype=config.model.dtype)
  summary['wall_s'] = time.perf_counter() - t_start
  metrics.write_summary(workdir / 'summary.json', summary)
  return summary
