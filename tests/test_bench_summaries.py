"""The arithmetic the benchmark scripts report: step-time summaries (and the interleaved
variants' options and report columns), trace overlap, MFU, pipeline memory."""
import json

import pytest

from benchmarks import bench_train, common, pipeline_memory, profile_step


def _rows(**ms):
  return [dict(layout="1,1,4", variant=v, step_ms=t) for v, t in ms.items()]


def test_bench_train_summary_takes_the_better_layers_per_side():
  (s,) = bench_train.summarize(_rows(off=200.0, on=190.0, ideal=150.0, gspmd=180.0,
                                     ring_off=220.0, ring_on=170.0))
  assert s["comm_ms"] == 50.0 and s["comm_share"] == 0.25
  assert s["recovered"] == pytest.approx(0.2)             # (200 - 190) / 50
  assert s["best_off_ms"] == 200.0 and s["best_on_ms"] == 170.0
  assert s["speedup_best"] == pytest.approx(200 / 170)
  assert s["recovered_best"] == pytest.approx(0.6)        # (200 - 170) / 50
  assert s["best_off_vs_gspmd"] == pytest.approx(0.9)
  (plain,) = bench_train.summarize(_rows(off=200.0, on=190.0))
  assert "best_off_ms" not in plain and "comm_ms" not in plain


def test_bench_train_summary_of_the_interleaved_variants():
  (s,) = bench_train.summarize(_rows(off=200.0, on=190.0, gspmd=180.0, off_il2=175.0,
                                     on_il2=170.0))
  assert s["speedup_il2_off"] == pytest.approx(200 / 175)
  assert s["speedup_il2_on"] == pytest.approx(190 / 170)
  assert s["off_il2_vs_gspmd"] == pytest.approx(180 / 175)
  assert s["best_off_ms"] == 175.0 and s["best_on_ms"] == 170.0
  assert s["best_off_vs_gspmd"] == pytest.approx(180 / 175)


def test_bench_train_summary_never_picks_a_graphs_variant_the_trainer_does_not_compile():
  (s,) = bench_train.summarize(_rows(off=200.0, ideal=150.0, off_cm=180.0,
                                     off_cm_graphs=170.0, off_cm_fgraphs=175.0))
  assert s["best_off"] == "off_cm_fgraphs" and s["best_off_ms"] == 175.0  # not _graphs
  assert s["recovered_off_cm"] == pytest.approx(0.4)     # (200 - 180) / 50
  assert s["recovered_off_cm_fgraphs"] == pytest.approx(0.5)  # against off, not off_fgraphs
  (s,) = bench_train.summarize(_rows(off=200.0, ideal=150.0, off_cm=180.0, off_cm_fgraphs=185.0))
  assert s["best_off"] == "off_cm"  # no CUDA graph is as safe as the trainer's
  (s,) = bench_train.summarize(_rows(off=200.0, ideal=150.0, off_cm_fgraphs=175.0,
                                     off_cm_push_fgraphs=180.0))
  assert s["recovered_off_cm_push_fgraphs"] == pytest.approx(0.4)  # its pair is off too
  assert bench_train.parse_variant("off_cm_push_save_fgraphs").push
  assert bench_train.parse_variant("on_cm_wcopy_save_fgraphs").wcopy
  assert bench_train.parse_variant("on_cm_rsw_save_fgraphs").rs_wide
  # a compressed variant without --link compresses everything: said before the run
  assert "on_cm compress every" in bench_train.link_note(
      bench_train.parse_args(["--variants", "off,on_cm"]))
  assert bench_train.link_note(
      bench_train.parse_args(["--variants", "off,on_cm", "--link", "nvlink"])) is None
  assert bench_train.parse_variant("on_cm_dwf32_save_fgraphs").dw_f32
  assert bench_train.parse_variant("ring_off_dwf32_save").dw_f32
  assert bench_train.parse_variant("on_cm_xchg_save_fgraphs").tp_exchange
  assert bench_train.parse_variant("on_cm_xchg_bxla_save_fgraphs").gradient_exchange == "xla"
  assert bench_train.parse_variant("on_cm_xchg_bsplit_save").gradient_exchange == "kernel"
  assert bench_train.parse_variant("on_cm_xchg_save").gradient_exchange == "fused"
  assert bench_train.parse_variant("on_cm_xchg_ffused_save").forward_exchange == "fused"
  assert bench_train.parse_variant("on_cm_xchg_save").forward_exchange == "kernel"
  (s,) = bench_train.summarize(_rows(off_save=200.0, ideal_save=150.0, off_xchg_save=190.0,
                                     on_cm_xchg_save_fgraphs=170.0,
                                     on_cm_xchg_bxla_save_fgraphs=165.0))
  assert s["recovered_off_xchg_save"] == pytest.approx(0.2)  # against the collectives
  assert s["recovered_on_cm_xchg_save_fgraphs"] == pytest.approx(0.6)
  assert s["recovered_on_cm_xchg_bxla_save_fgraphs"] == pytest.approx(0.7)
  # the best of each side, against the ideal of the best off variant's remat policy
  assert s["recovered_best"] == pytest.approx((190 - 165) / (190 - 150))
  (s,) = bench_train.summarize(_rows(off=200.0, ideal=150.0, gspmd=210.0, off_cm_fgraphs=175.0,
                                     ideal_cm_fgraphs=160.0))
  assert s["ceiling_ideal_cm_fgraphs"] == pytest.approx(0.8)  # (200 - 160) / 50
  assert "recovered_ideal_cm_fgraphs" not in s and "ideal_cm_fgraphs_vs_gspmd" not in s
  assert s["best_off"] == "off_cm_fgraphs"  # an ideal is never picked
  (s,) = bench_train.summarize(_rows(off=200.0, ideal=150.0, off_cm=180.0, on_cm=170.0,
                                     ideal_cm=160.0))
  assert s["recovered_cm"] == pytest.approx(0.5)  # compression's share of the kernels' exposed
  assert s["comm_share_cm"] == pytest.approx(20 / 180)


