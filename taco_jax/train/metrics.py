"""Metrics sinks: JSON lines in <workdir>/metrics.jsonl and TensorBoard event files in
<workdir>/tb (tensorboardX); the MFU estimate and the summary.json writer."""
from __future__ import annotations

import json
import math
import pathlib

from absl import logging

# Dense bf16 tensor-core peak FLOP/s (no sparsity) per GPU, from NVIDIA's data sheets, by a
# substring of JAX's device_kind ("NVIDIA H100 80GB HBM3"); the first match wins, so more
# specific names come first.
PEAK_BF16_FLOPS = (
    ('H100 PCIe', 756e12), ('H100', 989.4e12), ('H200', 989.4e12), ('H800', 989.4e12),
    ('GB200', 2.5e15), ('B200', 2.25e15), ('A100', 312e12), ('L40S', 362e12),
)


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak of one device of `device_kind`, or None if it is not listed."""
  return next((f for name, f in PEAK_BF16_FLOPS if name in device_kind), None)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None,
        n_devices: int = 1) -> float | None:
  """Model FLOPs utilization: achieved training FLOP/s over the devices' peak (None if the
  peak is unknown)."""
  if not peak:
    return None
  return tokens_per_s * flops_per_token / (peak * n_devices)


def configured_peak(train_cfg, device_kind: str) -> float | None:
  """`train.peak_flops` if set (> 0), else the listed peak of `device_kind` (None on CPU
  and unlisted devices: no MFU is shown rather than one against an invented peak)."""
  return train_cfg.peak_flops or peak_flops(device_kind)


def device_peak_bytes() -> int | None:
  """The first local device's peak bytes in use so far (process-wide); None where the
  backend keeps no memory statistics (CPU)."""
  import jax
  stats = jax.local_devices()[0].memory_stats()
  return (stats or {}).get("peak_bytes_in_use")


def truncate_after(path: pathlib.Path, step: int) -> None:
  """Drops records with step > `step` (written after the checkpoint a resume starts from)."""
  if not path.exists():
    return
  keep = [line for line in path.read_text().splitlines()
          if line.strip() and json.loads(line).get('step', 0) <= step]
  path.write_text(''.join(line + '\n' for line in keep))


def read_jsonl(path) -> list[dict]:
  return [json.loads(s) for s in pathlib.Path(path).read_text().splitlines() if s.strip()]


def write_summary(path: pathlib.Path, summary: dict) -> None:
  """Writes `summary` as JSON, with null for what was not measured (never NaN)."""
  clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
           for k, v in summary.items()}
  path.write_text(json.dumps(clean, indent=2))


def _tensorboard_writer(logdir: pathlib.Path, purge_step: int | None):
  """tensorboardX's writer, or None (with a warning) where tensorboardX is not installed:
  a run keeps its metrics.jsonl rather than failing over a missing event-file writer."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    logging.warning('tensorboardX is not installed: no TensorBoard event files; the metrics '
                    'still go to metrics.jsonl (pip install tensorboardX)')
    return None
  return SummaryWriter(str(logdir), purge_step=purge_step)


class MetricsWriter:
  """Appends one JSON object per record to metrics.jsonl; the same scalars go to
  TensorBoard event files under <workdir>/tb where tensorboardX is installed."""

  def __init__(self, workdir: str | pathlib.Path, start_step: int = 0):
    """`start_step`: the step a resumed run starts from; records a run wrote after it (after
    its last checkpoint) are dropped from metrics.jsonl and from TensorBoard."""
    self.path = pathlib.Path(workdir) / 'metrics.jsonl'
    truncate_after(self.path, start_step)
    self._file = open(self.path, 'a', buffering=1)
    self._tb = _tensorboard_writer(pathlib.Path(workdir) / 'tb',
                                   start_step + 1 if start_step else None)

  def write(self, step: int, **scalars) -> None:
    record = {'step': step, **{k: float(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(record) + '\n')
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, float(v), step)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()
