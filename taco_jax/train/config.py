"""Config checks, config-file resolution and the config.json the trainer stores.

`validate_config` runs before anything is built or compiled and names the field at fault
and what to change. `parallel_reason` says whether a config needs the 3D-parallel trainer
(`taco_jax.train.cli.train` picks the trainer by it).
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import ml_collections

from taco_jax.models import model_config


def _checks(c, mcfg) -> list[str]:
  """The model section's checks are the model config's own (`DecoderConfig.errors`)."""
  d, o, t = c.data, c.optim, c.train
  errs = []

  def need(ok, msg):
    if not ok:
      errs.append(msg)

  for sec, names in (('data', ('seq_len', 'batch_size', 'max_corpus_bytes')),
                     ('train', ('steps', 'log_every', 'eval_batches')),
                     ('parallel', ('dp', 'pp', 'tp'))):
    for n in names:
      v = c[sec][n]
      need(isinstance(v, int) and v > 0, f'{sec}.{n}={v!r} must be a positive integer')
  if errs:  # the checks below compare these
    return mcfg.errors() + errs
  errs.extend(mcfg.errors(d.seq_len))
  need(0 < d.val_fraction < 1, f'data.val_fraction={d.val_fraction} must be in (0, 1)')
  need(d.bin_dtype in ('uint8', 'uint16'), f'data.bin_dtype={d.bin_dtype!r}: use uint8|uint16')
  need(math.isfinite(o.lr) and o.lr > 0, f'optim.lr={o.lr} must be a positive number')
  need(0 <= o.min_lr_ratio <= 1, f'optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]')
  need(isinstance(o.warmup_steps, int) and o.warmup_steps >= 0,
       f'optim.warmup_steps={o.warmup_steps!r} must be an integer >= 0')
  need(o.weight_decay >= 0, f'optim.weight_decay={o.weight_decay} must be >= 0')
  need(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f'optim.b1={o.b1}, optim.b2={o.b2} must be in [0, 1)')
  need(o.eps > 0, f'optim.eps={o.eps} must be > 0')
  need(o.grad_clip >= 0, f'optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)')
  for n in ('eval_every', 'checkpoint_every'):
    need(isinstance(t[n], int) and t[n] >= 0, f'train.{n}={t[n]!r} must be an integer >= 0 '
         '(0 = only at the end)')
  need(t.keep_checkpoints >= 1, f'train.keep_checkpoints={t.keep_checkpoints} must be >= 1')
  need(t.peak_flops >= 0, f'train.peak_flops={t.peak_flops} must be >= 0 (0 = from the device)')
  return errs


def validate_config(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError listing every invalid field (with what to change)."""
  for sec in ('model', 'data', 'optim', 'train', 'parallel', 'compression'):
    if sec not in c:
      raise ValueError(f'config has no {sec!r} section; start from configs.common.base_config')
  try:
    mcfg = model_config(c.model)
  except (TypeError, ValueError) as e:
    raise ValueError(f'bad model section: {e}') from e
  errs = _checks(c, mcfg)
  if not errs:
    try:  # e.g. model.attention=cudnn where cuDNN cannot run it
      mcfg.attention_backend(c.data.seq_len)
    except ValueError as e:
      errs.append(str(e))
  if errs:
    raise ValueError('invalid config:\n  ' + '\n  '.join(errs))


def notes(c: ml_collections.ConfigDict) -> list[str]:
  """What the trainer changes of a valid config, to be said before it runs."""
  o, t = c.optim, c.train
  out = []
  if o.warmup_steps > t.steps:
    out.append(f'optim.warmup_steps={o.warmup_steps} > train.steps={t.steps}: the warm-up is '
               f'clamped to the run ({t.steps} steps)')
  return out


def parallel_reason(c: ml_collections.ConfigDict) -> str:
  """Why `c` needs the 3D-parallel trainer, or '' if the single-device loop runs it (one
  device, the plain GPT block, its plain remat)."""
  p, block = c.parallel, c.model.get('block', 'gpt')
  if p.dp * p.pp * p.tp != 1:
    return f'parallel.dp*pp*tp = {p.dp}*{p.pp}*{p.tp} != 1'
  if p.get('save_dots', False):
    return 'parallel.save_dots=True (a remat policy of the parallel step)'
  return f'model.block={block!r}' if block != 'gpt' else ''


def resolve_config_path(path: str, cwd: str | os.PathLike | None = None) -> str:
  """`path` if it exists (relative to `cwd`), else the same file in the installed `configs`.

  Accepts 'configs/tiny.py', 'tiny.py' or 'tiny'. An ml_collections ':arg' suffix is kept.
  Raises FileNotFoundError listing the available configs if neither exists.
  """
  file, sep, arg = path.partition(':')
  base = pathlib.Path(cwd or os.getcwd())
  p = pathlib.Path(file).expanduser()
  if (p if p.is_absolute() else base / p).is_file():
    return path
  from taco_jax import configs  # the installed package
  pkg = pathlib.Path(configs.__file__).parent
  name = p.name if p.suffix == '.py' else p.name + '.py'
  if (pkg / name).is_file() and (len(p.parts) == 1 or p.parent.name == 'configs'):
    return str(pkg / name) + sep + arg
  avail = sorted(f.stem for f in pkg.glob('*.py') if f.stem not in ('__init__', 'common'))
  raise FileNotFoundError(f'config file {file!r} not found (relative to {base}) and no '
                          f'configs/{name} is installed; available: {avail}')


def config_to_json(c: ml_collections.ConfigDict) -> str:
  return json.dumps(c.to_dict(), indent=2, sort_keys=True)


def config_from_json(text: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(json.loads(text))