def test_bench_train_summary_of_the_pgle_variants():
  (s,) = bench_train.summarize(_rows(off=200.0, on=190.0, ideal=150.0, gspmd=180.0,
                                     off_pgle=185.0, on_pgle=172.0, on_il2_pgle=175.0))
  assert s["speedup_pgle_off"] == pytest.approx(200 / 185)
  assert s["speedup_pgle_on"] == pytest.approx(190 / 172)
  assert s["speedup_il2_pgle_on"] == pytest.approx(190 / 175)
  assert s["off_pgle_vs_gspmd"] == pytest.approx(180 / 185)
  assert (s["best_off"], s["best_on"]) == ("off_pgle", "on_pgle")
  assert s["recovered_best"] == pytest.approx((185 - 172) / (185 - 150))
  assert s["best_off_vs_gspmd"] == pytest.approx(180 / 185)
  assert s["recovered"] == pytest.approx(0.2)  # the plain pair's, unchanged


def test_bench_train_summary_of_a_modified_pair():
  (s,) = bench_train.summarize(_rows(off=210.0, on=200.0, off_save=190.0, on_save=180.0,
                                     ideal_save=150.0, gspmd=192.0))
  assert s["speedup_save_off"] == pytest.approx(210 / 190)
  assert s["speedup_on_vs_off_save"] == pytest.approx(190 / 180)
  assert s["recovered_save"] == pytest.approx(10 / 40)
  assert s["comm_share_save"] == pytest.approx(40 / 190)
  assert s["off_save_vs_gspmd"] == pytest.approx(192 / 190)
  assert "recovered" not in s  # no plain ideal
  # the exchange program's levers are measured against the collectives' pair, as it is
  (s,) = bench_train.summarize(_rows(off_save_unroll=180.0, ideal_save_unroll=150.0,
                                     on_cm_xchg_save_unroll=160.0,
                                     on_cm_xchg_save_unroll_wgat_xparts=156.0))
  assert s["recovered_on_cm_xchg_save_unroll"] == pytest.approx(20 / 30)
  assert s["recovered_on_cm_xchg_save_unroll_wgat_xparts"] == pytest.approx(24 / 30)
  (s,) = bench_train.summarize(_rows(off_save_dots=160.0, ideal_save_dots=140.0))
  assert s["comm_share_save_dots"] == pytest.approx(20 / 160)  # no compressed step needed
  assert "recovered_save_dots" not in s


