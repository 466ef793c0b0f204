"""Accuracy cost of TACO compression, and codec ablations on tensors from a trained model.

1. Train one config (`--config`, default configs/gpt_125m_tp4.py: GPT-2 small, TP=4) with
   the trainer users run (`taco_jax.train.trainer.train`) three times from the same seed
   on the same batches: compression off, on (the config's codec; `compression.log_errors`
   on, so each family's relative error of what it sent is a metric of the run), and with
   the codec the calibration below chose. Validation loss every `eval_every` steps on a
   fixed set of held-out batches; accuracy cost = (val_on - val_off) / val_off.
2. Between the off and the calibrated run: capture the messages every compressed
   collective sends (activations and, in the backward pass, their gradients) for
   `--capture-steps` steps from the *trained* off model (its last checkpoint), then
   - ablations: each codec setting of `ABLATIONS` applied to each site's tensors
     (relative L2 and max error), and
   - `taco_jax.apps.calibrate`: the data-driven choice per family over format x group size x
     Hadamard, written as a config file, which the third run trains with.

Corpus (`--corpus`): "python" = every *.py under the site-packages directory that holds
jax (several times the embedded stdlib corpus on the GPU image; no download), "embedded"
= the default corpus, or a path. Results: benchmarks/results/accuracy_<label>_<n><kind>_
<date>.json (loss and error curves, the ablation table, the calibration report); plots:
`python -m benchmarks.plot_accuracy`.

GPU, 4xH200, one call (< 10 minutes; NVLink multicast off):
  python benchmarks/bench_accuracy.py --label nvlink
The compressed kernels against the compressed collectives (2xH200; the results' "runs"
say which kernels fell back, "kernels_vs_collectives" how far apart the curves are):
  python benchmarks/bench_accuracy.py --label nvlink_cm --tp 2 --variants off,on_all,on_all_cm
CPU smoke test (8 fake devices, tiny model, ~1 minute):
  python benchmarks/bench_accuracy.py --smoke
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.args import add_output_args, parse_with_smoke, results_path  # noqa: E402

# "on_all" / "on_all_cm": every TP message compressed with the config's codec (no measured
# link policy, no error logging), through XLA's collectives / the fused collective-matmul
# kernels (`parallel.tp_overlap="kernel"`), which send the same codes: issue 15's accuracy
# check of the compressed kernels
KERNEL_COMPARISON = ("on_all", "on_all_cm")
VARIANTS = ("off", "on", "calibrated", *KERNEL_COMPARISON)
DEFAULT_VARIANTS = ("off", "on", "calibrated")
TACO = dict(format="e4m3", group_size=128, hadamard=True, dual_scale=True)
# name -> the codec setting measured on the captured tensors (changes from TACO)
ABLATIONS = {
    "taco (e4m3, G=128, Hadamard, pre-scale)": {},
    "no Hadamard": dict(hadamard=False),
    "no pre-scale": dict(dual_scale=False),
    "no Hadamard, no pre-scale (per-group absmax)": dict(hadamard=False, dual_scale=False),
    "G=32": dict(group_size=32),
    "G=64": dict(group_size=64),
    "G=256": dict(group_size=256),
    "e5m2": dict(format="e5m2"),
    "e5m2, no Hadamard": dict(format="e5m2", hadamard=False),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=str(REPO / "configs" / "gpt_125m_tp4.py"))
  p.add_argument("--steps", type=int, default=2000, help="training steps of every run")
  p.add_argument("--eval-every", type=int, default=250)
  p.add_argument("--corpus", default="python", help="python | embedded | a data.path")
  p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                 help=f"of {', '.join(VARIANTS)}")
  p.add_argument("--tp", type=int, default=None,
                 help="instead of the config's TP (the kernels run on meshes of <= 4 GPUs)")
  p.add_argument("--seed", type=int, default=None, help="instead of the config's seed "
                 "(parameter init and batch order): a second seed gives the seed-to-seed spread")
  p.add_argument("--capture-steps", type=int, default=2)
  p.add_argument("--workdir", default=None, help="runs go here (default: a temporary dir)")
  p.add_argument("--deadline-s", type=float, default=540.0,
                 help="skip the calibrated run if the off run's time no longer fits")
  add_output_args(p, label="nvlink", smoke="CPU, 8 fake devices, tiny model")
  return parse_with_smoke(p, argv, dict(config=str(REPO / "configs" / "parallel_tiny.py"),
                                        steps=20, eval_every=10, corpus="embedded",
                                        label="smoke"))


def load_config(path):
  """get_config() of a config file (any path: the calibrated one is written at run time)."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def corpus_path(choice: str) -> tuple[str, str]:
  """(data.path, data.include) of a --corpus choice."""
  if choice == "embedded":
    return "", "*"
  if choice == "python":
    import jax
    return str(pathlib.Path(jax.__file__).resolve().parents[1]), "*.py"
  return choice, "*"


