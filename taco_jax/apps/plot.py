"""Loss curves of one or more runs: `python -m taco_jax.apps.plot --workdir=A [--workdir=B ...]
[--out=loss.png]`.

Reads each workdir's metrics.jsonl and writes one PNG: train loss (lines) and validation
loss (markers) per run, and, where a run logged them (`compression.log_errors`), its
`compression_error/<family>` curves in a second panel. Several workdirs overlay, e.g. a run
with compression off and one with it on.
"""
from __future__ import annotations

import pathlib
import sys

from taco_jax.train.metrics import read_jsonl


def curves(workdir) -> dict[str, tuple[list[int], list[float]]]:
  """{metric: (steps, values)} of the losses and compression errors in workdir's metrics."""
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  if not path.exists():
    raise FileNotFoundError(f'{path} not found: --workdir must be a training workdir')
  out: dict[str, tuple[list[int], list[float]]] = {}
  for rec in read_jsonl(path):
    for k, v in rec.items():
      if k in ('loss', 'val_loss') or k.startswith('compression_error/'):
        steps, values = out.setdefault(k, ([], []))
        steps.append(rec['step'])
        values.append(v)
  return out


def plot(workdirs: list, out) -> pathlib.Path:
  """Writes the PNG (see the module docstring) to `out`; returns its path."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  runs = {str(w): curves(w) for w in workdirs}
  errors = any(k.startswith('compression_error/') for c in runs.values() for k in c)
  fig, axes = plt.subplots(1, 2 if errors else 1, figsize=(12 if errors else 7, 4.5),
                           squeeze=False)
  loss_ax = axes[0, 0]
  for i, (name, c) in enumerate(runs.items()):
    color = f'C{i}'
    if 'loss' in c:
      loss_ax.plot(*c['loss'], color=color, lw=1, label=f'{name} train')
    if 'val_loss' in c:
      loss_ax.plot(*c['val_loss'], 'o--', color=color, label=f'{name} val')
    for k, (steps, values) in sorted(c.items()):
      if k.startswith('compression_error/'):
        axes[0, 1].plot(steps, values, lw=1, label=f'{name} {k.split("/", 1)[1]}')
  loss_ax.set(xlabel='step', ylabel='loss', title='loss')
  loss_ax.legend(fontsize=8)
  if errors:
    axes[0, 1].set(xlabel='step', ylabel='relative L2 error', title='compression error')
    axes[0, 1].legend(fontsize=8)
  fig.tight_layout()
  out = pathlib.Path(out)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv=None):
  from absl import app, flags

  flags.DEFINE_multi_string('workdir', None, 'A training workdir; repeat to overlay runs.')
  flags.DEFINE_string('out', None, 'PNG to write (default <first workdir>/loss.png).')

  def run(_):
    f = flags.FLAGS
    if not f.workdir:
      raise app.UsageError('--workdir is required (a training workdir, e.g. workdir/tiny)')
    try:
      path = plot(f.workdir, f.out or pathlib.Path(f.workdir[0]) / 'loss.png')
    except (FileNotFoundError, ValueError) as e:
      print(f'error: {e}', file=sys.stderr)
      sys.exit(2)
    except ImportError:
      print('error: the plot needs matplotlib: pip install "taco-jax[plots]"', file=sys.stderr)
      sys.exit(2)
    print(f'wrote {path}')

  app.run(run, argv=argv or sys.argv)


if __name__ == '__main__':
  main()