def test_bench_train_variants_and_their_compile_options():
  from taco_jax.tp.step import INTERLEAVE_XLA_OPTIONS, compiler_options
  args = bench_train.parse_args(["--variants", "off,off_il2,on_il2"])
  v = bench_train.parse_variant
  assert [v(n).interleave for n in ("off", "off_il2", "on_il2", "on_il2_pgle", "off_pgle")] == [
      1, 2, 2, 2, 1]
  assert bench_train.xla_options(v("off"), args) == {}
  assert bench_train.xla_options(v("on_il2"), args) == INTERLEAVE_XLA_OPTIONS
  args = bench_train.parse_args(["--variants", "on_il2", "--no-interleave-options"])
  assert bench_train.xla_options(v("on_il2"), args) == {}
  assert bench_train.xla_options(v("on_il2_save_cif2_pgle"), args) == compiler_options(
      collectives_in_flight=2)  # the latency-hiding scheduler, 2 collectives in flight
  assert [v(n).collectives_in_flight for n in ("on", "off_cif2", "gspmd_cif4_pgle")] == [1, 2, 4]
  # the kernel layers' steps: no CUDA graph, graphs for all but the kernels (the trainer's),
  # or for the kernels too (timing only)
  assert bench_train.xla_options(v("off_cm_save"), args) == {"xla_gpu_enable_command_buffer": ""}
  assert bench_train.xla_options(v("off_cm_save_fgraphs"), args) == compiler_options(
      kernels=True) == {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN"}
  assert bench_train.xla_options(v("off_cm_save_graphs"), args) == {}


def test_bench_train_variant_names():
  v = bench_train.parse_variant("ring_on_il2_save_pgle")
  assert (v.base, v.interleave, v.save_tp_outputs, v.pgle, v.compressed, v.ours) == (
      "ring_on", 2, True, True, True, True)
  assert not bench_train.parse_variant("ideal_save").compressed
  assert not bench_train.parse_variant("gspmd_pgle").ours
  v = bench_train.parse_variant("off_save_dots")
  assert (v.save_tp_outputs, v.save_dots, v.save_attention, v.remat) == (True, True, False, True)
  assert bench_train.parse_variant("off_save_dots_attn_unroll").save_attention
  assert [bench_train.parse_variant(n).remat for n in ("off_noremat", "gspmd_noremat_pgle")] == [
      False, False]
  v = bench_train.parse_variant("on_save_zero_pgle")
  assert (v.shard_optimizer, v.save_tp_outputs, v.pgle) == (True, True, True)
  assert not bench_train.parse_variant("on_save").shard_optimizer
  assert [bench_train.parse_variant(n).scan_layers for n in ("off_dots_unroll", "off_dots")] == [
      False, True]
  assert bench_train.parse_variant("off_save_dots_attn_head_gelu_unroll").fused_gelu
  assert not bench_train.parse_variant("off_save_dots_attn_head_unroll").fused_gelu
  cm = bench_train.parse_variant("on_cm_xchg_save_dots_attn_head_gelu_unroll_fgraphs")
  assert cm.fused_gelu and cm.kernels and not cm.db_xla
  assert bench_train.parse_variant("off_save_dots_attn_head_gelu_dbxla_unroll").db_xla
  assert bench_train.parse_variant("off_save_dots_unroll_f32w").f32_weights
  assert bench_train.parse_variant("on_cm_xchg_save_dots_unroll_wgat").gather_weights
  assert [bench_train.parse_variant(n).exchange_parts
          for n in ("off_xchg_save_xparts", "on_cm_xchg_save_dots_unroll_wgat",
                    "off_cm_xchg_unroll_xparts4")] == [2, 1, 4]
  assert bench_train.parse_variant("on_cm_xchg_nolink_save_fgraphs").every_link
  assert bench_train.parse_variant("ring_on_nolink_save").every_link and not cm.every_link
  args = bench_train.parse_args(["--variants", "off", "--link", "nvlink", "--compress",
                                 "tp_forward,dp_params"])
  plans = {v: bench_train.variant_plan(bench_train.parse_variant(v), args)
           for v in ("off_cm", "on_cm", "on_cm_nolink", "on_cm_zero")}
  assert plans["off_cm"].tp_forward is None
  assert plans["on_cm"].tp_forward.link == "nvlink"
  assert plans["on_cm_nolink"].tp_forward.link is None
  assert plans["on_cm"].dp_params is None and plans["on_cm_zero"].dp_params is not None
  assert not cm.gather_weights
  qkv = bench_train.parse_variant("on_cm_xchg_save_dots_attn_head_gelu_qkv_unroll_fgraphs")
  assert qkv.fused_qkv and qkv.fused_gelu and not cm.fused_qkv
  cublas = bench_train.parse_variant("off_save_unroll_cublas")
  assert cublas.cublas and not cm.cublas
  assert bench_train.xla_options(cublas, bench_train.parse_args([]))[
      "xla_gpu_enable_triton_gemm"] is False
  for bad in ("of", "on_pgle_il2", "on_il2_il2", "gspmd_save", "on_", "on_x", "off_dots_save",
              "off_save_noremat", "off_dots_noremat", "off_attn_noremat", "off_attn_dots",
              "gspmd_dots", "gspmd_zero", "ideal_zero",
              "off_zero_save", "gspmd_unroll", "off_unroll_dots", "on_cif2_cif4",
              "on_pgle_cif2", "gspmd_save_cif2", "off_save_graphs", "off_cm_graphs_pgle",
              "off_save_fgraphs", "off_cm_graphs_fgraphs", "off_push", "off_save_cm_push",
              "off_cm_save_push", "off_wcopy", "on_cm_save_wcopy", "off_rsw", "off_xchg_bxla",
              "off_dwf32",
              "on_cm_bxla", "on_cm_bxla_xchg", "on_cm_xchg_bxla_bsplit", "off_xchg_bsplit",
              "on_cm_ffused", "on_cm_ffused_xchg", "ring_off_gelu", "ring_on_qkv", "off_qkv_gelu",
              "off_gelu_head", "off_dbxla", "off_dbxla_gelu", "gspmd_cublas", "off_save_f32w",
              "off_save_unroll_wgat", "off_xchg_save_wgat", "off_cm_nolink", "ideal_nolink",
              "off_cm_save_xparts", "off_xchg_xparts_wgat", "off_xchg_xparts_xparts4",
              "off_cublas_unroll"):
    with pytest.raises(ValueError, match="unknown variant"):
      bench_train.parse_variant(bad)
  for variants in ("off,on_save", "off_dots"):
    with pytest.raises(SystemExit):
      bench_train.parse_args(["--variants", variants, "--no-remat"])


def _write_bench_train(tmp_path, name, num_devices=4, extra=None, **ms):
  d = dict(label=name, device="NVIDIA H200", num_devices=num_devices,
           environment=dict(platform="gpu"),
           config=dict(model="1.3b", seq=2048, batch=8, group_size=128, flops_per_token=1e10),
           results=[dict(layout="1,1,4", variant=v, step_ms=t, tokens_per_s=1e5)
                    for v, t in ms.items()],
           summary=[], **(extra or {}))
  (tmp_path / f"bench_train_{name}.json").write_text(json.dumps(d))


def _cells(row: str) -> list[str]:
  return [c.strip() for c in row.strip().strip("|").split("|")]


def test_report_adds_the_interleaved_columns_only_once_measured(tmp_path, monkeypatch):
  from benchmarks import report
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  _write_bench_train(tmp_path, "a", off=200.0)
  assert "il2" not in report.bench_train_section()
  _write_bench_train(tmp_path, "b", off=200.0, off_il2=180.0)
  text = report.bench_train_section()
  header, _, row_a, row_b = text.strip().splitlines()[-4:]
  assert "| ring on | off il2 | on il2 | ideal |" in header
  assert "| – | – | – | – | – |" in row_a  # ring off, ring on, off il2, on il2, ideal
  assert "| – | – | 180 | – | – |" in row_b


def test_report_has_a_row_per_remat_policy_with_its_own_ratios(tmp_path, monkeypatch):
  from benchmarks import report
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  _write_bench_train(tmp_path, "r", off=210.0, on=200.0, off_save=190.0, on_save=180.0,
                     ideal_save=165.0, gspmd=195.0, on_save_pgle=178.0)
  header, _, plain, save = report.bench_train_section().strip().splitlines()[-4:]
  col = dict(zip(_cells(header), zip(_cells(plain), _cells(save))))
  assert col["remat"] == ("recompute", "save TP outputs")
  assert col["off"] == ("210", "190") and col["on"] == ("200", "180")
  assert col["ideal"] == ("–", "165") and col["GSPMD"] == ("195", "195")
  assert col["on speedup"] == (f"{210 / 200:.3g}", f"{190 / 180:.3g}")
  assert col["recovered"] == ("–", "0.4")                       # (190 - 180) / (190 - 165)
  assert col["GSPMD / off"] == (f"{195 / 210:.3g}", f"{195 / 190:.3g}")
  assert col["other variants (ms)"] == ("on_save_pgle 178",) * 2


def test_report_rows_of_the_saving_policies_with_both_mfus_and_the_attention(tmp_path,
                                                                             monkeypatch):
  """`_dots`, `_save_dots`, `_noremat` and `_zero` / `_unroll` programs get rows of their
  own, in the run's order; MFU against the spec peak and against the run's measured matmul
  ceiling (none where that ceiling is implausible); a table per setup (device count)."""
  from benchmarks import report
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  _write_bench_train(tmp_path, "p", num_devices=2, off_save=200.0, off_save_dots=180.0,
                     off_noremat=170.0, off_dots=190.0, off_dots_zero_unroll=185.0, extra=dict(
                         attention=dict(backend="cudnn"),
                         ceilings=dict(matmul_bf16=dict(tflops=500.0))))
  _write_bench_train(tmp_path, "q", off=210.0, extra=dict(
      ceilings=dict(matmul_bf16=dict(tflops=1200.0))))  # the doubled ceiling of old runs
  two, four = report.bench_train_section().split("### Training step")[1:]
  assert "2x NVIDIA H200" in two and "4x NVIDIA H200" in four
  assert "Columns as in the table above." in four
  header, _, *rows = two.strip().splitlines()[-7:]
  cols = [dict(zip(_cells(header), _cells(r))) for r in rows]
  assert [(c["remat"], c["off"]) for c in cols] == [
      ("save TP outputs", "200"), ("save TP outputs + dots", "180"), ("none", "170"),
      ("save dots", "190"), ("save dots, ZeRO, unrolled", "185")]
  assert {c["attention"] for c in cols} == {"cudnn"}
  tflops = 1e5 * 1e10 / 1e12  # 1000 TFLOP/s over 2 devices
  assert cols[0]["MFU off (spec)"] == f"{tflops / (2 * 989.4):.3g}"
  assert cols[0]["MFU off (matmul)"] == f"{tflops / (2 * 500.0):.3g}"
  header, _, row = four.strip().splitlines()[-3:]
  col = dict(zip(_cells(header), _cells(row)))
  assert col["attention"] == "xla" and col["MFU off (matmul)"] == "–"


def test_report_keeps_a_run_of_only_gspmd(tmp_path, monkeypatch):
  from benchmarks import report
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  _write_bench_train(tmp_path, "g", gspmd=190.0)
  header, _, row = report.bench_train_section().strip().splitlines()[-3:]
  col = dict(zip(_cells(header), _cells(row)))
  assert col["GSPMD"] == "190" and col["off"] == "–" and col["remat"] == "recompute"


def test_report_transport_section(tmp_path, monkeypatch):
  from benchmarks import report
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  assert report.transport_section() == ""
  ms = dict(zip(report.TRANSPORTS, (0.2, 0.1, 0.11, 0.12, 0.3, 0.15, 0.16, 0.17)))
  results = [dict(setting="default", op=op, payload=p, median_ms=t, bytes_per_device=2**20)
             for (op, p), t in ms.items()]
  results.append(dict(setting="NCCL_PROTO=Simple", error=["boom"]))
  d = dict(label="nvlink", platform="gpu", num_devices=4, device="NVIDIA H200",
           config=dict(rows=4096, hidden=2048, group_size=128), results=results)
  (tmp_path / "transport_nvlink.json").write_text(json.dumps(d))
  *_, default, failed = report.transport_section().strip().splitlines()
  assert _cells(default)[-2:] == ["2", "2"]  # 0.2 / 0.1 and 0.3 / 0.15
  assert _cells(failed)[1] == "failed"


def test_report_dp_codec_section(tmp_path, monkeypatch):
  """benchmarks/measure_dp_codec.py's results: e4m3 per group size and the best with the
  transform, int4 per group size, the best fp4 and the best 4-bit with the transform; the
  weight differences' lag after the last step, with and without error feedback."""
  from benchmarks import report
  monkeypatch.setattr(report, "RESULTS", tmp_path)
  assert report.dp_codec_section() == ""

  def row(f, g, h, rel):
    return dict(format=f, group_size=g, hadamard=h, rel_l2=rel, share_off_by_8th=0.0,
                score=rel, bits_per_element=(4 + 32 / g) if f in ("int4", "fp4") else 8 + 64 / g)

  fp8 = [row("e4m3", g, h, 0.02 + g / 1e4 + h / 1e3) for g in (256, 32) for h in (0, 1)]
  four = [row(f, g, h, 0.1 + g / 1e4 + (f == "fp4") / 1e3 + h / 1e2)
          for f in ("int4", "fp4") for g in (64, 32) for h in (0, 1)]
  table = dict(fp8=sorted(fp8, key=lambda r: r["score"]),
               four_bit=sorted(four, key=lambda r: r["score"]))
  lag = lambda r: dict(r, with_feedback=[0.5, r["rel_l2"]],  # noqa: E731
                       without_feedback=[0.5, 3 * r["rel_l2"]])
  d = dict(model=dict(n_layers=4, d_model=128, params=1000), trained=dict(steps=400),
           captured=dict(steps=2), args=dict(mesh=[8, 1, 1]), capture_config=dict(name="tiny"),
           choice={f: dict(setting=dict(format="e4m3", group_size=256, hadamard=False))
                   for f in ("dp", "dp_params")},
           families=dict(dp=table, dp_params=table),
           feedback=dict(steps=2, update_norm=[1.0, 2.0], weight_norm=1000.0,
                         fp8=[lag(r) for r in fp8], four_bit=[lag(r) for r in four]))
  (tmp_path / "measure_dp_codec_tiny_8cpu_20261123.json").write_text(json.dumps(d))
  text = report.dp_codec_section()
  assert "dp: e4m3 G=256; dp_params: e4m3 G=256" in text and "weights: 0.002" in text
  rows = [_cells(r) for r in text.splitlines() if r.startswith("| dp")]
  assert [r[1] for r in rows[:7]] == ["e4m3 G=32", "e4m3 G=256", "e4m3 G=32 Hadamard",
                                      "int4 G=32", "int4 G=64", "fp4 G=32", "int4 G=32 Hadamard"]
  assert rows[3][2:] == ["5", "0.103", "0", "–", "–"]  # dp: no lag
  assert rows[7 + 3][2:] == ["5", "0.103", "0", "0.103", "0.31"]


def test_trace_summary_counts_only_uncovered_nccl_time_and_the_idle_device():
  def x(name, ts, dur, pid=1):
    return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=0)

  events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
            x("sm90_xmma_gemm_bf16", 0, 100), x("loop_add_fusion_3", 150, 20),
            x("loop_add_fusion_12", 170, 30),
            x("ncclDevKernel_AllGather", 80, 40),    # 20 of 40 under the gemm
            x("ncclDevKernel_ReduceScatter", 210, 30),  # none covered
            x("MemcpyH2D", -50, 1),  # the first step's set-up: not idle time
            x("host work", 0, 1000, pid=2)]
  (dev, got), = profile_step.summarize_trace(events, steps=2).items()
  assert dev == "/device:GPU:0"
  assert got["nccl_ms"] == pytest.approx(70 / 1e3 / 2)
  assert got["nccl_exposed_ms"] == pytest.approx(50 / 1e3 / 2)
  assert got["compute_ms"] == pytest.approx(151 / 1e3 / 2)
  assert got["idle_ms"] == pytest.approx(40 / 1e3 / 2)  # 120-150 and 200-210 run nothing
  assert got["busy_ms"]["gemm"] == pytest.approx(0.05)
  assert got["top_kernels_ms"]["loop_add_fusion"] == pytest.approx(50 / 1e3 / 2)
  assert list(got["top_kernels_ms"])[0] == "sm90_xmma_gemm_bf16"
  assert got["call_us"]["loop_add_fusion"] == {20: 0.5, 30: 0.5}  # a 20 and a 30 us call
  assert len(got["call_us"]) == 4 and got["call_us"]["sm90_xmma_gemm_bf16"] == {100: 0.5}
  assert got["beside_nccl"] == {"sm90_xmma_gemm_bf16": dict(calls=0.5, us=100, alone_us=None)}
  (_, only_copies), = profile_step.summarize_trace(events[:2] + [x("MemcpyH2D", 0, 5)],
                                                   steps=1).items()
  assert only_copies["idle_ms"] == 0