def configure(config, args, variant: str, workdir: pathlib.Path):
  """The base config with this benchmark's steps, corpus and the variant's compression."""
  path, include = corpus_path(args.corpus)
  with config.unlocked():
    if args.seed is not None:
      config.seed = args.seed
    config.data.update(path=path, include=include, cache_dir=str(workdir / "corpus"))
    config.optim.warmup_steps = min(config.optim.warmup_steps, args.steps)
    config.train.update(steps=args.steps, eval_every=args.eval_every, checkpoint_every=0,
                        progress_bar=False, log_every=min(config.train.log_every, 10))
    if args.smoke:
      config.parallel.update(dp=2, pp=1, tp=4)
    if args.tp:
      config.parallel.tp = args.tp
    config.compression.enabled = variant != "off"
    config.compression.log_errors = variant in ("on", "calibrated")
    if variant in KERNEL_COMPARISON:
      for family in ("tp_forward", "tp_backward"):
        config.compression[family].link = None
      config.parallel.tp_overlap = "kernel" if variant == "on_all_cm" else "none"
  return config


def curves(workdir: pathlib.Path) -> dict:
  """The run's metrics.jsonl as {metric: [[step, value], ...]}."""
  from taco_jax.train.metrics import read_jsonl
  out: dict[str, list] = {}
  for rec in read_jsonl(workdir / "metrics.jsonl"):
    for k, v in rec.items():
      if k != "step":
        out.setdefault(k, []).append([rec["step"], v])
  return out


def same_curves(run: dict, ref: dict) -> dict:
  """How far `run`'s loss curves are from `ref`'s: the largest relative difference of the
  training and the validation loss at the same steps, and the steps at which `run`'s loss
  was not finite (left out of the largest difference, which NaN would otherwise hide)."""
  out = {}
  for metric in ("loss", "val_loss"):
    ref_at = dict(map(tuple, ref["curves"].get(metric, [])))
    both = [(s, v, ref_at[s]) for s, v in run["curves"].get(metric, []) if s in ref_at]
    diffs = [abs(v - r) / abs(r) for _, v, r in both if math.isfinite(v)]
    out[f"{metric}_max_rel_diff"] = max(diffs) if diffs else None
    out[f"{metric}_nonfinite_steps"] = [s for s, v, _ in both if not math.isfinite(v)]
  return out


