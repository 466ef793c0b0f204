"""Loss curves of the accuracy benchmark as a PNG: `python -m benchmarks.plot_accuracy`.

Reads every GPU `benchmarks/results/accuracy_*.json` (`benchmarks/bench_accuracy.py`) and
draws, per file (one seed each), the validation loss of each variant against the step and
the relative difference to the uncompressed run (to the first run where there is none).
Needs matplotlib (`pip install -e .[plots]`); writes docs/accuracy_loss.png by default.
"""
from __future__ import annotations

import argparse
import pathlib

from benchmarks.report import ROOT, _accuracy_codec, _load


COLORS = {"off": "C0", "on": "C1", "calibrated": "C2"}
COLUMNS = 6  # runs per row of plots


def label(variant: str, run: dict) -> str:
  return variant if not run["compression"]["enabled"] else f"{variant} ({_accuracy_codec(run)})"


def plot(out: pathlib.Path) -> pathlib.Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = [(n, d) for n, d in _load("accuracy_*.json") if d["environment"]["platform"] == "gpu"]
  if not files:
    raise SystemExit("no GPU accuracy results in benchmarks/results")
  cols = min(len(files), COLUMNS)
  rows = -(-len(files) // cols)
  fig, axes = plt.subplots(2 * rows, cols, figsize=(6 * cols, 7 * rows), squeeze=False,
                           sharex=True)
  for i, (name, d) in enumerate(files):
    ref = "off" if "off" in d["runs"] else next(iter(d["runs"]))  # a run without off: its first
    base = dict(map(tuple, d["runs"][ref]["curves"]["val_loss"]))
    top, bottom = axes[2 * (i // cols), i % cols], axes[2 * (i // cols) + 1, i % cols]
    for v, run in d["runs"].items():
      steps, vals = zip(*run["curves"]["val_loss"])
      style = dict(marker="o", ms=3, label=label(v, run), color=COLORS.get(v))
      top.plot(steps, vals, **style)
      if v != ref:
        bottom.plot(steps, [100 * (x - base[s]) / base[s] for s, x in zip(steps, vals)],
                    **style)
    m, par = d["runs"][ref]["model"], d["runs"][ref]["parallel"]
    mesh = ",".join(str(par.get(a, 1)) for a in ("dp", "pp", "tp"))
    top.set_title(f"{name}\nGPT {m['n_layers']}x{m['d_model']}, dp,pp,tp = {mesh}, "
                  f"seed {d['config'].get('seed') or 0}", fontsize=9)
    top.set_ylabel("validation loss (nats / byte)")
    top.set_yscale("log")
    top.legend(fontsize=8)
    bottom.axhline(0, color="gray", lw=0.8)
    for y in (-0.3, 0.3):
      bottom.axhline(y, color="gray", lw=0.5, ls="--")
    bottom.set_ylabel(f"val loss vs {ref} (%)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
  for i in range(len(files), rows * cols):  # the last row's empty places
    axes[2 * (i // cols), i % cols].axis("off")
    axes[2 * (i // cols) + 1, i % cols].axis("off")
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=str(ROOT / "docs" / "accuracy_loss.png"))
  print(f"wrote {plot(pathlib.Path(ap.parse_args(argv).out))}")


if __name__ == "__main__":
  main()