def test_trace_summary_times_the_calls_that_ran_beside_an_nccl_collective():
  """A kernel's calls that overlap one of NCCL's collective kernels, against its others; the
  barrier kernel XLA runs before a peer kernel, on its stream, is no collective."""
  def x(name, ts, dur):
    return dict(ph="X", name=name, ts=ts, dur=dur, pid=1, tid=0)

  events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            x("taco_all_gather_matmul_2_mosaic_gpu_kernel", 0, 30),
            x("taco_all_gather_matmul_2_mosaic_gpu_kernel", 40, 40),   # beside the gather
            x("ncclDevKernel_AllGather_RING_LL", 50, 10),
            x("taco_all_gather_matmul_2_mosaic_gpu_kernel", 100, 34),
            x("stream_executor::gpu::MultiGpuBarrierWithNcclKernelImpl", 96, 6)]
  (_, got), = profile_step.summarize_trace(events, steps=1).items()
  assert got["beside_nccl"] == {"taco_all_gather_matmul_2_mosaic_gpu_kernel": dict(
      calls=1.0, us=40.0, alone_us=32.0)}


def test_trace_summary_splits_each_steps_gemm_calls_into_halves():
  """Two steps of four calls: a layer's forward (10-12 us) before its backward (20-22),
  the events not in time order, no pass boundary to find; a fusion outside the first
  ``calls`` is not timed."""
  starts_durations = [(0, 10), (20, 12), (40, 20), (60, 22), (100, 12), (120, 10),
                      (140, 22), (160, 20)]
  events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0"))]
  events += [dict(ph="X", name="nvjet_sm90_gemm", ts=t, dur=d, pid=1, tid=0)
             for t, d in reversed(starts_durations)]
  events += [dict(ph="X", name="loop_add_fusion", ts=200, dur=1, pid=1, tid=0)]
  (_, got), = profile_step.summarize_trace(events, steps=2, calls=1).items()
  assert got["call_us"] == {"nvjet_sm90_gemm": {10: 2.0, 20: 2.0}}
  assert got["call_us_halves"] == {"nvjet_sm90_gemm": [{10: 2.0}, {20: 2.0}]}
  assert "call_us_passes" not in got  # no head's GEMM: no pass boundary found


