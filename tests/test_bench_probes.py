"""The probes of what bounds compression on NVLink: benchmarks/bench_transport.py (the
settings it parses; a smoke run on 8 CPU devices, each setting in a child process, one of
them failing and reported, not fatal) and benchmarks/probe_fused_decode.py (a smoke run and
its report section), benchmarks/bench_peer_copy.py and bench_exchange.py (smoke runs:
NCCL's stand-ins checked, the kernels left to the GPU; the checks' repeated calls),
benchmarks/probe_energy.py (a smoke run: XLA's matmul timed, no energy counter on CPU),
benchmarks/probe_waves.py (a smoke run of the GEMM core, and its ratios),
benchmarks/probe_gelu_gemm.py and probe_qkv_gemm.py (smoke runs: every variant checked, the
all-gather kernel's too), benchmarks/gelu_numerics.py (the fused MLP's math against fp32
beside XLA's), benchmarks/probe_sequences.py (a smoke run: every sequence's function runs),
its SM clock stamps (benchmarks/sm_clock.py: lowered for sm_90, in its place between two ops,
and inside the GEMM core's epilogue), benchmarks/nvml.py's clock sampler (on fake GPUs) and
benchmarks/probe_schedule.py (what a scheduled HLO runs beside each asynchronous collective;
a smoke run compiling bench_train's programs from their shapes)."""
import json
import time

import pytest

from benchmarks import (bench_exchange, bench_peer_copy, bench_transport, gelu_numerics,
                        probe_energy, probe_fused_decode, probe_gelu_gemm, probe_qkv_gemm,
                        probe_sequences, probe_waves, report as report_lib)
from taco_jax import testing


def test_setting_env():
  assert bench_transport.setting_env("default") == {}
  assert bench_transport.setting_env("NCCL_PROTO=Simple XLA_FLAGS='--a=1 --b=2'") == {
      "NCCL_PROTO": "Simple", "XLA_FLAGS": "--a=1 --b=2"}
  for bad in ("NCCL_PROTO", "1X=2"):
    with pytest.raises(ValueError, match="not VAR=value"):
      bench_transport.setting_env(bad)


