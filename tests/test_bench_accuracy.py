"""benchmarks/bench_accuracy.py (slow smoke run; its pieces, the trainer, capture, measure
and calibrate, are tested in test_calibrate / test_parallel_train) and the plot of its
results."""
import json
import math

import pytest


@pytest.mark.slow
def test_bench_accuracy_smoke(tmp_path):
  from benchmarks import bench_accuracy
  path = bench_accuracy.main(["--smoke", "--steps", "4", "--eval-every", "2",
                              "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "w")])
  rep = json.loads(path.read_text())
  assert set(rep["runs"]) == {"off", "on", "calibrated"}
  for v, r in rep["runs"].items():
    assert [s for s, _ in r["curves"]["val_loss"]] == [2, 4], v
    assert math.isfinite(r["summary"]["val_loss"])
    assert ("compression_error/tp_forward" in r["curves"]) == (v != "off")
  assert rep["corpus"]["train_tokens"] > 0 and rep["corpus"]["val_tokens"] > 0
  for site, rows in rep["ablations"].items():
    assert [r["name"] for r in rows] == list(bench_accuracy.ABLATIONS), site
    assert all(0 < r["rel_l2"] < 0.1 for r in rows if r["format"] == "e4m3"), site
  assert set(rep["calibration"]["choices"]) >= {"tp_forward", "tp_backward"}


def test_plot_of_the_committed_results(tmp_path):
  pytest.importorskip("matplotlib")
  from benchmarks import plot_accuracy
  out = plot_accuracy.plot(tmp_path / "loss.png")
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