def _step_trace():
  """Two steps: forward GEMMs (10 us), the head's (100 us), backward GEMMs (20 us), then
  the optimizer's update, 200 us without a GEMM, before the next step."""
  calls = []
  for t0 in (0, 400):
    calls += [("nvjet_gemm", t0, 10), ("nvjet_gemm", t0 + 20, 10), ("nvjet_head", t0 + 40, 100),
              ("nvjet_gemm", t0 + 150, 20), ("nvjet_gemm", t0 + 180, 20)]
  return [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0"))] + [
      dict(ph="X", name=n, ts=t, dur=d, pid=1, tid=0) for n, t, d in calls]


def test_trace_summary_splits_the_calls_by_pass_at_the_head_and_the_update():
  gemms = [(e["ts"], e["ts"] + e["dur"]) for e in _step_trace()[1:]]
  assert profile_step.pass_bounds(gemms, steps=2) == [(40, 200), (440, 600)]
  assert profile_step.pass_bounds(gemms, steps=3) == []  # two heads: not three steps
  (_, got), = profile_step.summarize_trace(_step_trace(), steps=2).items()
  assert got["call_us_passes"]["nvjet_gemm"] == {"forward": {10: 2.0}, "backward": {20: 2.0}}
  assert got["call_us_passes"]["nvjet_head"] == {"forward": {}, "backward": {100: 1.0}}
  assert "call_us_halves" not in got  # the passes found: no halves beside them


