"""The trainer's step loop, `run_steps(...) -> Outcome`, and the lines a run prints.

Metrics are fetched from the device every `log_every` steps (one `device_get`, not one per
step) and written one line per step; eval and checkpoint time, and the compile PGLE adds
(`Steps.untimed_s`), stay out of the throughput.
Ctrl-C stops at the next step boundary, evaluates and saves a checkpoint; a non-finite loss
or grad norm raises `NonFiniteLossError` without saving the bad state, so the last good
checkpoint is the latest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import signal
import threading
import time
from typing import Callable

import jax
import numpy as np

from taco_jax.train import optim


class NonFiniteLossError(RuntimeError):
  """The loss (or gradient norm) became NaN/inf; the last good checkpoint is kept."""


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


def start_message(workdir, start: int, steps: int) -> str | None:
  """What a trainer says before its first step: resumed, already done, or nothing new."""
  if start >= steps:
    return (f'{workdir} is already at step {start} (train.steps={steps}): nothing to train; '
            'raise --config.train.steps to go on, or give another --workdir')
  return f'resumed from step {start} in {workdir}' if start else None


def run_header(name: str, n_params: int, workdir, mesh_shape: dict | None = None) -> str:
  """The first line a run prints: its name, size, devices (and mesh) and workdir."""
  devices = jax.devices()
  n = math.prod(mesh_shape.values()) if mesh_shape else 1
  where = f'{n} {devices[0].platform} device{"s" if n > 1 else ""}'
  if mesh_shape:
    where += ', mesh ' + ' x '.join(f'{k}={v}' for k, v in mesh_shape.items())
  return f'{name}: {n_params:,} params on {where}; workdir {workdir}'


def corpus_line(corpus) -> str:
  """'python stdlib (30.7M train / 1.3M val tokens)'."""
  return (f'{corpus.source.split(" (")[0]} ({len(corpus.train) / 1e6:.1f}M train / '
          f'{len(corpus.val) / 1e6:.1f}M val tokens)')


def finished_summary(workdir: pathlib.Path, step: int) -> dict:
  """The summary of a run already at its last step: its stored summary.json (kept as it
  is), marked with the step; nothing is trained, evaluated or written."""
  path = workdir / 'summary.json'
  old = json.loads(path.read_text()) if path.exists() else {}
  return {**old, 'workdir': str(workdir), 'status': 'already_done', 'step': step,
          'last_checkpoint': step}


def nonfinite_message(rec: dict, step: int, last_checkpoint: int | None, directory,
                      model_dtype: str) -> str:
  """Why a run stopped on a non-finite loss, what is kept, and what to change."""
  kept = (f'the last good checkpoint (step {last_checkpoint}) in {directory} is kept'
          if last_checkpoint is not None else 'no checkpoint was saved before it')
  advice = ['lower optim.lr', 'raise optim.warmup_steps']
  if model_dtype != 'float32':
    advice.append(f'use model.dtype=float32 (now {model_dtype})')
  then = ', then resume' if last_checkpoint is not None else ''
  return (f'loss={rec["loss"]} grad_norm={rec["grad_norm"]} at step {step}: stopping. '
          f'{kept.capitalize()}; {", ".join(advice[:-1])} or {advice[-1]}{then}.')


@dataclasses.dataclass(frozen=True)
class Steps:
  """The compiled step functions and the batches they take."""
  train: Callable  # (params, opt_state, batch) -> (params, opt_state, metrics with loss and
  #                  grad_norm); it donates params and opt_state
  eval: Callable   # (params, batch) -> mean loss
  train_batch: Callable[[int], object]  # batch index -> batch (batch i is step i+1's)
  val_batch: Callable[[int], object]    # the i-th fixed validation batch
  # seconds `train` has spent so far on other work than steps (PGLE's profile and second
  # compile, `pgle.ProfileGuidedStep.untimed_s`): kept out of the throughput
  untimed_s: Callable[[], float] = lambda: 0.0


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How `run_steps` ended and the last values it measured (None: not measured)."""
  step: int
  status: str  # 'completed' | 'interrupted'
  last_checkpoint: int | None
  train_loss: float | None = None
  val_loss: float | None = None
  tokens_per_s: float | None = None
  mfu: float | None = None


