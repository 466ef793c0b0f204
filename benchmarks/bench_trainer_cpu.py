"""The trainer on one CPU device against the single-device step it replaced.

`python -m benchmarks.bench_trainer_cpu [--steps 60 --rounds 3]` trains `configs/tiny.py`
with the trainer (`taco_jax.train.trainer`: the stacked parallel step on the mesh (1, 1, 1))
and, on the same batches, runs the step of the former single-device trainer (`models.gpt`
under `jax.jit`, the same optimizer), metrics fetched every `log_every` steps in both.
Rounds alternate the variants; reported: median tokens/s per variant over the rounds'
windows after the first (compilation excluded), and each variant's ratio to the reference.
Variants: the trainer with the layers unrolled (`parallel.scan_layers=False`, what
configs/tiny.py sets) and as a scan (the GPU configs' default).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax

from benchmarks.common import write_results
from taco_jax import data
from taco_jax.configs import tiny
from taco_jax.testing import reference
from taco_jax.train import metrics, optim, trainer


def _config(steps: int, scan_layers: bool):
  c = tiny.get_config()
  c.parallel.scan_layers = scan_layers
  c.train.update(steps=steps, eval_every=0, checkpoint_every=0, eval_batches=1,
                 progress_bar=False)
  return c


def trainer_tokens_per_s(steps: int, scan_layers: bool) -> list[float]:
  """tokens/s of each `log_every` window of one trainer run but its first."""
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train(_config(steps, scan_layers), workdir)
    rates = [r['tokens_per_s'] for r in metrics.read_jsonl(f'{workdir}/metrics.jsonl')
             if 'tokens_per_s' in r]
  return rates[1:]


def reference_tokens_per_s(steps: int) -> list[float]:
  """The same for the former single-device trainer's step: `models.gpt` under jax.jit."""
  c = _config(steps, False)
  d, t = c.data, c.train
  tx = optim.make_optimizer(c.optim, t.steps)
  graphdef, params, opt_state = reference.init_state(c.model, c.seed, tx)
  corpus = trainer.load_data(c)
  batch = lambda i: data.batch_at(corpus.train, i, seed=c.seed, batch_size=d.batch_size,
                                  seq_len=d.seq_len)
  step = jax.jit(reference.train_step(graphdef, tx), donate_argnums=(0, 1)).lower(
      params, opt_state, batch(0)).compile()
  rates, pending, clock = [], [], time.perf_counter()
  for i in range(t.steps):
    params, opt_state, m = step(params, opt_state, batch(i))
    pending.append(m)
    if (i + 1) % t.log_every == 0:
      jax.device_get(pending)
      rates.append(len(pending) * d.batch_size * d.seq_len / (time.perf_counter() - clock))
      pending, clock = [], time.perf_counter()
  return rates[1:]


VARIANTS = {
    'reference': reference_tokens_per_s,
    'trainer_unrolled': lambda steps: trainer_tokens_per_s(steps, scan_layers=False),
    'trainer_scan': lambda steps: trainer_tokens_per_s(steps, scan_layers=True),
}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--steps', type=int, default=60)
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--out', default=None, help='results folder (default benchmarks/results)')
  a = p.parse_args()
  windows = {v: [] for v in VARIANTS}
  for r in range(a.rounds):
    for name, run in VARIANTS.items():
      windows[name] += run(a.steps)
      print(f'round {r + 1}: {name} {statistics.median(windows[name]):,.0f} tokens/s',
            flush=True)
  median = {v: statistics.median(w) for v, w in windows.items()}
  ratio = {v: median[v] / median['reference'] for v in VARIANTS}
  for v in VARIANTS:
    print(f'{v:18s} {median[v]:10,.0f} tokens/s  {ratio[v]:.3f}x the reference')
  print(write_results('bench_trainer_cpu', out_dir=a.out, payload=dict(
      config='tiny', steps=a.steps, rounds=a.rounds, cpu_count=len(jax.devices()),
      tokens_per_s=median, ratio_to_reference=ratio, windows=windows)))


if __name__ == '__main__':
  main()