def test_resummarize_rewrites_a_runs_summaries_from_its_kept_traces(tmp_path):
  import gzip
  result = tmp_path / "profile_step_x_1gpu_20261128.json"
  result.write_text(json.dumps(dict(label="x", traced_steps=2, variants={"off": {}})))
  with pytest.raises(FileNotFoundError, match="no trace of off"):
    profile_step.resummarize(result)
  (tmp_path / profile_step.TRACES).mkdir()
  (tmp_path / profile_step.TRACES / "trace_x_off.json.gz").write_bytes(
      gzip.compress(json.dumps({"traceEvents": _step_trace()}).encode()))
  profile_step.main(["--resummarize", str(result)])
  got = json.loads(result.read_text())["variants"]["off"]["/device:GPU:0"]
  assert got["call_us_passes"]["nvjet_gemm"]["backward"] == {"20": 2.0}


def test_attention_numerics_compares_cudnn_with_xla_and_both_with_fp32(monkeypatch):
  """The GPU branch of `attention_numerics.compare`, run on CPU with XLA standing in for
  cuDNN: the stand-in equals XLA exactly, and bf16 XLA differs from the fp32 reference."""
  import jax.numpy as jnp

  from benchmarks import attention_numerics
  from taco_jax.models import attention
  from taco_jax.models.qwen import QwenConfig
  cfg = QwenConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=16)
  off_gpu = attention_numerics.compare(cfg, batch=2, seq=16)
  assert off_gpu["cudnn"] == "unavailable" and "no GPU" in off_gpu["reason"]
  assert "cuDNN unavailable" in attention_numerics.summary_line(off_gpu)
  monkeypatch.setattr(attention_numerics, "attention_implementation", lambda *a: "cudnn")
  monkeypatch.setattr(attention_numerics, "causal_attention",
                      lambda q, k, v, impl: attention.causal_attention(q, k, v, "xla"))
  got = attention_numerics.compare(cfg, batch=2, seq=16)
  assert got["cudnn"] == "compared" and got["dtype"] == jnp.dtype(jnp.bfloat16).name
  assert (got["q_shape"], got["kv_shape"]) == ([2, 16, 4, 8], [2, 16, 2, 8])
  for name in attention_numerics.OUTPUTS:
    assert got["cudnn_vs_xla"][name] == dict(max_abs=0.0, rel_l2=0.0)
    assert got["xla_vs_fp32"][name]["rel_l2"] > 0
  assert "cuDNN vs XLA on q 2x16x4x8 bfloat16" in attention_numerics.summary_line(got)


