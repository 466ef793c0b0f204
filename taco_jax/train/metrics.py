"""Metrics sinks: JSON lines in <workdir>/metrics.jsonl, and TensorBoard if importable."""
from __future__ import annotations

import json
import pathlib


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, n_devices: int = 1):
  """Model FLOPs utilization: achieved training FLOP/s over the devices' peak."""
  return tokens_per_s * flops_per_token / (peak_flops * n_devices)


def truncate_after(path: pathlib.Path, step: int) -> None:
  """Drops records with step > `step` (written after the checkpoint a resume starts from)."""
  if not path.exists():
    return
  keep = [line for line in path.read_text().splitlines()
          if line.strip() and json.loads(line).get('step', 0) <= step]
  path.write_text(''.join(line + '\n' for line in keep))


def read_jsonl(path) -> list[dict]:
  return [json.loads(s) for s in pathlib.Path(path).read_text().splitlines() if s.strip()]


class MetricsWriter:
  """Appends one JSON object per record; mirrors scalars to TensorBoard when available."""

  def __init__(self, workdir: str | pathlib.Path):
    self.path = pathlib.Path(workdir) / 'metrics.jsonl'
    self._file = open(self.path, 'a', buffering=1)
    self._tb = None
    try:
      from tensorboardX import SummaryWriter  # optional; never a dependency
      self._tb = SummaryWriter(str(pathlib.Path(workdir) / 'tb'))
    except Exception:  # noqa: BLE001 - any import/setup problem just means no TensorBoard
      pass

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
