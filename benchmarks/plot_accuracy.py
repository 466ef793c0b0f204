"""Loss curves of the accuracy benchmark as a PNG: `python -m benchmarks.plot_accuracy`.

Reads every GPU `benchmarks/results/accuracy_*.json` (`benchmarks/bench_accuracy.py`) and
draws, per file (one seed each), the validation loss of each variant against the step and
the relative difference to the uncompressed run. Needs matplotlib (`pip install -e
.[plots]`); writes docs/accuracy_loss.png by default.
"""
from __future__ import annotations

import argparse
import pathlib

from benchmarks.report import ROOT, _codec_words, _load


COLORS = {"off": "C0", "on": "C1", "calibrated": "C2"}


def label(variant: str, run: dict) -> str:
  z = run["compression"]
  return variant if not z["enabled"] else f"{variant} ({_codec_words(z['tp_forward'])})"


def plot(out: pathlib.Path) -> pathlib.Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = [(n, d) for n, d in _load("accuracy_*.json") if d["environment"]["platform"] == "gpu"]
  if not files:
    raise SystemExit("no GPU accuracy results in benchmarks/results")
  fig, axes = plt.subplots(2, len(files), figsize=(6 * len(files), 7), squeeze=False,
                           sharex=True)
  for col, (name, d) in enumerate(files):
    off = dict(map(tuple, d["runs"]["off"]["curves"]["val_loss"]))
    top, bottom = axes[0, col], axes[1, col]
    for v, run in d["runs"].items():
      steps, vals = zip(*run["curves"]["val_loss"])
      style = dict(marker="o", ms=3, label=label(v, run), color=COLORS.get(v))
      top.plot(steps, vals, **style)
      if v != "off":
        bottom.plot(steps, [100 * (x - off[s]) / off[s] for s, x in zip(steps, vals)], **style)
    m = d["runs"]["off"]["model"]
    top.set_title(f"{name}\nGPT {m['n_layers']}x{m['d_model']}, TP="
                  f"{d['runs']['off']['parallel']['tp']}, seed {d['config'].get('seed') or 0}",
                  fontsize=9)
    top.set_ylabel("validation loss (nats / byte)")
    top.set_yscale("log")
    top.legend(fontsize=8)
    bottom.axhline(0, color="gray", lw=0.8)
    for y in (-0.3, 0.3):
      bottom.axhline(y, color="gray", lw=0.5, ls="--")
    bottom.set_ylabel("val loss vs off (%)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
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