def test_mfu_is_against_the_spec_peak():
  assert common.mfu(1e4, 1e9, 4, "NVIDIA H200") == pytest.approx(1e13 / (4 * 989.4e12))
  assert common.mfu(1e4, 1e9, 4, "cpu") is None


def test_report_lists_variants_without_a_column_of_their_own():
  from benchmarks import report
  results = [dict(layout="1,1,4", variant=v, step_ms=ms) for v, ms in
             (("off", 210.2), ("off_pgle", 209.4), ("on_il2_pgle", 202.6), ("on_il2_save", 190.0),
              ("gspmd", 191.0))]
  results.append(dict(layout="1,2,2", variant="on_pgle", step_ms=250.0))
  assert report._other_variants(results, "1,1,4") == "off_pgle 209, on_il2_pgle 203"
  assert report._other_variants(results[:1], "1,1,4") == "–"


def test_pipeline_memory_splits_gpipe_into_a_constant_and_a_slope():
  """GPipe's temporaries 100 + 10 m: C = 100, A = 10; a 1F1B that holds 2 micro-batches
  whatever m (120) has a share of 20 / (10 m) of GPipe's activations, pp / m at pp = 2."""
  rows = [dict(schedule=s, microbatches=m, temp_bytes=t) for s, m, t in (
      ("gpipe", 2, 120), ("gpipe", 4, 140), ("gpipe", 8, 180),
      ("1f1b", 2, 120), ("1f1b", 4, 120), ("1f1b", 8, 120))]
  s = pipeline_memory.summarize(rows, pp=2)
  assert s["bytes_per_microbatch"] == pytest.approx({"gpipe": 10.0, "1f1b": 0.0})
  assert s["constant_bytes"] == pytest.approx(100.0)
  shares = s["share_of_gpipe_activations"]["1f1b"]
  assert {m: v["share"] for m, v in shares.items()} == pytest.approx({2: 1.0, 4: 0.5, 8: 0.25})
  assert all(v["pp_over_m"] == pytest.approx(2 / m) for m, v in shares.items())


