"""benchmarks/bench_accuracy.py (slow smoke run; its pieces, the trainer, capture, measure
and calibrate, are tested in test_calibrate / test_parallel_train) and the plot of its
results."""
import json
import math
import pathlib

import pytest


def test_kernel_comparison_variants_differ_only_in_the_tp_layers():
  """`on_all` and `on_all_cm` compress every TP message with the same codec, without the
  link policy or error logs, through XLA's collectives and through the kernels."""
  from benchmarks import bench_accuracy
  args = bench_accuracy.parse_args(["--smoke", "--tp", "2"])
  cfg = {v: bench_accuracy.configure(bench_accuracy.load_config(args.config), args, v,
                                     pathlib.Path("/tmp"))
         for v in ("on", "on_all", "on_all_cm")}
  assert cfg["on"].compression.log_errors and cfg["on"].parallel.tp_overlap == "none"
  assert cfg["on"].compression.tp_forward.link == "auto"
  for v in ("on_all", "on_all_cm"):
    c = cfg[v]
    assert c.compression.enabled and not c.compression.log_errors and c.parallel.tp == 2
    assert c.compression.tp_forward.link is None and c.compression.tp_backward.link is None
  assert cfg["on_all"].parallel.tp_overlap == "none"
  assert cfg["on_all_cm"].parallel.tp_overlap == "kernel"
  ref = dict(curves=dict(loss=[[1, 2.0], [2, 1.0]], val_loss=[[2, 1.0], [3, 0.9]]))
  run = dict(curves=dict(loss=[[1, 2.0], [2, 1.1]], val_loss=[[2, 1.0], [3, float("nan")]]))
  diff = bench_accuracy.same_curves(run, ref)
  assert diff == dict(loss_max_rel_diff=pytest.approx(0.1), loss_nonfinite_steps=[],
                      val_loss_max_rel_diff=0.0, val_loss_nonfinite_steps=[3])


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