def run_steps(params, opt_state, steps: Steps, ckpt, *, config, start: int, meta: dict,
              tokens_per_step: int, mfu: Callable[[float], float | None], writer=None,
              pbar=None) -> Outcome:
  """Runs steps start+1 .. config.train.steps from the state at step `start`.

  Args:
    ckpt: a `checkpoint.Checkpoints`, saved with {'step': s, **meta}; waited on and closed
      on the way out.
    config: the run's config (train: steps, log_every, eval_every, checkpoint_every,
      eval_batches; optim: the learning-rate schedule, written as `lr`; model.dtype: for
      the advice of a non-finite loss).
    mfu: tokens/s -> model FLOPs utilization, or None where the devices' peak is unknown.
    writer: a `metrics.MetricsWriter` (closed on the way out), or None to write nothing.
    pbar: a tqdm bar for progress and messages, or None to print nothing.

  A second Ctrl-C (KeyboardInterrupt) saves if the state was not donated to an unfinished
  step, in a single-process run; a process of a multi-process run must not save alone, so
  there it propagates.
  """
  t, pending = config.train, []
  clock = [time.perf_counter(), steps.untimed_s()]  # a window's start, and untimed seconds

  def restart_clock():
    clock[:] = [time.perf_counter(), steps.untimed_s()]
  schedule = optim.lr_schedule(config.optim, t.steps)
  last = {}

  def flush():
    """Fetches pending step metrics, checks them, writes them; the window's throughput
    goes on its last step's record only (it is one measurement, not one per step)."""
    if not pending:
      return
    host = jax.device_get([m for _, m in pending])
    elapsed = time.perf_counter() - clock[0] - (steps.untimed_s() - clock[1])
    tps = len(pending) * tokens_per_step / elapsed
    window_mfu = mfu(tps)
    for i, ((s, _), m) in enumerate(zip(pending, host)):
      rec = {k: float(v) for k, v in m.items()}
      rec['lr'] = float(schedule(s - 1))
      if i == len(pending) - 1:
        rec['tokens_per_s'] = tps
        if window_mfu is not None:
          rec['mfu'] = window_mfu
      if writer is not None:
        writer.write(s, **rec)
      if not (math.isfinite(rec['loss']) and math.isfinite(rec['grad_norm'])):
        pending.clear()
        raise NonFiniteLossError(nonfinite_message(rec, s, ckpt.latest_step(), ckpt.directory,
                                                   config.model.dtype))
    last.update(train_loss=rec['loss'], tokens_per_s=tps, mfu=window_mfu)
    if pbar is not None:
      pbar.update(len(pending))
      shown = dict(loss=f'{rec["loss"]:.3f}', tok_s=f'{tps:.3g}')
      if window_mfu is not None:
        shown['mfu'] = f'{window_mfu:.2%}'
      pbar.set_postfix(shown)
    pending.clear()
    restart_clock()

  def evaluate(s):
    losses = [steps.eval(params, steps.val_batch(i)) for i in range(t.eval_batches)]
    last['val_loss'] = float(np.mean(jax.device_get(losses)))
    if writer is not None:
      writer.write(s, val_loss=last['val_loss'])
    if pbar is not None:
      pbar.write(f'step {s}: val_loss {last["val_loss"]:.4f}')

  def save(s):
    flush()
    ckpt.save(s, params, opt_state, {'step': s, **meta})

  s, status = start, 'completed'
  try:
    with sigint_as_flag() as stop:
      while s < t.steps and not stop.is_set():
        params, opt_state, m = steps.train(params, opt_state, steps.train_batch(s))
        s += 1
        pending.append((s, m))
        if s % t.log_every == 0:
          flush()
        if t.eval_every and s % t.eval_every == 0 and s < t.steps:
          flush()
          evaluate(s)
          restart_clock()  # keep eval time out of the throughput
        if t.checkpoint_every and s % t.checkpoint_every == 0 and s < t.steps:
          save(s)
          restart_clock()
      if stop.is_set():
        status = 'interrupted'
        if pbar is not None:
          pbar.write(f'interrupted at step {s}, saving a checkpoint')
      flush()
      evaluate(s)
      save(s)
  except KeyboardInterrupt:  # a second Ctrl-C, or raised inside a step
    if jax.process_count() > 1:
      raise
    status = 'interrupted'
    if not any(x.is_deleted() for x in jax.tree.leaves((params, opt_state))):
      save(s)
  finally:
    if pbar is not None:
      pbar.close()
    ckpt.wait()
    ckpt.close()
    if writer is not None:
      writer.close()
  return Outcome(step=s, status=status, last_checkpoint=ckpt.latest_step(), **last)
