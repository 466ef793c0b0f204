"""How a pipeline schedule's memory grows with the micro-batches (issue 17), compiled only.

At a fixed micro-batch size, GPipe keeps every micro-batch's activations until its backward,
so its compiled temporaries grow by one micro-batch's activations (A) per micro-batch; 1F1B
keeps at most 2 (pp - 1) micro-batches, whatever m is. For each schedule and m in
`--microbatch-counts` (global batch = m x `--microbatch-size`) the step is compiled, never
run, and `memory_analysis()` read. What every schedule holds whatever m is (gradient
accumulators, parameters in the compute dtype, the head) is C, GPipe's intercept: a
least-squares line through its temporaries gives A (slope) and C. The issue's target,
1F1B's activations at most pp / m of GPipe's plus a constant, reads here as
(temp_1f1b(m) - C) / (temp_gpipe(m) - C) beside pp / m.

GPU (2xH200, PP=2, 1.3B, a few minutes of compiles; NVLink multicast off):
  python benchmarks/pipeline_memory.py --layouts 1,2,1
CPU smoke test (8 fake devices, tiny model):
  python benchmarks/pipeline_memory.py --smoke
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.args import add_output_args, parse_with_smoke, write_report  # noqa: E402
from benchmarks.train_parallel import SMOKE, add_run_args  # noqa: E402 (no JAX import)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_run_args(p, model="1.3b", layouts="1,2,1", steps=40, warmup=3, seq=2048, batch=1)
  p.add_argument("--schedules", default="gpipe,1f1b")
  p.add_argument("--microbatch-counts", default="2,4,8,16")
  p.add_argument("--microbatch-size", type=int, default=1, help="sequences per micro-batch")
  p.add_argument("--save-tp-outputs", action=argparse.BooleanOptionalAction, default=True)
  add_output_args(p, label="pp2", smoke="CPU, 8 fake devices, tiny model")
  return parse_with_smoke(p, argv, dict(SMOKE, layouts="1,2,4", microbatch_counts="2,4,6"))


def summarize(rows: list[dict], pp: int) -> dict:
  """Per schedule, its temporaries' growth per micro-batch (least squares over m); GPipe's
  intercept as the constant C; each other schedule's share of GPipe's activations per m,
  (temp(m) - C) / (temp_gpipe(m) - C), beside pp / m."""
  temp = {(r["schedule"], r["microbatches"]): r["temp_bytes"] for r in rows}
  growth = {}  # schedule -> (slope, intercept) of its temporaries over m
  for s in dict.fromkeys(s for s, _ in temp):
    ms = sorted(m for t, m in temp if t == s)
    if len(ms) > 1:
      growth[s] = tuple(float(c) for c in np.polyfit(ms, [temp[s, m] for m in ms], 1))
  if "gpipe" not in growth:
    return dict(bytes_per_microbatch={s: g[0] for s, g in growth.items()})
  constant = growth["gpipe"][1]
  shares = {}
  for (s, m), t in sorted(temp.items()):
    if s != "gpipe" and ("gpipe", m) in temp:
      shares.setdefault(s, {})[m] = dict(
          share=(t - constant) / (temp["gpipe", m] - constant), pp_over_m=pp / m)
  return dict(bytes_per_microbatch={s: g[0] for s, g in growth.items()},
              constant_bytes=constant, share_of_gpipe_activations=shares)


def main(argv=None) -> Path:
  args = parse_args(argv)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  import jax
  from benchmarks import common
  from benchmarks.train_parallel import build_step, model_and_optimizer
  from taco_jax.plan import CompressionPlan

  layout = tuple(int(v) for v in args.layouts.split(","))
  dp, pp, tp = layout
  if dp * pp * tp != jax.device_count() or pp < 2:
    raise SystemExit(f"--layouts {args.layouts}: needs pp >= 2 and dp pp tp = the "
                     f"{jax.device_count()} devices")
  cfg, tx = model_and_optimizer(args, remat=True)
  rows = []
  for schedule in args.schedules.split(","):
    for m in (int(v) for v in args.microbatch_counts.split(",")):
      run = argparse.Namespace(**dict(vars(args), microbatches=m,
                                      batch=dp * m * args.microbatch_size))
      step, state, batch, _ = build_step(layout, run, cfg, tx, CompressionPlan(),
                                         schedule=schedule,
                                         save_tp_outputs=args.save_tp_outputs)
      tokens = np.zeros((run.batch, args.seq + 1), np.int32)
      t0 = time.perf_counter()
      exe = step.lower(*state, batch(tokens)).compile()
      mem = exe.memory_analysis()
      rows.append(dict(schedule=schedule, microbatches=m, batch=run.batch,
                       compile_s=time.perf_counter() - t0,
                       temp_bytes=mem.temp_size_in_bytes,
                       argument_bytes=mem.argument_size_in_bytes,
                       output_bytes=mem.output_size_in_bytes,
                       peak_bytes=getattr(mem, "peak_memory_in_bytes", None)))
      print(f"{schedule:>6s} m={m:3d}: temporaries {rows[-1]['temp_bytes'] / 2**20:9.2f} MiB "
            f"(compile {rows[-1]['compile_s']:.1f} s)", flush=True)
      del exe, state
  env = common.environment()
  summary = summarize(rows, pp)
  report = dict(benchmark="pipeline_memory", label=args.label, device=env["device_kind"],
                num_devices=jax.device_count(), platform=env["platform"], date=env["date"],
                layout=list(layout), config=vars(args), environment=env, rows=rows,
                summary=summary)
  lines = [f"{s}: temporaries grow {b / 2**20:.2f} MiB per micro-batch"
           for s, b in summary["bytes_per_microbatch"].items()]
  if "constant_bytes" in summary:
    lines.append(f"constant (GPipe's intercept): {summary['constant_bytes'] / 2**20:.1f} MiB")
  for s, by_m in summary.get("share_of_gpipe_activations", {}).items():
    lines += [f"{s} m={m}: {v['share']:.3f} of GPipe's activations (pp/m = {v['pp_over_m']:.3f})"
              for m, v in by_m.items()]
  return write_report("pipeline_memory", args, report, "\n".join(lines))


if __name__ == "__main__":
  main()
