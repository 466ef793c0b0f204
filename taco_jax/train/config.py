"""Config checks, the step layout a config asks for, config-file resolution and the
config.json the trainer stores.

`validate` runs before anything is built or compiled and names every field at fault, with
what to change: the sections' values, the model, the compression plan and the parallel
layout against the model, the batch and the devices. `parallel_spec` turns a valid config
into the `ParallelSpec` the step is built from, `compiler_options` into the XLA options it
is compiled with.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import sys

import jax
import ml_collections

from taco_jax.configs.common import base_config
from taco_jax.models import model_config
from taco_jax.plan import FAMILIES, plan_from_config
from taco_jax.tp import mesh as mesh_lib, step as step_lib, zero
from taco_jax.tp.step import ParallelSpec


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
  probe = c.compression.get('link_probe', True)
  need(isinstance(probe, bool), f'compression.link_probe={probe!r} must be True (time the '
       'collectives at start-up on GPU) or False (the measured tables)')
  p = c.parallel
  for n in ('pgle', 'xla_overlap'):
    need(isinstance(p[n], bool), f'parallel.{n}={p[n]!r} must be True or False')
  need(isinstance(p.collectives_in_flight, int) and not isinstance(p.collectives_in_flight, bool)
       and p.collectives_in_flight >= 1,
       f'parallel.collectives_in_flight={p.collectives_in_flight!r} must be an integer >= 1 '
       '(1 = XLA\'s default)')
  return errs


def validate(c: ml_collections.ConfigDict, n_devices: int | None = None,
             n_local_devices: int | None = None) -> None:
  """Raises ValueError listing every invalid field (with what to change). The layout is
  checked against `n_devices` (and `n_local_devices` per host); None: `devices(c)`."""
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
  try:
    errs += zero.errors(c.parallel.shard_optimizer, plan_from_config(c.compression))
  except (TypeError, ValueError) as e:
    errs.append(str(e))
  if all(isinstance(c.parallel[n], int) and c.parallel[n] > 0 for n in ('dp', 'pp', 'tp')):
    if n_devices is None:
      n_devices = len(devices(c))
      n_local_devices = min(n_devices, jax.local_device_count())
    errs += parallel_errors(c, n_devices, n_local_devices)
  if errs:
    raise ValueError('invalid config:\n  ' + '\n  '.join(dict.fromkeys(errs)))


def devices(c: ml_collections.ConfigDict) -> list:
  """The devices a config runs on: all of them, or the first for a one-device config."""
  p = c.parallel
  return jax.devices()[:1] if p.dp * p.pp * p.tp == 1 else jax.devices()


def parallel_errors(c, n_devices: int | None = None, n_local_devices: int | None = None
                    ) -> list[str]:
  """Every way `c.parallel` does not fit the model (a valid section: `model_config`), the
  batch or the devices."""
  p, z = c.parallel, c.compression
  if 'overlap' in p:
    return [f'parallel.overlap={p.overlap!r} was replaced by parallel.tp_overlap: use '
            "tp_overlap='ring' for the ring collective matmuls (overlap=True), 'none' (False), "
            "or 'kernel' for the fused collective-matmul kernels"]
  errs = []
  log_errors = bool(z.enabled and z.log_errors)
  if p.tp_overlap != 'none' and p.tp > 1 and z.log_errors:
    errs.append(f'parallel.tp_overlap={p.tp_overlap!r}: the collective matmuls do not report '
                "their messages; set it to 'none' to log compression errors "
                '(compression.log_errors)')
  return errs + mesh_lib.layout_errors(
      model_config(c.model), dp=p.dp, pp=p.pp, tp=p.tp, tp_overlap=p.tp_overlap,
      microbatches=p.microbatches, interleave=p.interleave, schedule=p.schedule,
      virtual_stages=p.virtual_stages, log_errors=log_errors,
      save_tp_outputs=p.save_tp_outputs, save_dots=p.save_dots,
      save_attention=p.save_attention, overlap_grad_reduce=p.overlap_grad_reduce,
      shard_optimizer=p.shard_optimizer,
      batch_size=c.data.batch_size, seq_len=c.data.seq_len, n_devices=n_devices,
      n_local_devices=n_local_devices)


def parallel_spec(c: ml_collections.ConfigDict) -> ParallelSpec:
  """The step layout of a valid config: model, mesh sizes, schedule, codecs, remat."""
  p = c.parallel
  return ParallelSpec(model_config(c.model), p.dp, p.pp, p.tp, p.microbatches,
                      plan_from_config(c.compression), schedule=p.schedule,
                      virtual_stages=p.virtual_stages, tp_overlap=p.tp_overlap,
                      tp_exchange=p.tp_exchange, interleave=p.interleave,
                      save_tp_outputs=p.save_tp_outputs, save_dots=p.save_dots,
                      save_attention=p.save_attention, save_head=p.save_head,
                      scan_layers=p.scan_layers,
                      shard_optimizer=p.shard_optimizer,
                      overlap_grad_reduce=p.overlap_grad_reduce)


def _has_kernel_layers(c: ml_collections.ConfigDict) -> bool:
  return c.parallel.tp_overlap == 'kernel' and c.parallel.tp > 1


def compiler_options(c: ml_collections.ConfigDict, kernel_graphs: str = "fusions") -> dict:
  """The per-compile XLA options of a valid config's step (`step.compiler_options`);
  `kernel_graphs` (benchmarks only) as there."""
  p = c.parallel
  return step_lib.compiler_options(p.interleave, xla_overlap=p.xla_overlap,
                                   collectives_in_flight=p.collectives_in_flight,
                                   kernels=_has_kernel_layers(c), kernel_graphs=kernel_graphs)


def notes(c: ml_collections.ConfigDict) -> list[str]:
  """What the trainer changes of a valid config, to be said before it runs."""
  o, t = c.optim, c.train
  out = []
  if o.warmup_steps > t.steps:
    out.append(f'optim.warmup_steps={o.warmup_steps} > train.steps={t.steps}: the warm-up is '
               f'clamped to the run ({t.steps} steps)')
  if _has_kernel_layers(c):
    out.append("parallel.tp_overlap='kernel': the kernels launch outside XLA's CUDA graphs, "
               "which would replay them with stale peer addresses (step.KERNEL_XLA_OPTIONS)")
  return out


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


# Sections whose change would make a resumed run differ from an uninterrupted one.
RESUME_MUST_MATCH = ('model', 'seed', 'data', 'optim', 'compression')
# Fields that change nothing a run computes: where the corpus cache lives, whether the
# compression error is also measured; and how link='auto' is decided, which depends on the
# machine anyway (a resumed run on the same one reuses the cached <workdir>/link_policy.json).
_RESUME_IGNORED = {('data', 'cache_dir'), ('compression', 'log_errors'),
                   ('compression', 'link_probe')}
# Fields added after runs were stored: a config.json without them had their default. A
# compression section without families compressed TP with the codec defaults, as
# base_config's families say now.
_ADDED_LATER = {('data', 'include'): '*', **{
    ('compression', k): v for k, v in base_config('').compression.to_dict().items()
    if k in (*FAMILIES, 'sites')}}


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
