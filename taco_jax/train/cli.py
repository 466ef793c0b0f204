"""Command line: `python -m taco_jax.train --config=configs/tiny.py [--config.x=..] [--workdir=..]`.

A thin wrapper over `taco_jax.train.loop.train`. `--config` may name a file relative to
the current directory or one of the installed configs (`configs/tiny.py`, `tiny`).
"""
from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from taco_jax.train.config import resolve_config_path


def define_flags() -> None:
  """Defines --config and --workdir (in run(), so importing this module defines no flags)."""
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and config.json go here '
                      '(default ./workdir/<config.name>); resumes if it has checkpoints.')


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
  from taco_jax.train.loop import NonFiniteLossError, train  # heavy imports after flag parsing
  config = flags.FLAGS.config
  if config is None:
    raise app.UsageError('--config is required, e.g. --config=configs/tiny.py')
  workdir = flags.FLAGS.workdir or f'./workdir/{config.name}'
  try:
    summary = train(config, workdir)
  except (ValueError, FileNotFoundError, PermissionError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except NonFiniteLossError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  print(json.dumps(summary, indent=2))
  if summary['status'] == 'interrupted':
    sys.exit(130)


def run():
  """Console-script entry point (`taco-train`)."""
  try:
    argv = rewrite_config_arg(sys.argv)
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  define_flags()
  app.run(main, argv=argv)
