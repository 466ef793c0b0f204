"""Measured thresholds: `CompressionConfig(link=...)` compresses (`policy.pays_for`) only
where the GPU benchmark found compression to pay, and what the repo states is in sync with
the results."""
import pytest

from benchmarks import report
from taco_jax import CompressionConfig, _measured
from taco_jax.policy import pays_for, resolved_link

MIB = 1 << 20
MEASURED = [(link, n, coll, t) for link, by_n in sorted(_measured.MIN_BYTES.items())
            for n, row in sorted(by_n.items()) for coll, t in sorted(row.items())]


def test_without_link_min_bytes_decides():
  cfg = CompressionConfig(min_bytes=MIB, link=None)
  assert not pays_for(cfg, "reduce_scatter", MIB - 1, 4)
  assert pays_for(cfg, "reduce_scatter", MIB, 4)
  assert pays_for(CompressionConfig(link=None), "all_reduce", 1)


def test_auto_link_is_the_measured_one_on_gpu_and_none_elsewhere(monkeypatch):
  """The default (link="auto"): off GPU no measured sizes apply (CPU runs compress every
  message); on GPU the NVLink sizes, or the host-memory ones under NCCL_P2P_DISABLE=1."""
  assert CompressionConfig().link == "auto"
  assert resolved_link(CompressionConfig()) is None  # the tests run on CPU
  assert pays_for(CompressionConfig(), "all_reduce", 1, 4)
  monkeypatch.setattr("jax.default_backend", lambda: "gpu")
  monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
  assert resolved_link(CompressionConfig()) == "nvlink"
  t = _measured.MIN_BYTES["nvlink"][4]["all_gather"]
  assert not pays_for(CompressionConfig(), "all_gather", t - 1, 4)
  assert pays_for(CompressionConfig(), "all_gather", t, 4)
  monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
  assert resolved_link(CompressionConfig()) == "p2p_disabled"
  assert resolved_link(CompressionConfig(link=None)) is None


@pytest.mark.parametrize("link,n,collective,threshold", MEASURED)
def test_link_applies_the_measured_size(link, n, collective, threshold):
  cfg = CompressionConfig(link=link)
  if threshold is None:  # never paid there: always the plain collective
    assert not any(pays_for(cfg, collective, 1 << k, n) for k in range(40))
  else:
    assert not pays_for(cfg, collective, threshold - 1, n)
    assert pays_for(cfg, collective, threshold, n)


def test_unmeasured_axis_size_takes_the_most_cautious_measured_one():
  for link, by_n in _measured.MIN_BYTES.items():
    cfg = CompressionConfig(link=link)
    for coll in next(iter(by_n.values())):
      ts = [row[coll] for row in by_n.values()]
      if any(t is None for t in ts):
        assert not pays_for(cfg, coll, 1 << 39, 1000)
      else:
        assert not pays_for(cfg, coll, max(ts) - 1, 1000) and pays_for(cfg, coll, max(ts), 1000)


def test_unmeasured_collective_falls_back_to_min_bytes():
  cfg = CompressionConfig(link="nvlink", min_bytes=10)
  assert pays_for(cfg, "ppermute", 10, 4) and not pays_for(cfg, "ppermute", 9, 4)


def test_larger_bound_wins():
  cfg = CompressionConfig(link="p2p_disabled", min_bytes=64 * MIB)
  assert _measured.MIN_BYTES["p2p_disabled"][4]["all_gather"] < 64 * MIB
  assert not pays_for(cfg, "all_gather", 64 * MIB - 1, 4)


def test_unknown_link_is_a_clear_error():
  with pytest.raises(ValueError, match="link must be None, 'auto' or one of"):
    CompressionConfig(link="infiniband")


KERNEL_MEASURED = [(link, n, coll, t) for link, by_n in sorted(_measured.KERNEL_PAYS.items())
                   for n, row in sorted(by_n.items()) for coll, t in sorted(row.items())]


@pytest.mark.parametrize("link,n,collective,pays", KERNEL_MEASURED)
def test_kernels_have_their_own_measured_sizes_and_work(link, n, collective, pays):
  """`kernel=True` reads the collective-matmul kernels' table, not the collectives': the
  FP8 kernel from its smallest measured win's size and up to its largest win's work."""
  cfg = CompressionConfig(link=link)
  if pays is None:
    assert not any(pays_for(cfg, collective, 1 << k, n, kernel=True, work=1.0)
                   for k in range(40))
  else:
    size, most = pays["min_bytes"], pays["max_work"]
    assert pays_for(cfg, collective, size, n, kernel=True, work=most)
    assert not pays_for(cfg, collective, size - 1, n, kernel=True, work=most)
    assert not pays_for(cfg, collective, size, n, kernel=True, work=most + 1)
  with pytest.raises(ValueError, match="needs the matmul's work"):
    pays_for(cfg, collective, 1 << 30, n, kernel=True)


