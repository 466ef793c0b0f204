"""Command line: `python -m taco_jax.train --config=<file> [--config.x=..] [--workdir=..]
[--cpu_devices=N]`, for every config.

A thin wrapper over `taco_jax.train.trainer.train`. `--config` may name a file relative to
the current directory or one of the installed configs (`configs/tiny.py`, `tiny`).
"""
from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from taco_jax.train.config import notes, resolve_config_path


def define_flags() -> None:
  """Defines the flags (in run(), so importing this module defines none)."""
  config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/tiny.py, '
                                  'or a name: tiny); override any field with '
                                  '--config.<path>=<value>.', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and config.json go here '
                      '(default ./workdir/<config.name>); resumes if it has checkpoints.')
  flags.DEFINE_integer('cpu_devices', 0, 'Run on this many fake CPU devices (e.g. 8 to try a '
                       '2x2x2 mesh on a laptop); 0 = the real devices.')
  show_in_help('config', 'workdir', 'cpu_devices')


def show_in_help(*names: str) -> None:
  """Lists these flags under --help (absl lists only the main module's flags there; ours
  are defined here, not in the `python -m` module)."""
  for name in names:
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a mistyped --config.<key> said in one line, not a traceback."""
  try:
    return flags.FLAGS(argv)
  except (KeyError, AttributeError) as e:  # ml_collections: no such field, "did you mean"
    text = str(e.args[0] if e.args else e).encode().decode('unicode_escape')
    field, *hint = [line.strip(' \'"') for line in text.splitlines()]
    print(f"error: bad --config override: no field {field!r}. {' '.join(hint)}".strip(),
          file=sys.stderr)
    sys.exit(2)
  except flags.Error as e:
    print(f'error: {e}; pass --help to see the flags', file=sys.stderr)
    sys.exit(2)


def use_cpu_devices(n: int) -> None:
  """Puts JAX on `n` fake CPU devices; call before anything touches a JAX backend."""
  import jax
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', n)


def train(config, workdir) -> dict:
  """Says the config's notes, then trains it in `workdir` (`taco_jax.train.trainer`)."""
  from taco_jax.train import trainer
  for note in notes(config):
    print(f'note: {note}', file=sys.stderr)
  return trainer.train(config, workdir)


def rewrite_config_arg(argv: list[str]) -> list[str]:
  """argv with the value of --config passed through `resolve_config_path`."""
  out, i = list(argv), 1
  while i < len(out):
    a = out[i]
    for prefix in ('--config=', '-config='):
      if a.startswith(prefix):
        out[i] = prefix + resolve_config_path(a[len(prefix):])
    if a in ('--config', '-config') and i + 1 < len(out):
      out[i + 1] = resolve_config_path(out[i + 1])
      i += 1
    i += 1
  return out


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:  # orbax logs every checkpoint step at INFO
    logging.set_verbosity(logging.WARNING)
  if flags.FLAGS.cpu_devices:
    use_cpu_devices(flags.FLAGS.cpu_devices)
  import jax  # heavy imports after flag parsing
  from taco_jax.train.runner import NonFiniteLossError
  config = flags.FLAGS.config
  if config is None:
    raise app.UsageError('--config is required, e.g. --config=configs/tiny.py')
  workdir = flags.FLAGS.workdir or f'./workdir/{config.name}'
  p = config.parallel
  if flags.FLAGS.cpu_devices > 1 and p.dp * p.pp * p.tp == 1:
    print(f'warning: --cpu_devices={flags.FLAGS.cpu_devices}, but {config.name} runs on one '
          'device (parallel.dp = pp = tp = 1); set --config.parallel.dp/pp/tp to use more',
          file=sys.stderr)
  try:
    summary = train(config, workdir)
  except (ValueError, FileNotFoundError, PermissionError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except NonFiniteLossError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  if jax.process_index() == 0:
    print(json.dumps(summary, indent=2))
  if summary['status'] == 'interrupted':
    sys.exit(130)


def run(argv: list[str] | None = None):
  """Console-script entry point (`taco-train`)."""
  try:
    argv = rewrite_config_arg(argv or sys.argv)
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  define_flags()
  app.run(main, argv=argv, flags_parser=parse_flags)
