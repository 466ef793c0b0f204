"""What the benchmark scripts share on the command line and in naming their results.

No JAX import: the scripts parse their arguments before they configure JAX (fake CPU
devices for --smoke, XLA_FLAGS).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pathlib
import tempfile

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def add_output_args(p: argparse.ArgumentParser, *, label: str, smoke: str) -> None:
  """--label (names the results file), --out-dir and --smoke (`smoke`: what it runs)."""
  p.add_argument("--label", default=label)
  p.add_argument("--out-dir", default=None, help="default: benchmarks/results (smoke: tmp)")
  p.add_argument("--smoke", action="store_true", help=smoke)


def parse_with_smoke(p: argparse.ArgumentParser, argv, smoke: dict) -> argparse.Namespace:
  """`p.parse_args(argv)`; with --smoke, `smoke`'s values replace the options left at their
  defaults (an option given on the command line wins)."""
  args = p.parse_args(argv)
  if args.smoke:
    for k, v in smoke.items():
      if getattr(args, k) == p.get_default(k):
        setattr(args, k, v)
  return args


def spec_fields(spec: str) -> dict:
  """The fields of a variant spec ``k=v+k=v`` (``sms=132+depth=2``), digits as ints."""
  fields = dict(kv.split("=") for kv in spec.split("+"))
  return {k: (int(v) if v.isdigit() else v) for k, v in fields.items()}


def start_watchdog() -> None:
  """After ``BENCH_WATCHDOG_S`` seconds (unset: never), print every thread's Python stack and
  exit: a hang (a compile that never returns) is reported, not silently cut off by the
  caller's time limit."""
  if seconds := os.environ.get("BENCH_WATCHDOG_S"):
    faulthandler.dump_traceback_later(float(seconds), exit=True)


def results_path(benchmark: str, args, *, num_devices: int, platform: str,
                 date: str) -> pathlib.Path:
  """<dir>/<benchmark>_<label>_<devices><platform>_<yyyymmdd>.json, the directory created:
  --out-dir, else a temporary one for --smoke, else benchmarks/results. `date`: ISO."""
  out_dir = pathlib.Path(args.out_dir or (tempfile.mkdtemp() if args.smoke else RESULTS))
  out_dir.mkdir(parents=True, exist_ok=True)
  return out_dir / (f"{benchmark}_{args.label}_{num_devices}{platform}_"
                    f"{date[:10].replace('-', '')}.json")


def write_results(benchmark: str, args, results: dict) -> pathlib.Path:
  """Writes `results` as JSON to `results_path` (its `gpus` count; dated now unless it has
  a date, which it keeps) and points --out-dir at that folder, so that a run that writes as
  it goes (a hang loses nothing) rewrites the one file. Call after JAX is configured."""
  import datetime

  import jax
  results["date"] = results.get("date") or datetime.datetime.now().isoformat()
  path = results_path(benchmark, args, num_devices=results["gpus"],
                      platform=jax.default_backend(), date=results["date"])
  args.out_dir = str(path.parent)
  path.write_text(json.dumps(results, indent=1, default=str))
  return path


def run_on_devices(benchmark: str, args, run) -> pathlib.Path:
  """The main of a benchmark that writes as it goes: 8 fake CPU devices for --smoke, the
  watchdog (`start_watchdog`), then ``run(args)``'s results written (`write_results`) and
  their path printed and returned."""
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  start_watchdog()
  path = write_results(benchmark, args, run(args))
  print(f"wrote {path}")
  return path


def one_device_report(benchmark: str, args, results: list) -> dict:
  """The report of a one-GPU probe: what ran where and when (for `write_report`), its
  options and `results`. Call after JAX is configured."""
  import datetime

  import jax
  dev = jax.devices()[0]
  return dict(benchmark=benchmark, label=args.label, device=dev.device_kind,
              platform=dev.platform, num_devices=1, jax_version=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              config=vars(args), results=results)


def write_report(benchmark: str, args, report: dict, summary: str) -> pathlib.Path:
  """Writes `report` (with its num_devices, platform and ISO date) as JSON to
  `results_path`, prints `summary` and where it went; returns the path."""
  path = results_path(benchmark, args, num_devices=report["num_devices"],
                      platform=report["platform"], date=report["date"])
  path.write_text(json.dumps(report, indent=1))
  print(summary)
  print(f"wrote {path}")
  return path