def test_profile_rs_kernel_summary_counts_regions_per_compute_warpgroup():
  """`profile_rs_kernel.summarize`: per region the mean time per warpgroup that ran `mma`
  (the memory warpgroup's track is left out), nested regions counted inside their parent,
  and `other` the part of a track outside its top-level regions."""
  from benchmarks.profile_rs_kernel import summarize

  def region(tid, name, begin, end):
    return [dict(name=name, ph="B", ts=begin, pid=1, tid=tid),
            dict(name=name, ph="E", ts=end, pid=1, tid=tid)]

  events = []
  for tid, wait in ((1, 2.0), (2, 4.0)):
    begin, end = region(tid, "epilogue", 12, 20)
    events += region(tid, "mma", 0, 10) + [begin, *region(tid, "wait_read", 13, 13 + wait), end]
    events += region(tid, "wait_read", 21, 22)  # a later wait: counted, not first
  events += region(3, "wait_peers", 0, 30)  # the memory warpgroup
  got = summarize(dict(traceEvents=events))
  assert got["compute_warpgroups"] == 2 and got["span_us"] == 30
  assert got["regions"]["mma"] == dict(mean_us=10.0, mean_count=1.0, first_mean_us=10.0)
  assert got["regions"]["epilogue"]["mean_us"] == 8.0
  assert got["regions"]["wait_read"] == dict(mean_us=4.0, mean_count=2.0, first_mean_us=3.0)
  assert got["regions"]["other"]["mean_us"] == 3.0  # 10-12 and 20-21: outside every region
  assert "wait_peers" not in got["regions"]


def test_profile_rs_kernel_keeps_a_trace_per_device(tmp_path):
  """The profiler's one trace name per call: inside `trace_per_device` a second device's
  exclusive open takes the next free name instead of failing."""
  from jax._src.pallas.mosaic_gpu import pallas_call_registration as registration

  from benchmarks.profile_rs_kernel import trace_per_device
  path = str(tmp_path / "kernel-123-trace.json")
  with trace_per_device():
    for device in range(3):
      with registration.open(path, "x") as f:
        f.write(str(device))
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "kernel-123-dev1-trace.json", "kernel-123-dev2-trace.json", "kernel-123-trace.json"]
  assert not hasattr(registration, "open")  # the module's builtin open again


def test_profile_rs_kernel_returns_the_last_calls_traces_only(tmp_path):
  """Each call writes one trace per device; `_traced_call` returns the last call's two,
  not every call's traces found again under their moved names."""
  from jax._src.pallas.mosaic_gpu import pallas_call_registration as registration

  from benchmarks.profile_rs_kernel import _traced_call
  calls = []

  def fn():  # what a profiled kernel on two devices leaves in the trace folder
    calls.append(len(calls))
    for device in range(2):
      with registration.open(str(tmp_path / "kernel-7-trace.json"), "x") as f:
        f.write(f"call {calls[-1]} device {device}")
    return 0
  kept = _traced_call(fn, (), tmp_path, calls=3)
  assert sorted(p.read_text() for p in kept) == ["call 2 device 0", "call 2 device 1"]


def test_report_collective_matmul_columns_follow_what_ran():
  """A run's variants of the fused kernels get columns after them, in the run's order;
  the references keep their order; the diagnostics of any kernel (marked so) too; a
  tiling sweep of the GEMM core or of `gemm` and what did not run (no `ms`) get none."""
  from benchmarks.report import _cm_columns
  ms = {"ms": 1.0}
  cases = [dict(variants={"cublas": ms, "fused": ms, "fused[pull=3]": ms, "xla": ms,
                          "core[stages=4]": ms, "gemm": ms, "gemm[chain=0]": ms}),
           dict(variants={"fused[pull=1]": ms, "fused_fp8": {"error": "failed its check"},
                          "gemm[skip=copy]": dict(ms, diagnostic="wrong by design")})]
  assert _cm_columns(cases) == ["xla", "fused", "fused[pull=3]", "fused[pull=1]",
                                "gemm[skip=copy]", "gemm", "cublas"]


def test_collective_matmul_runs_newest_first_the_older_ones_folded():
  from benchmarks import report
  parts = [("2026-11-23T10:00", "a", "A\n"), ("2026-11-27T09:00", "c", "C\n"),
           ("2026-11-25T08:00", "b", "B\n")]
  assert report._newest_open(parts, 3) == ["C\n", "B\n", "A\n"]
  shown, folded = report._newest_open(parts, 1)[0], report._newest_open(parts, 1)[1:]
  assert shown == "C\n" and folded == [
      "<details><summary>2 earlier runs</summary>\n\nB\n\nA\n\n</details>\n"]
