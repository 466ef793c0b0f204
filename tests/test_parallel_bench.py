"""Smoke run of benchmarks/train_parallel.py (slow: ~40 s; the trainer tests cover the step)."""
import json

import pytest


@pytest.mark.slow
def test_train_parallel_smoke(tmp_path):
  from benchmarks import train_parallel
  path = train_parallel.main(["--smoke", "--layouts", "2,2,2", "--steps", "3",
                              "--out-dir", str(tmp_path)])
  report = json.loads(path.read_text())
  rows = {r["compression"]: r for r in report["results"]}
  assert set(rows) == {"off", "on"} and all(r["steps"] == 3 for r in rows.values())
  assert "u8" in rows["on"]["comm_bytes_static"]["tensor"]
  assert "u8" not in rows["off"]["comm_bytes_static"]["tensor"]