def test_smoke_run_measures_every_transport_and_reports_a_failed_setting(tmp_path):
  path = bench_transport.main(["--smoke", "--out-dir", str(tmp_path), "--settings",
                               "default;XLA_FLAGS=--no_such_xla_flag=1"])
  report = json.loads(path.read_text())
  ok = [r for r in report["results"] if r["setting"] == "default"]
  assert {(r["op"], r["payload"]) for r in ok} == set(report_lib.TRANSPORTS)
  assert all(r["median_ms"] > 0 for r in ok)
  rows, d, g = 64, 256, 128  # the smoke sizes, per device
  nbytes = {(r["op"], r["payload"]): r["bytes_per_device"] for r in ok}
  assert nbytes["all_gather", "bf16"] == rows * d * 2
  assert nbytes["all_gather", "wire_u8"] == nbytes["all_gather", "wire_as_u32"] == rows * (
      d + 8 * d // g)
  assert nbytes["all_to_all", "wire_u8"] == 8 * rows * (d + 8 * d // g)
  (failed,) = [r for r in report["results"] if r["setting"] != "default"]
  assert failed["error"]


def test_fused_decode_probe_smoke_and_report(tmp_path, monkeypatch):
  path = probe_fused_decode.main(["--smoke", "--out-dir", str(tmp_path)])
  report = json.loads(path.read_text())
  got = {(r["product"], r["variant"]) for r in report["results"]}
  assert got == {(p, v) for p in ("x@w", "x.T@dy") for v in (
      "bf16", "bf16_triton_any", "pallas_decode", "xla_decode", "xla_decode_triton_any",
      "decode_only")}
  assert all(r["median_ms"] > 0 for r in report["results"])
  monkeypatch.setattr(report_lib, "RESULTS", tmp_path)
  assert report_lib.fused_decode_section() == ""  # CPU runs are not reported
  report.update(platform="gpu", device="NVIDIA H100 80GB HBM3")
  path.write_text(json.dumps(report))
  *_, last = report_lib.fused_decode_section().strip().splitlines()
  cells = [c.strip() for c in last.strip("|").split("|")]
  ms = {r["variant"]: r["median_ms"] for r in report["results"] if r["product"] == "x.T@dy"}
  assert cells[0] == "`x.T@dy`" and cells[1] == "64 x 256 x 128"
  assert cells[-1] == f"{ms['pallas_decode'] - ms['bf16']:.3g}"


def test_peer_copy_smoke_checks_nccls_stand_ins_and_skips_the_kernel(tmp_path):
  path = bench_peer_copy.main(["--smoke", "--out-dir", str(tmp_path), "--sms", "4",
                               "--depths", "2"])
  cases = json.loads(path.read_text())["cases"]
  assert [(c["peers"], c["received_mib"]) for c in cases] == [("one", 1), ("all", 7)]
  for case in cases:
    nccl = [v for k, v in case["variants"].items() if k.startswith("xla_")]
    assert [v["ok"] for v in nccl] == [True]
    kernels = [k for k in case["variants"] if not k.startswith("xla_")]
    assert kernels == ["pull[sms=4+depth=2+rows=64]", "push[sms=4+depth=2+rows=64]"]
    assert all("GPU only" in case["variants"][k]["skipped"] for k in kernels)


def test_checked_then_timed_counts_the_wrong_calls_of_a_sometimes_wrong_function():
  """A race shows in some calls only: every one of ``repeats`` calls is checked."""
  import jax.numpy as jnp
  calls = []

  def flaky(x):  # wrong on its third call
    calls.append(1)
    return x + (len(calls) == 3)

  x = jnp.arange(4.0)
  check = bench_peer_copy.checked_then_timed(flaky, (x,), x, iters=1, n=1, on_gpu=False,
                                             repeats=5)
  assert check == dict(ok=False, calls=5, wrong_calls=1) and len(calls) == 5
  assert bench_peer_copy.checked_then_timed(lambda x: x, (x,), x, 1, 1, False) == {"ok": True}


def test_exchange_smoke_checks_xlas_all_to_all_and_skips_the_kernel(tmp_path):
  cases = json.loads(bench_exchange.main(["--smoke", "--out-dir", str(tmp_path)]).read_text())[
      "cases"]
  assert [(c["way"], c["shape"]) for c in cases] == [
      ("forward", [2, 512, 8]), ("backward", [2, 64, 64]), ("matmul_backward", [2, 64, 64]),
      ("matmul_forward", [2, 512, 8])]
  for case in cases[:2]:
    assert case["misfit"] is None and case["variants"]["xla_all_to_all"]["ok"]
    assert "GPU only" in case["variants"]["kernel"]["skipped"]
  fused = cases[2]  # cuBLAS's side checked, the kernels' skipped
  assert "do not tile the 8-column chunk" in fused["misfit"]
  assert fused["variants"]["cublas+xla"]["ok"] and fused["variants"]["cublas"]["ok"]
  assert fused["variants"]["cublas"]["max_rel_err"] <= 1e-2
  assert all("GPU only" in v["skipped"] for k, v in fused["variants"].items()
             if k not in ("cublas+xla", "cublas"))
  forward = cases[3]  # the same for the forward's, whose kernel needs more SMs than 4
  assert "movers of 4 SMs" in forward["misfit"]
  assert forward["variants"]["xla+cublas"]["ok"] and forward["variants"]["cublas"]["ok"]
  assert all("GPU only" in v["skipped"] for k, v in forward["variants"].items()
             if k not in ("xla+cublas", "cublas"))


def test_exchange_section_rows_from_the_gpu_runs_only():
  """The README's exchange table: one row per GPU case, NCCL's time over the kernel's."""
  text = report_lib.exchange_section()
  rows = [r for r in text.splitlines() if r.startswith("| bench_exchange_")]
  assert rows and all("cpu" not in r for r in rows)
  cells = rows[0].split(" | ")
  assert len(cells) == 11
  assert float(cells[-3]) == pytest.approx(float(cells[6]) / float(cells[7]), rel=0.01)
  # the fused matmul + exchange's table: the split pair over the fused kernel
  fused = [c for c in (r.split(" | ") for r in rows) if len(c) == 12]  # the second table
  assert fused and all(c[-1].strip(" |") in ("True", "–") for c in fused)
  for c in fused:
    assert float(c[9]) == pytest.approx(float(c[6]) / float(c[7]), rel=0.02)


def test_fused_exchange_row_takes_the_fastest_product_kernel():
  """The forward's row: the fastest ``fused[...]`` variant, not its exchanged-x check
  (``fused: x``) nor the chained one, however fast they ran."""
  ms = {"xla+cublas": 0.13, "kernel+cublas": 0.10, "fused[movers=12,depth=4]": 0.11,
        "fused[movers=24,depth=4]": 0.09, "fused: x": 0.05, "fused x8": 0.04, "cublas": 0.05}
  case = dict(model="1.3b", way="matmul_forward", shape=[8, 2048, 512],
              variants={k: dict(ok=True, ms=v) for k, v in ms.items()})
  row = report_lib._fused_exchange_row("run.json", dict(gpus=4, device="H200"), case)
  assert row[3] == "forward[movers=24,depth=4]" and row[7] == 0.09 and row[-1] is True


def test_energy_probe_smoke_times_xlas_matmul_without_a_counter(tmp_path):
  path = probe_energy.main(["--smoke", "--out-dir", str(tmp_path), "--shapes", "mlp_in",
                            "--transposed"])
  plain, transposed = json.loads(path.read_text())["results"]
  assert (plain["kernel"], plain["shape"], plain["rel_err"]) == ("cublas", "mlp_in", 0.0)
  assert plain["calls"] >= 3 and plain["ms_per_call"] > 0 and "mj_per_call" not in plain
  # the same product from the weight stored [N, K]
  assert transposed["kernel"] == "cublas[w_t]" and transposed["rel_err"] < 1e-2


def test_wave_probe_checks_the_core_and_sets_each_row_count_against_the_first():
  assert probe_waves.main(["--smoke"]) == 0
  cases = [dict(shape="qkv", m=m, cublas=dict(best_ms=c), core=dict(best_ms=g))
           for m, c, g in ((100, 1.0, 2.0), (150, 1.5, 2.0))]
  base, bigger = probe_waves._ratios(cases)
  assert base["cublas_time"] == base["core_time"] == base["work"] == 1.0
  assert (bigger["work"], bigger["cublas_time"], bigger["core_time"]) == (1.5, 1.5, 1.0)
  assert bigger["core_over_cublas"] == pytest.approx(2.0 / 1.5)


def test_best_of_rounds_takes_turns_and_keeps_the_least(monkeypatch):
  """The probes' timing: rounds that take turns over the variants, a failed timing kept as
  None and left out of the least."""
  from benchmarks import bench_collective_matmul as bcm
  times = iter([{"ms": 2.0}, {"timing_error": "x"}, {"ms": 1.5}, {"ms": 3.0}])
  calls = []
  monkeypatch.setattr(bcm, "timed_or_error",
                      lambda fn, args, iters, n: calls.append(fn) or next(times))
  got = bcm.best_of_rounds({"a": ("fa", ()), "b": ("fb", ())}, iters=5, rounds=2)
  assert calls == ["fa", "fb", "fa", "fb"]
  assert got == {"a": dict(ms=[2.0, 1.5], best_ms=1.5), "b": dict(ms=[None, 3.0], best_ms=3.0)}


def test_gelu_gemm_probe_checks_every_variant_against_fp32():
  assert probe_gelu_gemm.main(["--smoke"]) == 0


@pytest.mark.slow  # its all-gather kernels' epilogues: test_collective_matmul checks them
def test_gelu_gemm_probe_checks_the_all_gather_variants_too():
  assert probe_gelu_gemm.main(["--smoke", "--all-gather"]) == 0


def test_qkv_gemm_probe_checks_every_variant_against_fp32():
  assert probe_qkv_gemm.main(["--smoke", "--all-gather"]) == 0


def test_gelu_numerics_puts_the_fused_mlp_beside_xla_against_fp32(tmp_path):
  """On CPU the kernels cannot run (said in ``kernels``) and their jnp references stand in:
  rounding h and the gradient once each, they are no further from fp32 than XLA's bf16 MLP."""
  path = gelu_numerics.main(["--shapes", "256x128x512", "--out-dir", str(tmp_path)])
  (case,) = json.loads(open(path).read())["cases"]
  assert "no GPU" in case["kernels"]
  for out in gelu_numerics.OUTPUTS:
    assert 0 < case["fused_vs_fp32"][out] <= case["xla_vs_fp32"][out] < 2e-2, out


def test_sequence_probe_smoke_runs_every_variant(tmp_path):
  """Every sequence of kernels builds and runs (the kernels' jnp references on CPU), with a
  clock stamp after each of its GEMMs (a stand-in off the GPU), and a variant the probe does
  not know is a clear error."""
  path = probe_sequences.main(["--smoke", "--out-dir", str(tmp_path)])
  report = json.loads(path.read_text())
  assert list(report["results"]) == list(probe_sequences.VARIANTS)
  gemms = {"alone": 1, "layers": 2}  # a layer's GEMMs; the pairs run 2
  for name, (got,) in report["results"].items():
    assert got["stamps"] == 2 * gemms.get(name.partition("[")[0], 2), name
  with pytest.raises(ValueError, match="unknown variant"):
    probe_sequences.main(["--smoke", "--out-dir", str(tmp_path), "--variants", "nope[x]"])


def test_clock_stamp_lowers_for_hopper_between_the_ops_it_separates():
  """``sm_clock.between(a, b)``: the stamp kernel lowers for sm_90 (no GPU needed), takes
  ``a`` as its operand, and what reads ``b`` waits for it (an optimization barrier); its
  counters read as MHz."""
  pytest.importorskip("jax_cuda13_plugin", reason="jax-cuda13-plugin not installed")
  import jax.numpy as jnp
  from benchmarks import sm_clock

  def f(x, y):
    a = x * 3
    (b,), s = sm_clock.between(a, (y,))
    return b + 1, s
  text = testing.cuda_lowering(f, jnp.ones((8,)), jnp.ones((8,)))
  stamp_line, = [line for line in text.splitlines() if "sm_clock_stamp" in line
                 and "custom_call" in line]
  assert "mosaic_gpu" in stamp_line and "optimization_barrier" in text
  assert text.index("stablehlo.multiply") < text.index(stamp_line) < text.index(
      "optimization_barrier")
  assert sm_clock.mhz([[40_000, 20_000, 7], [1, 0, 0]])[0] == 2000.0
  with pytest.raises(ValueError):
    sm_clock.stamp(jnp.ones((8,)), spin_ns=0)


def test_clocked_core_lowers_for_hopper_and_its_stamps_read_as_mhz():
  """``sm_clock.clocked_store``: the GEMM core with a stamp as each tile ends lowers for
  sm_90 with its stamps output; ``tile_clocks`` turns each SM's consecutive stamps into its
  clock, across the counters' 32-bit wrap."""
  pytest.importorskip("jax_cuda13_plugin", reason="jax-cuda13-plugin not installed")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import sm_clock
  from taco_jax.pallas_kernels import gemm

  def f(x, w):
    return gemm.matmul_epilogue(x, w, sm_clock.clocked_store(), num_sms=132)
  x, w = jnp.ones((1024, 256), jnp.bfloat16), jnp.ones((256, 512), jnp.bfloat16)
  traced = jax.jit(f).trace(x, w)
  assert [o.shape for o in traced.out_info] == [(1024, 512), (1024, 24)]
  assert "taco_matmul_clocked" in traced.lower(lowering_platforms=("cuda",)).as_text()
  stamps = np.full((4 * 128, 6), -1, np.int64)  # rows other than a tile's first: unwritten
  wrap = lambda v: v - 2**32 if v >= 2**31 else v  # noqa: E731  (int32 as the kernel stores)
  for tile, (clock, ns, sm) in enumerate([(2**32 - 5000, 10_000, 0), (15_000, 20_000, 0),
                                          (0, 12_000, 5), (15_000, 22_000, 5)]):
    stamps[tile * 128] = (wrap(clock), ns, sm, 0, ns - 4_000, sm)  # 4 us tiles, from 6 us
  got = sm_clock.tile_clocks(stamps.astype(np.int32))
  assert (got["median_mhz"], got["min_mhz"], got["sms"]) == (1750, 1500, 2)
  assert (got["tile_us"], got["span_us"]) == (4, 16)


def test_clock_sampler_summarizes_each_gpus_samples():
  """``nvml.ClockSampler`` samples every GPU from its thread while the block runs; the
  summary is per NVML index, with the share of samples with each clock-event reason where
  the GPU gives them, and a GPU that never answers is left out."""
  from benchmarks import nvml

  class FakeGpu:
    def __init__(self, index, clocks):
      self.index, self.clocks = index, iter(clocks)

    def sm_mhz(self):
      return next(self.clocks, 1000)

    def power_w(self):
      return 500.0

    def clock_event_reasons(self):  # None: NVML gives none, as `Gpu`'s read where it fails
      return None

  silent = FakeGpu(1, [])
  silent.sm_mhz = lambda: None
  capped = FakeGpu(2, [])
  capped.clock_event_reasons = lambda: 0x4 | 0x80  # the power cap and the thermal slowdown
  with nvml.ClockSampler([FakeGpu(0, [1980, 1500]), silent, capped],
                         period_s=0.001) as clocks:
    while len(clocks.samples[0]) < 12:
      time.sleep(0.001)
  got = clocks.summary()
  assert list(got) == [0, 2] and got[0]["samples"] >= 12 and got[0]["mean_w"] == 500.0
  assert (got[0]["min_mhz"], got[0]["median_mhz"]) == (1000, 1000)
  assert got[0]["mean_mhz"] > 1000  # the 1980 and 1500 samples count too
  assert "reasons" not in got[0]  # this GPU gives none
  reasons = got[2]["reasons"]
  assert reasons["sw_power_cap"] == reasons["hw_thermal"] == 1.0 and reasons["idle"] == 0.0
  assert nvml.ClockSampler([]).summary() is None
  assert nvml.gpus() == []  # no NVML here


_SCHEDULED = """HloModule step, is_scheduled=true

%command_buffer.1 (p: <T>) -> <T> {
  %p = <T> parameter(0)
  %attn = (<T>, u8[0]{0}) custom-call(<T> %p), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %gte = <T> get-tuple-element((<T>, u8[0]{0}) %attn), index=0
}

%dynamic-slice-fusion.2 (q: <T>) -> <T> {
  %q = <T> parameter(0)
  ROOT %rs = <T> custom-call(<T> %q), custom_call_target="mosaic_gpu_v2", metadata={op_name="<R>"}
}

%a2a.1 (x: <T>) -> <T> {
  %x = <T> parameter(0)
  ROOT %all-to-all.1 = <T> all-to-all(<T> %x), dimensions={0}
}

ENTRY %main (a: <T>, w: <W>) -> <T> {
  %a = <T> parameter(0)
  %w = <W> parameter(1)
  %all-to-all-start = ((<T>), <T>) async-start(<T> %a), calls=%a2a.1
  %all-gather-start = (<T>, <W>) all-gather-start(<T> %w), dimensions={0}
  %call = <T> call(<T> %a), to_apply=%command_buffer.1
  %all-to-all-done = <T> async-done(((<T>), <T>) %all-to-all-start)
  %gemm = (<T>, s8[0]{0}) custom-call(<T> %all-to-all-done), custom_call_target="__cublas$gemm"
  %mosaic = <T> custom-call(<T> %a), custom_call_target="mosaic_gpu_v2", metadata={op_name="<K>"}
  %sliced = <T> fusion(<T> %a), kind=kCustom, calls=%dynamic-slice-fusion.2
  %all-gather-done = <W> all-gather-done((<T>, <W>) %all-gather-start)
  ROOT %add.2 = <T> fusion(<T> %a), kind=kLoop, calls=%fused
}
"""
for _key, _text in (("<T>", "f32[4]"), ("<W>", "f32[8]"), ("<K>", "taco_all_gather_matmul_2"),
                    ("<R>", "jit(matmul_reduce_scatter)/taco_matmul_reduce_scatter_2/mpmd_map")):
  _SCHEDULED = _SCHEDULED.replace(_key, _text)


def test_probe_schedule_reads_the_work_beside_each_asynchronous_collective():
  from benchmarks import probe_schedule
  found = probe_schedule.overlaps(_SCHEDULED)
  assert [(c["kind"], c["work"]) for c in found] == [
      ("all-to-all", {"graph:cudnn": 1}),
      ("all-gather", {"graph:cudnn": 1, "cublas": 1, "mosaic:taco_all_gather_matmul": 1,
                      "mosaic:taco_matmul_reduce_scatter": 1})]
  assert found[0]["shape"] == "f32[4]"
  assert probe_schedule.summary(found + [dict(kind="all-to-all", work={})])["all-to-all"] == {
      "count": 2, "with_work": 1, "work": {"graph:cudnn": 1}}


def test_probe_schedule_smoke_compiles_the_exchange_in_batch_halves(tmp_path):
  """On CPU (no asynchronous collectives) the probe builds bench_train's programs from
  their shapes alone and compiles them, the exchange in batch halves too."""
  from benchmarks import probe_schedule
  variant = probe_schedule.VARIANTS.split(",")[-1]  # the halves: the default's last
  path = probe_schedule.main(["--smoke", "--out-dir", str(tmp_path), "--variants", variant])
  report = json.loads(path.read_text())
  assert list(report["variants"]) == [variant] == ["off_xchg_save_unroll_xparts"]
  assert all(v["compile_s"] > 0 for v in report["variants"].values())
  assert list(tmp_path.glob("hlo_smoke_off_xchg_save_unroll_xparts.txt.gz"))