def ablate(cap) -> dict:
  """{site: [{name, setting, rel_l2, max_abs, max_abs_over_absmax, share_off_by_8th,
  bits_per_element}]} (`taco_jax.apps.calibrate.measure_all`)."""
  from taco_jax.apps import calibrate
  settings = [dict(TACO, **change) for change in ABLATIONS.values()]
  results = calibrate.measure_all(cap, settings)
  return {site: [dict(name=name, **r) for name, r in zip(ABLATIONS, rows)]
          for site, rows in results.items()}


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  import jax
  from benchmarks import common
  from taco_jax import data
  from taco_jax.apps import calibrate
  from taco_jax.train.trainer import train

  t_start = time.perf_counter()
  root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="taco_accuracy_"))
  variants = [v for v in args.variants.split(",") if v]
  if unknown := set(variants) - set(VARIANTS):
    raise SystemExit(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
  env = common.environment()
  n = jax.device_count()
  path = results_path("accuracy", args, num_devices=n, platform=env["platform"],
                      date=env["date"])
  report = dict(benchmark="accuracy", label=args.label, device=env["device_kind"],
                num_devices=n, jax_version=jax.__version__, date=env["date"],
                env={k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE")},
                config=dict(vars(args)), environment=env,
                runs={}, skipped={})
  write = lambda: path.write_text(json.dumps(report, indent=1))  # noqa: E731
  corpus_dir, include = corpus_path(args.corpus)
  corpus = data.load_corpus(corpus_dir, include=include, cache_dir=root / "corpus")
  report["corpus"] = dict(source=corpus.source, include=include, train_tokens=len(corpus.train),
                          val_tokens=len(corpus.val))
  print(f"corpus {corpus.source} ({include}): {len(corpus.train):,} train and "
        f"{len(corpus.val):,} validation tokens", flush=True)
  del corpus

  def run(variant, config):
    t0 = time.perf_counter()
    summary = train(config, root / variant)
    report["runs"][variant] = dict(
        summary=summary, wall_s=time.perf_counter() - t0, curves=curves(root / variant),
        compression=config.compression.to_dict(), model=config.model.to_dict(),
        data=config.data.to_dict(), parallel=config.parallel.to_dict())
    if config.parallel.tp_overlap == "kernel":  # did the kernels run, or XLA's collectives?
      from taco_jax.tp import fused
      report["runs"][variant]["kernel_fallbacks"] = fused.fallbacks()
    if "off" in report["runs"] and variant != "off":
      off = report["runs"]["off"]["summary"]["val_loss"]
      report["runs"][variant]["accuracy_cost"] = (summary["val_loss"] - off) / off
    write()
    print(f"{variant}: val loss {summary['val_loss']:.4f} after {args.steps} steps "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

  for variant in (v for v in VARIANTS if v != "calibrated"):  # that one needs the others
    if variant in variants:
      run(variant, configure(load_config(args.config), args, variant, root))
  if "off" in report["runs"]:  # tensors of the trained model
    t0 = time.perf_counter()
    cfg_on = configure(load_config(args.config), args, "on", root)
    with cfg_on.unlocked():
      cfg_on.compression.log_errors = False
    cap = calibrate.capture(cfg_on, args.capture_steps, workdir=root / "off")
    report["ablations"] = ablate(cap)
    cal_file = root / "calibrated_config.py"
    report["calibration"] = calibrate.calibrate(
        cfg_on, steps=args.capture_steps, out=cal_file, cap=cap)
    report["calibration"]["config_source"] = cal_file.read_text()
    report["capture_s"] = time.perf_counter() - t0
    write()
    left = args.deadline_s - (time.perf_counter() - t_start)
    need = report["runs"]["off"]["wall_s"] * 1.2
    if "calibrated" in variants and left < need:
      report["skipped"]["calibrated"] = f"{left:.0f} s left, the off run took {need / 1.2:.0f} s"
      print(f"skipping the calibrated run: {report['skipped']['calibrated']}")
    elif "calibrated" in variants:
      run("calibrated", configure(load_config(cal_file), args, "calibrated", root))
  if set(KERNEL_COMPARISON) <= set(report["runs"]):
    report["kernels_vs_collectives"] = same_curves(report["runs"]["on_all_cm"],
                                                   report["runs"]["on_all"])
  report["wall_s"] = time.perf_counter() - t_start
  write()
  print(common.table([dict(variant=v, val_loss=r["summary"]["val_loss"],
                           train_loss=r["summary"]["train_loss"],
                           accuracy_cost=r.get("accuracy_cost"),
                           tokens_per_s=r["summary"]["tokens_per_s"])
                      for v, r in report["runs"].items()],
                     ["variant", "val_loss", "train_loss", "accuracy_cost", "tokens_per_s"]))
  for fam, c in report.get("calibration", {}).get("choices", {}).items():
    print(f"calibrated {fam}: {c['setting']} rel. L2 {c['error']:.4g} "
          f"(config's {c['base_setting']}: {c['base_error']:.4g})")
  print(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