def test_kernel_policy_is_by_work_where_the_sizes_do_not_separate():
  """At TP=4 the 1.3B all-gathers all send 16 MiB; the FP8 kernel won only at the
  out-projection's backward (N = 2048 against 6144 and 8192), so only it is compressed."""
  def case(layer, n_cols, plain_ms, fp8_ms, kind="ag"):
    return dict(model="1.3b", layer=layer, kind=kind, tp=4, a_shape=[8, 2048, 2048],
                w_shape=[2048, n_cols], variants=dict(fused=dict(ms=plain_ms),
                                                      fused_fp8=dict(ms=fp8_ms)))
  cases = [case("proj_dx", 2048, 0.179, 0.143), case("qkv", 6144, 0.237, 0.257),
           case("up", 8192, 0.223, 0.239)]
  assert [report._cm_work(c) for c in cases] == [2048, 6144, 8192]
  assert report._cm_work(case("proj", 2048, 1, 1, kind="rs")) == 2048 // 4  # F / n
  assert report.kernel_thresholds(cases) == {
      "all_gather": {"max_work": 2048, "min_bytes": 16 * MIB}}
  assert report.kernel_thresholds(cases[1:]) == {"all_gather": None}
  # faster by less than the margin (the runs' spread): a tie, which keeps the plain kernel
  tie = case("proj_dx", 2048, 0.2991, 0.2991 * (1 - report.KERNEL_WIN_MARGIN / 2))
  assert report.kernel_thresholds([tie]) == {"all_gather": None}
  assert report._last_win([(1, True), (2, True), (2, False), (4, True)]) == 1  # a tie
  assert report._last_win([(1, False), (2, True)]) is None and report._last_win([]) is None


def test_first_win_needs_every_point_from_that_size_on():
  assert report._first_win([(1, False), (2, True), (2, True), (4, True)]) == 2
  assert report._first_win([(2, True), (4, True), (4, False)]) is None  # a tie of sizes
  assert report._first_win([(1, True), (2, False), (4, True)]) == 4
  assert report._first_win([]) is None


def test_readme_and_thresholds_are_generated_from_the_results():
  assert report.main(["--check"]) == 0, "run python -m benchmarks.report"


def test_kernel_runs_of_one_link_and_tp_merge_case_by_case(tmp_path, monkeypatch):
  """A later run that timed some layers replaces those layers' cases, not the whole run:
  the earlier run's other layers still set the thresholds. Runs of one day come in the
  order they ran (the time each wrote), whatever their names. A run on fewer GPUs than its
  TP (one-GPU variants only) replaces nothing."""
  import json

  def case(layer, kind, plain_ms, fp8_ms):
    return dict(model="1.3b", layer=layer, kind=kind, tp=4, a_shape=[8, 2048, 2048],
                w_shape=[2048, 2048], variants=dict(fused=dict(ms=plain_ms),
                                                     fused_fp8=dict(ms=fp8_ms)))
  runs = {"nvlink_4gpu_20261126": ("2026-11-26T09:00:00", [case("proj", "rs", 2.0, 1.0),
                                                          case("qkv", "ag", 1.0, 2.0)]),
          "nvlink_0_4gpu_20261126": ("2026-11-26T10:00:00", [case("qkv", "ag", 2.0, 1.0)]),
          "nvlink_4gpu_20261120": (None, [case("down", "rs", 1.0, 2.0)]),  # the oldest
          # TP=4's shapes on 2 GPUs, the latest: one-GPU variants only, so left out
          "nvlink_1_2gpu_20261126": ("2026-11-26T11:00:00", [case("qkv", "ag", 3.0, 3.0)])}
  for name, (date, cases) in runs.items():
    run = dict(tp=4, gpus=int(name.split("_")[-2][0]), cases=cases,
               **({"date": date} if date else {}))
    (tmp_path / f"bench_collective_matmul_{name}.json").write_text(json.dumps(run))
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  cases, names = report._cm_cases()
  assert names[0] == "bench_collective_matmul_nvlink_4gpu_20261120.json"  # by date
  assert not any("2gpu" in name for name in names)
  merged = {c["layer"]: c["variants"]["fused_fp8"]["ms"] for c in cases["nvlink"][4]}
  assert merged == {"down": 2.0, "proj": 1.0, "qkv": 1.0}  # qkv from the later run
  # the reduce-scatter's cases disagree at one size and work (down lost, proj won): never
  shard_bytes = 8 * 2048 * 2048 * 2 // 4  # what the plain all-gather sends per device
  assert report.kernel_thresholds(cases["nvlink"][4]) == {
      "all_gather": {"max_work": 2048, "min_bytes": shard_bytes}, "reduce_scatter": None}
