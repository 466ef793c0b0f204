"""Regenerates what the repo states about measurements from ``benchmarks/results/*.json``:

* README.md's results section (between the ``results:begin`` / ``results:end`` markers);
* ``taco_jax/_measured.py``: per link and collective, the message size from which the
  compressed collective beat bf16 (what ``CompressionConfig(link=...)`` applies), and the
  same for the fused collective-matmul kernels (compressed kernel against plain kernel).

    python -m benchmarks.report          # rewrite both
    python -m benchmarks.report --check  # exit 1 if either is stale (used by the tests)

No figure in those two places is typed by hand: edit this script, not its output.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import os
import pathlib
import pprint
import sys

from benchmarks.args import spec_fields

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
MEASURED = ROOT / "taco_jax" / "_measured.py"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MIB = 1 << 20


def _load(pattern: str) -> list[tuple[str, dict]]:
  return [(os.path.basename(p), json.loads(pathlib.Path(p).read_text()))
          for p in sorted(glob.glob(str(RESULTS / pattern)))]


def _gpu_runs(pattern: str) -> list[tuple[str, dict]]:
  """`_load(pattern)` without the CPU smoke runs."""
  return [(n, d) for n, d in _load(pattern) if d.get("platform") == "gpu"]


def _section(heading: str, intro: str, parts: list[str]) -> str:
  """'### heading', the intro and the parts; "" when there are no parts (nothing measured)."""
  return f"### {heading}\n\n{intro}\n\n" + "\n".join(parts) if parts else ""


def _table(header: list[str], rows: list[list]) -> str:
  def fmt(v):
    if v is None:
      return "–"
    if isinstance(v, float):
      return str(int(v)) if v.is_integer() and abs(v) < 1e6 else f"{v:.3g}"
    return str(v)

  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
  return "\n".join(lines)


def _hadamard(config: dict) -> bool:
  """Whether a run's codec had the transform: older runs had it unless --no-hadamard."""
  return config.get("hadamard", not config.get("no_hadamard", False))


def codec_section() -> str:
  runs = _load("codec_*.json")
  if not runs:
    return ""
  parts = []
  devices = sorted({d["environment"]["device_kind"] for _, d in runs})
  codecs = ((False, "default codec: per-group absmax + RMS pre-scale, no Hadamard"),
            (True, "with the Hadamard transform"))
  for device, (hadamard, what) in itertools.product(devices, codecs):
    mine = [(n, d) for n, d in runs if _hadamard(d["config"]) == hadamard
            and d["environment"]["device_kind"] == device]
    if not mine:
      continue
    name, d = mine[-1]  # newest on this device (names sort by date-time)
    env, copy, mm = d["environment"], d["copy"]["gbps"], d["matmul"]["tflops"]
    rows = [[r["op"], r["size_mib"], r["pallas_ms"], r["xla_ms"], r["pallas_gbps"],
             r["frac_of_copy"], r["speedup"]] for r in d["bandwidth"]]
    parts.append(f"#### {what} (`{name}`: {env['device_kind']}, jax {env['jax_version']})\n\n"
                 f"Ceilings measured in the same run: XLA elementwise copy {copy:.0f} GB/s "
                 f"(read + write), bf16 matmul {mm:.0f} TFLOP/s.\n\n"
                 + _table(["op", "MiB (bf16 in)", "Pallas ms", "jnp ms", "Pallas GB/s", "frac",
                           "speedup"], rows) + "\n")
  name, d = runs[-1]
  fid = {}
  for r in d["fidelity"]:
    fid.setdefault(r["variant"], {})[r["dist"]] = r["rel_l2"]
  dists = ["gaussian", "student_t3", "outlier_channels", "lognormal"]
  g128 = [[v] + [fid[v].get(k) for k in dists] for v in fid if v.endswith("128")
          or v == "per_tensor"]
  return ("### Codec kernels\n\nBandwidth = bytes read + written / time; `frac` is of the "
          "copy ceiling; `speedup` is over the jitted jnp reference.\n\n" + "\n".join(parts)
          + f"\nRelative L2 error of the round trip at group size 128 (synthetic inputs, "
          f"`{name}`; `absmax` = no Hadamard, the default's codes):\n\n"
          + _table(["variant"] + dists, g128) + "\n")


def _first_win(points) -> int | None:
  """The smallest size from which every (size, won) point at that size or larger won."""
  points = list(points)
  wins = [s for s in sorted({s for s, _ in points})
          if all(w for t, w in points if t >= s)]
  return wins[0] if wins else None


def _last_win(points) -> int | None:
  """The largest work up to which every (work, won) point at that work or less won."""
  points = list(points)
  wins = [w for w in sorted({w for w, _ in points}) if all(won for v, won in points if v <= w)]
  return wins[-1] if wins else None


def threshold_mib(results: list[dict]) -> dict:
  """Per collective of a collectives benchmark's `results`: the smallest size (MiB per
  device) from which compressed beat bf16 at every larger measured size; None if never."""
  out = {}
  for coll in sorted({r["collective"] for r in results}):
    out[coll] = _first_win([(r["size_mib"], r["speedup_vs_bf16"] > 1.0) for r in results
                            if r["collective"] == coll and r["variant"] == "compressed"])
  return out


def thresholds(d: dict) -> dict:
  """`threshold_mib` of a results file, in bytes per device."""
  return {c: None if t is None else int(t * MIB) for c, t in threshold_mib(d["results"]).items()}


def collectives_section() -> str:
  parts = []
  for name, d in _gpu_runs("collectives_*.json"):
    by = {}
    for r in d["results"]:
      by.setdefault((r["collective"], r["size_mib"]), {})[r["variant"]] = r
    rows = [[c, s, v["bf16"]["median_ms"], v["raw_fp8"]["median_ms"],
             v["compressed"]["median_ms"], v["compressed"]["speedup_vs_bf16"],
             v["raw_fp8"]["median_ms"] / v["compressed"]["median_ms"]]
            for (c, s), v in sorted(by.items())]
    th = ", ".join(f"{c} {'never' if b is None else f'{b / MIB:g} MiB'}"
                   for c, b in thresholds(d).items())
    parts.append(f"#### `{d['label']}`: {d['num_devices']}x {d['device']}, codec "
                 f"{_codec_words(d['config'])} (`{name}`)\n\n"
                 + _table(["collective", "MiB/device", "bf16 ms", "raw fp8 ms", "TACO ms",
                           "speedup vs bf16", "TACO / raw-fp8 speed"], rows)
                 + f"\n\nCompression pays from: {th}.\n")
  return _section("Collectives (compress + communicate + decompress, all included)",
                  "`raw fp8` is a bare cast with no scales and no codec: the bound for a free "
                  "codec.", parts)


TRANSPORTS = (("all_gather", "bf16"), ("all_gather", "wire_u8"), ("all_gather", "wire_as_bf16"),
              ("all_gather", "wire_as_u32"), ("psum_scatter", "bf16"), ("all_to_all", "wire_u8"),
              ("all_to_all", "wire_as_bf16"), ("all_to_all", "wire_as_u32"),
              ("permute_all_to_all", "wire_u8"))


def transport_section() -> str:
  parts = []
  for name, d in _gpu_runs("transport_*.json"):
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in d["results"]):
      ms = {(r["op"], r["payload"]): r["median_ms"] for r in d["results"]
            if r["setting"] == setting and "error" not in r}
      if not ms:
        rows.append([f"`{setting}`", *["failed"] * len(TRANSPORTS), None, None])
        continue
      t = [ms.get(k) for k in TRANSPORTS]
      rows.append([f"`{setting}`", *t, t[0] / t[1], t[4] / t[5]])
    c = d["config"]
    sizes = {(r["op"], r["payload"]): r["bytes_per_device"] / MIB for r in d["results"]
             if "error" not in r}
    parts.append(
        f"#### `{d['label']}`: {d['num_devices']}x {d['device']}, {c['rows']} rows of "
        f"{c['hidden']} per device, G={c['group_size']} (`{name}`)\n\n"
        f"Per device: the all-gather sends {sizes[('all_gather', 'bf16')]:g} MiB of bf16 or "
        f"{sizes[('all_gather', 'wire_u8')]:g} MiB of wire rows; the reduce-scatter takes "
        f"{sizes[('psum_scatter', 'bf16')]:g} MiB of bf16, the all-to-all "
        f"{sizes[('all_to_all', 'wire_u8')]:g} MiB of wire rows. ms per call:\n\n"
        + _table(["setting", "AG bf16", "AG wire u8", "AG wire as bf16", "AG wire as u32",
                  "RS bf16", "A2A wire u8", "A2A wire as bf16", "A2A wire as u32",
                  "A2A wire u8 as sends", "AG bf16 / wire", "RS bf16 / A2A wire"], rows)
        + "\n")
  return _section("Transport alone (`benchmarks/bench_transport.py`: no encode, no decode)",
                  "The collectives of one TP layer at the 1.3B model's sizes, bf16 against the "
                  "wire bytes a compressed collective moves (as u8, and the same bytes as bf16 "
                  "or u32 elements), under NCCL settings each in a fresh process.", parts)


FUSED_DECODE = ("bf16", "pallas_decode", "xla_decode", "xla_decode_triton_any", "decode_only")


def fused_decode_section() -> str:
  parts = []
  for name, d in _gpu_runs("fused_decode_*.json"):
    by = {}
    for r in d["results"]:
      by.setdefault((r["product"], r["m"], r["d"], r["f"]), {})[r["variant"]] = r
    rows = [[f"`{p}`", f"{m} x {k} x {f}", *(v[c]["median_ms"] if c in v else None
                                             for c in FUSED_DECODE),
             (v["pallas_decode"]["median_ms"] - v["bf16"]["median_ms"])
             if "pallas_decode" in v and "bf16" in v else None]
            for (p, m, k, f), v in by.items()]
    fused = any(r["triton_gemm"] for r in d["results"] if r["variant"].startswith("xla"))
    parts.append(f"{d['device']} (`{name}`); XLA emitted a Triton GEMM with the decode in it: "
                 f"{'yes' if fused else 'no'}.\n\n"
                 + _table(["product", "M x D x F", "bf16 ms", "Pallas decode + matmul",
                           "XLA decode + matmul", "... with triton_gemm_any", "decode alone",
                           "decode's cost"], rows) + "\n")
  return _section("Decode beside the consuming matmul (`benchmarks/probe_fused_decode.py`)",
                  "A gathered x [M, D] arrives as wire rows and feeds a matmul (the 1.3B TP=4 "
                  "layer's shapes): the bf16 matmul alone, then with the decode in front, as "
                  "the Pallas kernel or as jnp left to XLA to fuse.", parts)


HEADER_FIELDS = ("model", "seq", "batch", "group_size", "format")


def train_section() -> str:
  rows = []
  for name, d in _load("train_parallel_*.json"):
    if d.get("environment", {}).get("platform", "gpu") != "gpu":
      continue
    c = d["config"]
    what = c.get("compress", "") + ("" if _hadamard(c) else " no-Hadamard")
    for r in d["results"]:
      if r["compression"] == "on":
        off = next(o for o in d["results"] if o["layout"] == r["layout"] and
                   o["compression"] == "off")
        rows.append([d["label"], r["layout"], what, r["steps"], off["tokens_per_s"],
                     r["tokens_per_s"], r["speedup"], _mfu(d, off),
                     _mfu_of_measured(d, off), off["final_loss"], r["final_loss"],
                     100 * r["accuracy_cost"]])
  if not rows:
    return ""
  shared = {tuple(d["config"].get(k) for k in HEADER_FIELDS)
            for _, d in _load("train_parallel_*.json")
            if d.get("environment", {}).get("platform", "gpu") == "gpu"}
  if len(shared) != 1:
    raise ValueError(f"train_parallel results mix configs {sorted(shared)}: give the table "
                     "per-row columns for them")
  c = d["config"]
  return (f"### Training ({c.get('model')} GPT, seq {c.get('seq')}, global batch "
          f"{c.get('batch')}, {d['num_devices']}x {d['device']}, e4m3 G="
          f"{c.get('group_size')})\n\nOff and on start from the same parameters and see the "
          "same batches, steps interleaved. `loss` is the training loss averaged over the "
          "last 10 steps; `loss +%` the relative difference (200 steps: early training, where a "
          "different seed or layout alone moves it by ~1%; validation loss after 2,000 steps "
          f"is in the Accuracy table). {MFU_WORDS}\n\n"
          + _table(["run", "dp,pp,tp", "compressed", "steps", "tok/s off", "tok/s on",
                    "speedup", "MFU off (spec)", "MFU off (matmul)", "loss off", "loss on",
                    "loss +%"], rows) + "\n")


def _codec_words(c: dict) -> str:
  # link "auto" (the default) is left out: every message of the benchmarked models is above
  # the measured sizes, so those runs compress what link=None runs compress.
  link, impl = c.get("link"), c.get("implementation", "auto")
  from benchmarks.train_parallel import DEFAULT_COMPRESS
  compress = c.get("compress", DEFAULT_COMPRESS)
  return " ".join(w for w in (
      c.get("format", "e4m3"), f"G={c.get('group_size')}",
      "Hadamard" if _hadamard(c) else "no-Hadamard",
      f"link={link}" if link not in (None, "auto") else "",
      f"{impl} kernels" if impl != "auto" else "",
      f"of {compress}" if compress != DEFAULT_COMPRESS else "") if w)


MFU_WORDS = ("`MFU off (spec)`: the `off` step's model FLOP/s against the dense bf16 spec "
             "peak (989 TFLOP/s); `MFU off (matmul)`: against the bf16 matmul rate measured "
             "in the same run (8192^3; – where that run's ceiling was above the spec peak: "
             "the timing loop's double buffering, fixed 2026-11-21, had doubled it).")


def _mfu(d: dict, r: dict):
  """A step's MFU against the device's spec peak (recomputed: runs before 2026-11-21's fix
  divided by a matmul ceiling that XLA's loop double buffering had doubled)."""
  from benchmarks.common import mfu
  fpt = d["config"].get("flops_per_token")
  return mfu(r["tokens_per_s"], fpt, d["num_devices"], d["device"]) if fpt else None


def _mfu_of_measured(d: dict, r: dict):
  """A step's MFU against the bf16 matmul ceiling measured in its run; None where that
  ceiling is above the spec peak (measured before the timing loop's fix) or missing."""
  from benchmarks.common import peak_tflops
  fpt = d["config"].get("flops_per_token")
  ceiling = d.get("ceilings", {}).get("matmul_bf16", {}).get("tflops")
  if not (fpt and ceiling) or ceiling > (peak_tflops(d["device"]) or float("inf")):
    return None
  return r["tokens_per_s"] * fpt / (d["num_devices"] * ceiling * 1e12)


# The variants of one remat policy: a column per name + the policy's suffix ("off_il2_save").
POLICY_COLUMNS = ("off", "on", "ring_off", "ring_on", "off_il2", "on_il2", "ideal")
# The modifiers that make a step program of its own, a row each (its off / on / ideal ...
# in the columns); any other modifier (_cm, _pgle, _1f1b, ...) is listed among the others.
ROW_MODIFIERS = ("save", "dots", "attn", "head", "gelu", "qkv", "dbxla", "ogr", "zero",
                 "unroll", "noremat")


def _row_suffix(variant: str) -> str | None:
  """'_save_dots_unroll' for off_il2_save_dots_unroll; None for a variant without a column
  (GSPMD, _cm, _pgle, ...)."""
  from benchmarks.bench_train import parse_variant
  if variant == "gspmd":
    return None
  v = parse_variant(variant)
  mods = [m for m in v.name.removeprefix(v.base).split("_") if m]
  if mods[:1] == ["il2"]:
    mods = mods[1:]
  return "".join(f"_{m}" for m in mods) if set(mods) <= set(ROW_MODIFIERS) else None


def _row_words(suffix: str, remat: bool) -> str:
  """'save TP outputs + dots, ZeRO, unrolled' for '_save_dots_zero_unroll'."""
  mods = suffix.split("_")
  kept = [w for m, w in (("save", "save TP outputs"), ("dots", "dots"), ("attn", "attn"))
          if m in mods]
  words = [("save " + " + ".join(kept).removeprefix("save ") if kept else
            "none" if "noremat" in mods or not remat else "recompute")]
  words += [w for m, w in (("head", "head's softmax kept"), ("gelu", "fused GELU"),
                           ("qkv", "q, k, v split in the GEMM"),
                           ("dbxla", "its bias's gradient by XLA"),
                           ("ogr", "grads reduced in backward"), ("zero", "ZeRO"),
                           ("unroll", "unrolled")) if m in mods]
  return ", ".join(words)


def _policy_rows(results: list[dict], layout: str, remat: bool) -> list[tuple[str, str, dict]]:
  """(variant suffix, its words, {column: ms}) for each step program measured at `layout`
  (`_row_suffix`); one empty row when only other variants (GSPMD) ran there."""
  ms = {r["variant"]: r["step_ms"] for r in results if r["layout"] == layout}
  suffixes = [s for s in dict.fromkeys(map(_row_suffix, ms)) if s is not None] or [""]
  return [(s, _row_words(s, remat), {c: ms.get(c + s) for c in POLICY_COLUMNS})
          for s in suffixes]


def _other_variants(results: list[dict], layout: str) -> str:
  """'name ms, ...' of a layout's variants without a column of their own (e.g. *_pgle); a
  kernel-layer variant whose kernels fell back to XLA's collectives is marked so."""
  return ", ".join(f"{r['variant']} {r['step_ms']:.0f}"
                   + (" (kernels fell back)" if r.get("kernel_fallbacks") else "")
                   for r in results if r["layout"] == layout and r["variant"] != "gspmd"
                   and _row_suffix(r["variant"]) is None) or "–"


def _ratios(summary: dict, suffix: str) -> list:
  """on speedup, comm share, recovered, GSPMD / off of one remat policy (variant `suffix`),
  as `bench_train.summarize` derives them."""
  return [summary.get(f"speedup_on_vs_off{suffix}"), summary.get(f"comm_share{suffix}"),
          summary.get(f"recovered{suffix}"), summary.get(f"off{suffix}_vs_gspmd")]


def _timing(d: dict) -> str:
  """How a bench_train run timed its steps (`train_parallel.step_interleaved`)."""
  return "back to back" if "step_ms_synced" in d["results"][0] else "synced"


def _bench_train_rows(d: dict) -> tuple[list[list], list[list]]:
  """(table rows, their [off il2, on il2] cells) of one bench_train run: a row per layout
  and remat policy."""
  from benchmarks.bench_train import summarize  # recomputed: older files lack newer figures
  c = d["config"]
  by = {(r["layout"], r["variant"]): r for r in d["results"]}
  summaries = {s["layout"]: s for s in summarize(d["results"])}
  attention = d.get("attention", {}).get("backend", "xla")  # before model.attention: XLA's
  rows, il2_ms = [], []
  for layout in dict.fromkeys(r["layout"] for r in d["results"]):
    gspmd = by.get((layout, "gspmd"), {}).get("step_ms")
    for suffix, words, t in _policy_rows(d["results"], layout, not c.get("no_remat")):
      off = by.get((layout, "off" + suffix))
      rows.append([d["label"], c["model"], layout, attention, _timing(d), words,
                   _codec_words(c), t["off"], t["on"], t["ring_off"], t["ring_on"],
                   t["ideal"], gspmd,
                   *_ratios(summaries[layout], suffix), off and _mfu(d, off),
                   off and _mfu_of_measured(d, off), _other_variants(d["results"], layout)])
      il2_ms.append([t["off_il2"], t["on_il2"]])
  return rows, il2_ms


BENCH_TRAIN_WORDS = (
    "Step times in ms (median after warm-up, variants taking turns on the same batches). "
    "`timing`: `back to back` = steps dispatched as the trainer dispatches them, each timed "
    "from the previous one's completion to its own (`--steps-per-turn`, since "
    "2026-11-23's `dp2_leaves`); `synced` = each step alone, dispatch to completion, "
    "the host's dispatch included (in the runs that timed both, the 1.3B steps' medians "
    "differ by -3 to +17 ms). "
    "One row per run, layout and remat policy: `recompute` = the layer's backward "
    "recomputes its forward, TP collectives included; `save TP outputs` = the "
    "recomputation keeps what the TP collectives returned (`parallel.save_tp_outputs`, "
    "the `_save` variants); `dots` = it keeps the outputs of the blocks' weight matmuls "
    "too (`parallel.save_dots`, `_dots`); `attn` = and the attention's inputs and "
    "cuDNN's outputs (`parallel.save_attention`, `_attn`); `none` = no remat (`_noremat`); "
    "`head's softmax kept` = `parallel.save_head` (`_head`); `fused GELU` = the MLP's GELU "
    "in its GEMMs (`model.mlp_gelu='fused'`, `_gelu`), `its bias's gradient by XLA` = "
    "summed from dh by XLA, not in the GELU's backward kernel (`_dbxla`); `q, k, v split "
    "in the GEMM` = written apart by the QKV projection's epilogue (`model.qkv_split='fused'`, "
    "`_qkv`). "
    "`attention`: "
    "the attention that ran (`model.attention`: cuDNN flash attention or XLA's). "
    "`ideal` = the step with every TP collective replaced by a local stand-in of the "
    "same shape (free communication); `ring` = the TP layers as ring collective "
    "matmuls (`parallel.tp_overlap=\"ring\"`){il2}; `comm share` = (off - ideal) / off; "
    "`recovered` = (off - on) / (off - ideal); `GSPMD / off` > 1 means our bf16 step is faster "
    "than plain `jax.jit` + sharding annotations (with XLA's overlap flags, and the "
    "layer recomputed as in `recompute`; for a pp > 1 layout GSPMD runs the same "
    "devices as data x tensor, no pipeline). {mfu} `nop2p*` runs have "
    "`NCCL_P2P_DISABLE=1` (PCIe-class links); `*_link` runs compress only what "
    "`CompressionConfig(link=\"nvlink\")` measured to pay; `*_pgle` variants are "
    "compiled again with the instruction times profiled in two steps "
    "(`taco_jax.train.pgle`).")


def bench_train_section() -> str:
  """A table per setup (seq, batch, devices): a row per run, layout and remat policy."""
  tables = {}  # (seq, batch, n, device) -> (rows, il2 cells)
  for name, d in _load("bench_train_*.json"):
    if d["environment"]["platform"] != "gpu":
      continue
    c = d["config"]
    rows, il2_ms = tables.setdefault((c["seq"], c["batch"], d["num_devices"], d["device"]),
                                     ([], []))
    more_rows, more_il2 = _bench_train_rows(d)
    rows += more_rows
    il2_ms += more_il2
  parts = []
  for (seq, batch, n, device), (rows, il2_ms) in tables.items():
    header = ["run", "model", "dp,pp,tp", "attention", "timing", "remat", "codec (on)",
              "off", "on", "ring off", "ring on", "ideal", "GSPMD", "on speedup",
              "comm share", "recovered", "GSPMD / off", "MFU off (spec)",
              "MFU off (matmul)", "other variants (ms)"]
    il2 = ""
    if any(v is not None for ms in il2_ms for v in ms):  # only once a run measured them
      at = header.index("ideal")
      header[at:at] = ["off il2", "on il2"]
      rows = [r[:at] + ms + r[at:] for r, ms in zip(rows, il2_ms)]
      il2 = ("; `il2` = each micro-batch as 2 sub-batches whose blocks run side by side "
             "(`parallel.interleave=2`)")
    words = (BENCH_TRAIN_WORDS.format(il2=il2, mfu=MFU_WORDS) if not parts else
             "Columns as in the table above" + (il2 and f" ({il2[2:]})") + ".")
    parts.append(f"### Training step (`benchmarks/bench_train.py`: GPT, seq {seq}, global "
                 f"batch {batch}, {n}x {device})\n\n{words}\n\n" + _table(header, rows) + "\n")
  return "\n".join(parts)


def profile_section() -> str:
  runs = _load("profile_step_*.json")
  if not runs:
    return ""
  rows = []
  for name, d in runs:
    for v, devs in d["variants"].items():
      mean = lambda k: (sum(x[k] for x in devs.values()) / len(devs)  # noqa: E731
                        if all(k in x for x in devs.values()) else None)
      rows.append([d["label"], d["num_devices"], d["config"]["model"], d["layout"], v,
                   d.get("dispatch", "synced"), mean("compute_ms"), mean("nccl_ms"),
                   mean("nccl_exposed_ms"), mean("idle_ms") if "idle_from" in d else None])
  devices = " / ".join(sorted({d["device"] for _, d in runs}))
  return (f"### Where the step's time goes (`benchmarks/profile_step.py`, {devices})\n\n"
          "Device trace of a step, ms per step, mean over the GPUs: `steps` = dispatched "
          "`back to back` as the trainer does, or each `synced` (waited for before the next), "
          "`compute` = time some compute kernel runs, `NCCL` = time some NCCL kernel runs, "
          "`exposed` = NCCL time with no compute kernel beside it on that GPU, `idle` = time "
          "the GPU runs nothing from its first kernel to its last (copies before the first "
          "kernel, the first step's set-up, not counted).\n\n"
          + _table(["run", "GPUs", "model", "dp,pp,tp", "variant", "steps", "compute", "NCCL",
                    "exposed", "idle"], rows)
          + "\n")


def trainer_cpu_section() -> str:
  runs = _load("bench_trainer_cpu_*.json")
  if not runs:
    return ""
  rows = [[name.split("_")[-1].removesuffix(".json"), d["config"], d["cpu_count"], v,
           d["tokens_per_s"][v], d["ratio_to_reference"][v]]
          for name, d in runs for v in d["tokens_per_s"]]
  return ("### The trainer on one CPU device (`benchmarks/bench_trainer_cpu.py`)\n\n"
          "tokens/s, median of the `log_every` windows after the first, rounds alternating "
          "the variants on the same batches: `reference` = the step of the former "
          "single-device trainer (`models.gpt` under `jax.jit`), `trainer_*` = the trainer "
          "(the stacked step on the mesh (1, 1, 1)) with the layers unrolled "
          "(`parallel.scan_layers=False`, as `configs/tiny.py` sets) or as a scan.\n\n"
          + _table(["run", "config", "devices", "variant", "tokens/s", "/ reference"], rows)
          + "\n")


def _dp_codec_rows(d: dict, fam: str) -> list[list]:
  """One family's rows: e4m3 without the transform per group size, the best FP8 setting with
  it; int4 without it per group size, the best fp4 without it, the best 4-bit setting with
  it (best: the lowest score)."""
  t = d["families"][fam]
  best = lambda rows: rows[0] if rows else None  # noqa: E731 (tables sort by score)
  fp8 = [r for r in t["fp8"] if r["format"] == "e4m3" and not r["hadamard"]]
  fp8 = sorted(fp8, key=lambda r: r["group_size"]) + [best([r for r in t["fp8"] if r["hadamard"]])]
  four = sorted([r for r in t["four_bit"] if r["format"] == "int4" and not r["hadamard"]],
                key=lambda r: r["group_size"])
  four += [best([r for r in t["four_bit"] if r["format"] == "fp4" and not r["hadamard"]]),
           best([r for r in t["four_bit"] if r["hadamard"]])]
  lag = {(r["format"], r["group_size"], r["hadamard"]): r
         for r in d.get("feedback", {}).get("fp8", []) + d.get("feedback", {}).get("four_bit", [])}
  rows = []
  for r in [r for r in fp8 + four if r]:
    f = lag.get((r["format"], r["group_size"], r["hadamard"])) if fam == "dp_params" else None
    rows.append([fam, f"{r['format']} G={r['group_size']}" + (" Hadamard" if r["hadamard"] else ""),
                 r["bits_per_element"], r["rel_l2"], r["share_off_by_8th"],
                 f and f["with_feedback"][-1], f and f["without_feedback"][-1]])
  return rows


def _pp_codec_rows(d: dict) -> list[list]:
  """Per pipeline site (measure_dp_codec --families pp): e4m3 without the transform per
  group size (groups along the hidden axis), the best with the transform, the best e5m2,
  the best with groups along the token axis and e4m3 G=128 so, the best 4-bit setting."""
  rows = []
  for site, t in d.get("sites", {}).items():
    best = lambda rs: rs[0] if rs else None  # noqa: E731 (tables sort by score)
    fp8 = sorted([r for r in t["fp8"] if r["format"] == "e4m3" and not r["hadamard"]],
                 key=lambda r: r["group_size"])
    picks = fp8 + [best([r for r in t["fp8"] if r["hadamard"]]),
                   best([r for r in t["fp8"] if r["format"] == "e5m2"]),
                   best(t["tokens"]),
                   best([r for r in t["tokens"] if (r["format"], r["group_size"], r["hadamard"])
                         == ("e4m3", 128, False)]),
                   best(t["four_bit"])]
    for r in [r for r in picks if r]:
      rows.append([site, f"{r['format']} G={r['group_size']}" + (" Hadamard" if r["hadamard"]
                                                                 else "")
                   + (" tokens" if r.get("axis") == "tokens" else ""),
                   r["bits_per_element"], r["rel_l2"], r["share_off_by_8th"], None, None])
  return rows


def dp_codec_section() -> str:
  parts = []
  for name, d in _load("measure_dp_codec_*.json"):
    m, fb = d["model"], d.get("feedback", {})
    choice = "; ".join(f"{fam}: {c['setting']['format']} G={c['setting']['group_size']}"
                       + (" Hadamard" if c["setting"]["hadamard"] else "")
                       for fam, c in d["choice"].items())
    parts.append(
        f"#### {d['capture_config']['name']}: GPT {m['n_layers']} x {m['d_model']} "
        f"({m['params']:,} params) trained {d['trained']['steps']} steps, {d['captured']['steps']} "
        f"steps captured on dp,pp,tp = {','.join(map(str, d['args']['mesh']))} (`{name}`)\n\n"
        f"Chosen by calibrate's rule (at most the config's bits): {choice}. "
        + (f"One step's update / the weights: {fb['update_norm'][-1] / fb['weight_norm']:.2g}."
           if fb.get("weight_norm") else "") + "\n\n"
        + _table(["family", "setting", "bits/element", "rel_l2", "share off by > 1/8",
                  f"lag, feedback (step {fb.get('steps')})", "lag, no feedback"],
                 [r for fam in ("dp", "dp_params") if fam in d["families"]
                  for r in _dp_codec_rows(d, fam)] + _pp_codec_rows(d)) + "\n")
  return _section(
      "Data-parallel codecs on a trained model's tensors (`benchmarks/measure_dp_codec.py`, CPU)",
      "What the sharded optimizer sends (`parallel.shard_optimizer`): `dp` = each rank's "
      "gradient entering the reduce-scatter, `dp_params` = the weight differences entering "
      "the all-gather. FP8 = our codec (encode -> u8 wire -> decode); `int4` / `fp4` (E2M1) = "
      "a simulated 4-bit quantizer, one fp32 absmax scale per group (no kernel). `rel_l2` = "
      "||x_hat - x|| / ||x||, means over the family's collectives. `lag`: "
      "||master - parameters|| / ||that step's update|| after the last captured step, the "
      "updates replayed through each quantizer with error feedback (what a rank sends is "
      "master - parameters, as `compression.dp_params` does) and without (it sends the "
      "update; the roundings add up). `--families pp`: the pipeline hand-offs per site "
      "(`pp/fwd` the activations a stage sends on, `pp/bwd` their gradients sent back); "
      "`tokens`: groups along the token axis instead of the hidden one.", parts)


def _accuracy_codec(run: dict) -> str:
  """The codec of each family that sends something on the run's mesh, e.g.
  "e4m3 G=128 no-Hadamard (dp, dp_params)", or "off"."""
  from taco_jax.tp.mesh import sending_families
  c, p = run["compression"], run["parallel"]
  if not c["enabled"]:
    return "off"
  by_words: dict[str, list] = {}
  for fam in sending_families(dp=p["dp"], pp=p["pp"], tp=p["tp"],
                              shard_optimizer=p.get("shard_optimizer", False)):
    words = _codec_words(c[fam]) if c[fam].get("enabled", True) else "off"
    by_words.setdefault(words, []).append(fam)
  return "; ".join(f"{w} ({', '.join(fams)})" for w, fams in by_words.items())


def _nonfinite(metric: str, steps: list, run: dict) -> str:
  """'<metric> not finite in k of its n values (steps a, b, ...); '."""
  shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
  return (f"**{metric.replace('_', ' ')} not finite in {len(steps)} of its "
          f"{len(run['curves'][metric])} values** (steps {shown}); ")


def _accuracy_setup(d: dict) -> str:
  """The heading of the runs that compare with each other: config, model, mesh, device."""
  first = next(iter(d["runs"].values()))  # every variant trains the same model and mesh
  m, p = first["model"], first["parallel"]
  config = pathlib.Path(d["config"]["config"]).stem
  return (f"`{config}`: GPT {m['n_layers']} x {m['d_model']}, byte vocab, dp,pp,tp = "
          f"{p['dp']},{p['pp']},{p['tp']}"
          + (", optimizer sharded" if p.get("shard_optimizer") else "")
          + f", {d['config']['steps']} steps, {d['num_devices']}x {d['device']}")


def _ablation_table(name: str, d: dict) -> str:
  sites = sorted(d["ablations"])
  names = [r["name"] for r in d["ablations"][sites[0]]]
  rows = []
  for i, ab in enumerate(names):
    per = [d["ablations"][s][i] for s in sites]
    rows.append([ab] + [r["rel_l2"] for r in per]
                + [sum(r["share_off_by_8th"] for r in per) / len(per)])
  choice = "; ".join(f"{fam}: {c['setting']}" for fam, c in d["calibration"]["choices"].items())
  return (f"\nCodec settings on the messages each compressed collective sent, captured "
          f"from the trained model (`{name}`): relative L2 error per site, and the share of "
          "elements off by more than 1/8 of themselves (mean over sites). Calibration's "
          f"choice (lowest mean relative L2 at no more wire bytes): {choice}.\n\n"
          + _table(["setting"] + sites + ["share off by > 1/8"], rows) + "\n")


def accuracy_section() -> str:
  runs = [(n, d) for n, d in _load("accuracy_*.json") if d["environment"]["platform"] == "gpu"]
  if not runs:
    return ""
  setups: dict[str, list] = {}
  for name, d in runs:
    setups.setdefault(_accuracy_setup(d), []).append((name, d))
  text = ("### Accuracy (`benchmarks/bench_accuracy.py`)\n\n"
          "Validation loss after the same steps from the same seed and batches; `cost %` = "
          "(val on - val off) / val off. `calibrated` trains with the codec "
          "`taco_jax.apps.calibrate` chose from tensors of the trained `off` model. Curves: "
          "`docs/accuracy_loss.png` (`python -m benchmarks.plot_accuracy`).\n")
  for setup, group in setups.items():
    rows = []
    for name, d in group:
      for v, r in d["runs"].items():
        cost = r.get("accuracy_cost")
        rows.append([d["label"], d["config"].get("seed") or 0, v, _accuracy_codec(r),
                     r["summary"]["val_loss"], None if cost is None else 100 * cost])
    by_codec: dict[str, list] = {}
    for row in rows:
      if row[-1] is not None and math.isfinite(row[-1]):  # a NaN validation loss: no cost
        by_codec.setdefault(row[3], []).append(row[-1])
    text += (f"\n#### {setup}\n\n"
             + _table(["run", "seed", "variant", "codec (families)", "val loss", "cost %"], rows)
             + "\n")
    if by_codec:
      text += "\nPer codec over the seeds: " + "; ".join(
          f"{codec}: mean {sum(v) / len(v):+.2f}% over {len(v)} (from {min(v):+.2f}% "
          f"to {max(v):+.2f}%)" for codec, v in by_codec.items()) + ".\n"
    for name, d in group:
      if diff := d.get("kernels_vs_collectives"):
        fell_back = d["runs"]["on_all_cm"].get("kernel_fallbacks")
        text += (f"\n`{name}`: the kernel layers (`on_all_cm`) against the collectives "
                 f"(`on_all`), every TP message in FP8 on both: training loss at most "
                 f"{100 * diff['loss_max_rel_diff']:.3g}% apart, validation loss "
                 f"{100 * diff['val_loss_max_rel_diff']:.3g}%; "
                 + "".join(_nonfinite(metric, steps, d["runs"]["on_all_cm"])
                           for metric in ("loss", "val_loss")
                           if (steps := diff.get(f"{metric}_nonfinite_steps")))
                 + (f"kernels that fell back: {'; '.join(fell_back)}.\n" if fell_back
                    else "every kernel ran.\n"))
    # runs before the metric existed measured rel. L2 only
    with_share = [(n, d) for n, d in group if any(
        "share_off_by_8th" in r[0] for r in d.get("ablations", {}).values())]
    if with_share:
      text += _ablation_table(*with_share[-1])
  return text


CM_COLLECTIVE = {"ag": "all_gather", "rs": "reduce_scatter"}


def _cm_message_bytes(case: dict) -> int:
  """What the plain collective of a kernel case sends, bytes per device (bf16): the
  all-gather's shard of x, the reduce-scatter's whole partial y @ w."""
  b, t, f = case["a_shape"]
  if case["kind"] == "ag":
    return b * t * f * 2 // case["tp"]
  return b * t * case["w_shape"][1] * 2


def _ran_at(name: str, d: dict) -> str:
  """When a run wrote its results, as ISO text: its ``date`` (with the time, in the runs of
  2026-11-23 on), else the date in its file name."""
  if "date" in d:
    return d["date"]
  day = name.rsplit("_", 1)[-1].split(".")[0]
  return f"{day[:4]}-{day[4:6]}-{day[6:]}"


def _cm_cases() -> tuple[dict, list[str]]:
  """The multi-GPU kernel benchmark runs' cases as ``{link label: {tp: cases}}``, and the
  files they came from. A run may time some layers only (``--layers``): a later run's case
  replaces an earlier one of the same model and layer (by the time the run wrote, so that
  runs of one day come in the order they ran), the other cases stay. A run on fewer GPUs
  than its TP timed the one-GPU variants only, and is left out."""
  merged, names = {}, []
  runs = sorted(_load("bench_collective_matmul_*.json"), key=lambda r: _ran_at(*r))
  for name, d in runs:
    if d.get("gpus", d["tp"]) >= d["tp"] >= 2 and "cases" in d:
      by_case = merged.setdefault(name.split("_")[3], {}).setdefault(d["tp"], {})
      by_case.update({(c["model"], c["layer"]): c for c in d["cases"]})
      names.append(name)
  return ({label: {tp: list(cases.values()) for tp, cases in by_tp.items()}
           for label, by_tp in merged.items()}, names)


def _cm_work(case: dict) -> int:
  """One rank's matmul FLOPs per byte of the plain collective's message: the all-gather's
  ``2 B T K (N / n) / (B (T / n) K 2)`` = N, the weight's global width; the
  reduce-scatter's ``2 B T (F / n) D / (B T D 2)`` = F / n, its contraction per rank. The
  lower it is, the more the link and the less the matmul bounds the kernel."""
  b, t, f = case["a_shape"]
  return round(2 * b * t * f * case["w_shape"][1] / case["tp"] / _cm_message_bytes(case))


# How much faster than the plain kernel the FP8 one must be to count as a win: within the
# runs' spread (about 1% between processes) a tie keeps the plain kernel, which is exact.
# 2026-11-28: the QKV backward's FP8 reduce-scatter at TP=2 "won" by 0.01% (0.2991 ms each).
KERNEL_WIN_MARGIN = 0.01


def kernel_thresholds(cases: list[dict]) -> dict:
  """Per collective: where the compressed kernel beat the plain one by at least
  ``KERNEL_WIN_MARGIN`` of its time, as ``{"max_work":
  `_last_win` of (`_cm_work`, won), "min_bytes": the smallest message among those wins}``
  (the policy claims no win below a measured size), or None where it lost at the least
  work measured. Work, not the message's size, separates the measured wins from the
  losses: at TP=4 the 1.3B all-gathers all send 16 MiB, and FP8 won only where the matmul
  is narrow (the out-projection's backward)."""
  points = {}
  for c in cases:
    v = c["variants"]
    if "ms" in v.get("fused", {}) and "ms" in v.get("fused_fp8", {}):
      points.setdefault(CM_COLLECTIVE[c["kind"]], []).append(
          (_cm_work(c), _cm_message_bytes(c),
           v["fused_fp8"]["ms"] < (1 - KERNEL_WIN_MARGIN) * v["fused"]["ms"]))
  out = {}
  for coll, pts in sorted(points.items()):
    most = _last_win((w, won) for w, _, won in pts)
    out[coll] = None if most is None else dict(
        max_work=most, min_bytes=min(b for w, b, _ in pts if w <= most))
  return out


def measured_module() -> str:
  table, sources = {}, []
  for name, d in _load("collectives_*.json"):
    if d.get("platform") == "gpu" and d["config"].get("num_slices", 1) == 1:
      table.setdefault(d["label"], {})[d["num_devices"]] = thresholds(d)
      sources.append(name)
  cases, names = _cm_cases()
  kernels = {label: {tp: kernel_thresholds(c) for tp, c in by_tp.items()}
             for label, by_tp in cases.items()}
  sources += names
  return ('"""Generated by `python -m benchmarks.report` from benchmarks/results: do not edit.\n\n'
          "MIN_BYTES[link][devices][collective]: the smallest message (bytes per device) from\n"
          "which the compressed collective beat bf16 at every larger measured size, on that\n"
          'link with that many devices in the axis; None where it never did.\n\n'
          "KERNEL_PAYS[link][devices][collective]: where the fused collective-matmul\n"
          "kernel's FP8 version beat its plain one by at least "
          f"{KERNEL_WIN_MARGIN:.0%} of its time\n"
          "(bench_collective_matmul; a closer tie keeps the plain kernel): at every measured\n"
          "work (one rank's matmul FLOPs per byte of the message the plain collective would\n"
          "send) up to max_work, from min_bytes, the smallest such message; None where it lost\n"
          'at the least work measured."""\n\n'
          f"SOURCES = {pprint.pformat(sources, width=88)}\n\n"
          f"MIN_BYTES = {pprint.pformat(table, width=88)}\n\n"
          f"KERNEL_PAYS = {pprint.pformat(kernels, width=88)}\n")


# the collective-matmul tables' columns, in order; a run's variants of the fused kernels
# (`fused[phases=2]`, `fused_fp8[push=0]`, ...) and the diagnostics of any kernel (marked
# `diagnostic` by the bench, e.g. `gemm[skip=copy]`) come after them, as the run wrote
# them (the tiling sweeps of `gemm` / `core` stay out: their runs' JSON has them)
CM_FUSED = ("xla", "fused", "fused_fp8")
CM_REFERENCES = ("rank0", "rank0_fp8", "gemm", "gemm_fp8", "core[default]", "jax_gemm",
                 "jax_gemm[cluster=m]", "jax_gemm[cluster=n]", "xla_f32_dot", "cublas",
                 "core[default][w_t]", "cublas[w_t]",
                 "core[default]_cold", "cublas_cold", "core[default]_hot", "cublas_hot",
                 "core[default]_fresh", "cublas_fresh")


def _cm_columns(cases: list) -> list:
  """The variants that ran in any case of a collective-matmul run, as its table's columns."""
  ran = list(dict.fromkeys(k for c in cases for k, v in c["variants"].items() if "ms" in v))
  known = CM_FUSED + CM_REFERENCES
  diagnostics = {k for c in cases for k, v in c["variants"].items() if "diagnostic" in v}
  variants = [k for k in ran if (k.startswith(("fused[", "fused_fp8[")) or k in diagnostics)
              and k not in known]
  return ([k for k in CM_FUSED if k in ran] + variants + [k for k in CM_REFERENCES if k in ran])


def _kernel_ms(variant: dict) -> float | None:
  """The collective-matmul kernel's own time within a variant (without the encode and the
  gathered x's decode beside it)."""
  times = [ms for name, ms in variant.get("kernels", {}).items() if name.startswith("taco_")
           and "matmul" in name]
  return sum(times) if times else None


CM_OPEN = 6  # collective-matmul runs shown open in the README, newest first


# The fused collective-matmul tables' columns
CM_COLUMNS = (
    "Device time (CUPTI) per call, median of 20 (unless the heading says otherwise), per kernel the"
    " minimum over GPUs. `xla`: XLA's collective then cuBLAS (today's layers); `fused` / "
    "`fused_fp8`: the plain / FP8 collective-matmul kernel (`fused_fp8` includes the encode "
    "kernel); `gemm` / `gemm_fp8`: the same kernels on one GPU with no peer (the GEMM core, FP8 "
    "decode or encode included); `rank0` / `rank0_fp8` (one GPU): rank 0's kernel at the TP shapes "
    "in local mode, its copies landing in local memory and no wait for peers (the FP8 kernel alone,"
    " codes made beforehand); `fp8 / plain`: `fused_fp8` / `fused`, or on one GPU `rank0_fp8` / "
    "`rank0`; `jax_gemm`: jax's Hopper matmul example on that shape (`[cluster=m]` / `[cluster=n]`:"
    " in pairs of CTAs sharing a block by multicast); `cublas`: XLA's bf16 matmul of one rank's "
    "whole product (cuBLAS: the ideal); `xla_f32_dot`: the same accumulated in fp32 and converted, "
    "which XLA runs as a Triton GEMM, up to ~15% slower: the `cublas` column of the runs before "
    "2026-11-24, whose ratios are against it. `MiB/device`: what the plain collective sends. `… "
    "kernel ms`: the FP8 collective-matmul kernel alone, without the encode before it and the "
    "decode of the gathered x after it (the all-gather's). `_cold` / `_hot` (`--cold`, `--hot`): "
    "the GEMM core and cuBLAS, each call after a pass over 512 MiB (L2 holds none of the operands) "
    "/ after ~60 ms of fp32 matmuls (a GPU under sustained load), timing the matmul's kernel alone;"
    " `_fresh` (`--fresh`): each call on an x an XLA fusion has just written, as in a step. "
    "`[w_t]`: on the weight stored transposed, as the backward passes read it.")
# What each bracketed variant of those tables is, by the runs that have it
CM_VARIANTS = (
    "`[packed_sems]` (the `nvlink_sems` run): the kernels as they are, every semaphore in one "
    "cache line, beside `fused` / `fused_fp8` there with each semaphore on a line of its own and "
    "only the compute warpgroups waiting for the peers (a change reverted after this run).",
    "`[push=C]` (the `nvlink_push` run of 2026-11-26, 2xH100): the reduce-scatter kernels as they "
    "are with C = 0 (every partial pulled by its owner), or pushing the first C of 8 tile columns "
    "of each partial into the owner's memory, beside `fused` / `fused_fp8` there pushing 4 (a "
    "change reverted after this run).",
    "`[push]` (the `nvlink_push` runs of 2026-11-27, 2 and 4 H200s): the reduce-scatter kernels, "
    "plain and FP8, pushing every partial into its owner's outbox (`matmul_rs`'s `push`, reverted "
    "after these runs: slower at TP=2, and at TP=4 faster plain but not FP8, whose MLP-out result "
    "came back with NaNs). In `nvlink_last_sm_relay_2gpu` `[push]` and `[pull]` are the kernels "
    "pushing (with a branch per peer around each store and a signal a phase, commit e9101c8, "
    "reverted after that run) and pulling, as they do by default at TP=2.",
    "`[phases=P]` (the `nvlink_phases` run): the plain reduce-scatter kernel with P row-tile "
    "phases, beside `fused` with its default (`matmul_rs.default_phases`: 4 at these shapes).",
    "`[mix]` (the `nvlink` run of 2026-11-23): the reduce-scatter kernels with each peer phase "
    "and the previous own phase in one loop, measured slower (`matmul_rs.schedule`).",
    "`[pull=D]` (the `nvlink_pull` run, and in `nvlink_pull_fp8_4gpu` the FP8 kernel's too): the "
    "reduce-scatter kernel with D receive slots per warpgroup for the peers' partials, beside "
    "`fused` with 2 (`matmul_rs.PULL_DEPTH`).",
    "`[relay_sm=1]` (the `nvlink_relay` run): the reduce-scatter kernel with its last SM "
    "computing no tile and only relaying the phases' signals, beside `fused` relaying from SM 0's "
    "first compute warpgroup (a change reverted after this run).",
    "`[cluster_n=C]` (the runs of 2026-11-27): the plain all-gather kernel in clusters of C CTAs "
    "sharing each A block, which pull the peers' rows (`ag_matmul`'s pulled schedule); `+sms=N`: "
    "on N SMs. In `nvlink_pulled` (2 GPUs) and `nvlink_clusters` a grid of clusters of 4 had one "
    "per 4 SMs (33), more than an H200 runs at once; since then it has at most 30 "
    "(`gemm.RESIDENT_CLUSTERS`). `fused` is the ring in those runs and in `nvlink_turns`; from "
    "`nvlink_layers` on it is the layers' choice (`ag_matmul.plain_tiling`: pulled where one "
    "cluster covers the output row), `[cluster_n=1]` the ring; the 4-GPU `nvlink_pulled` run's "
    "`fused` is the ring, its `[cluster_n=2]` what the layers now take. The FP8 kernel does not "
    "pull: its `[cluster_n=C]` variants did not run.",
    "In `nvlink_epi_*`, `nvlink_delay`, `nvlink_wide*` and `nvlink_chain*` (later on 2026-11-27) "
    "the bracketed variants override the kernels' tiles (`gemm.Tiling` fields): "
    "`tile_m=64+tile_n=256+split=m` the wide tiles the all-gather kernels take since "
    "(`ag_matmul.WIDE`; `fused` in `nvlink_wide*` and `nvlink_chain`, whose "
    "`[tile_m=128+tile_n=128+split=n]` is the old default), `stages=S+epi_n=E` the pipeline's "
    "depth and the epilogue's sub-tile width, `chain=0` a pipeline per tile instead of one "
    "chained over each SM's tiles (`Tiling.chain`, the default since `nvlink_chain`); `[delay=0]` "
    "(`nvlink_delay`) the all-gather kernels reading their copies out within each step, as they "
    "do since, instead of holding each block one step longer. The FP8 kernels refused some of "
    "these tiles (the all-gather's takes no columns split between its warpgroups, the "
    "reduce-scatter's encodes groups of 128 columns, one warpgroup's): those variants did not "
    "run.",
    "In `nvlink_skip*` (later on 2026-11-27) each `[skip=...]` variant leaves parts of a kernel "
    "out, to price them, and was timed although its result is wrong by design (`_skip` of "
    "`matmul_reduce_scatter` and `all_gather_matmul`): `waits` the own phases' waits for the "
    "peers' signals, `release` the release at the end, `signals` the sent loops' signals, "
    "`remote` the peers' partials (the owner reads its own outbox: no link traffic), `copy` the "
    "all-gather's copy of its own chunk into the gathered x (`gemm[skip=copy]`: the same on one "
    "GPU); in `nvlink_skip_fp8_4gpu` the FP8 reduce-scatter's too, both still signalling after "
    "each sent loop, and in `nvlink_phase_signal_4gpu` after each phase. `[each_loop]` "
    "(`nvlink_phase_signal`): the reduce-scatter kernels, plain and FP8, signalling each sent "
    "loop's owner after the loop, as before that run, beside `fused` / `fused_fp8` signalling "
    "every peer once a phase (`matmul_rs`'s `_signal_each_loop`, removed since).",
    "In `nvlink_decoded_slots*` (last on 2026-11-27) `fused_fp8` / `gemm_fp8` write the "
    "decoded gathered x through alternating staging slots, `[decoded_wait_all]` each part once "
    "every earlier store has read the second slot, as before and since (`_decoded_wait_all`; "
    "the change was reverted after these runs: the same times). `_tp4_shapes` ran the TP=4 "
    "shapes on 2 GPUs: only the one-GPU variants; `rank0` / `rank0_fp8` are rank 0's kernels "
    "in local mode, the FP8 one without the encode.",
    "In `nvlink_last_sm_relay*` (last on 2026-11-27) `[relay_sm0]` is the reduce-scatter "
    "kernel, plain and FP8, with SM 0 relaying each phase's signal to the peers one after "
    "another, as before that run (`_relay_on_sm0`, removed since), beside `fused` / "
    "`fused_fp8` relaying from the SM dealt the phase's last tile, to every peer behind one "
    "fence.",
    "In `nvlink_probe*` each `[probe=...]` variant (`_probe` of `matmul_reduce_scatter`, results "
    "right) makes every sent tile read and drop partials as an own tile reads them: `sent_reads` "
    "its first two blocks from the peer, `sent_local_reads` the same from its own GPU, "
    "`sent_all_reads` all four, the slots refilled as they empty.",
    "In `nvlink_rolled*` `[unrolled]` is the reduce-scatter kernel, plain and FP8, with its "
    "schedule's tile loops unrolled one after the other (`_unrolled`, as before 2026-11-27, "
    "removed later); the unbracketed kernels run them as two nested loops.",
    "In `nvlink_decode_parts` the unbracketed FP8 all-gather kernels take pipeline steps of 64, 4 "
    "deep (the default until that run); `[tile_k=128+stages=2]` steps of 128, 2 deep, and "
    "`[...+decode_parts=2]` each step decoded and multiplied in two halves "
    "(`Tiling.decode_parts`), the FP8 all-gather's default since (`ag_matmul.FP8_TILINGS`). The "
    "plain kernels ran those tiles too, for comparison.",
    "In `nvlink_rolled_4gpu` (after that change) `[tile_k=64+stages=4+decode_parts=1]` is the FP8 "
    "all-gather's tiling before it (the plain all-gather's own); the reduce-scatter kernels' "
    "pipelines do not fit those tiles in shared memory, so they did not run.",
    "In `nvlink_decoded_2gpu` `fused_fp8` / `gemm_fp8` are the FP8 all-gather returning the "
    "gathered codes, decoded after it by an XLA fusion (the way until that run), `[decoded]` the "
    "kernel writing the gathered x decoded itself, the only way since (the `fused_fp8` of "
    "`nvlink_decoded_4gpu`).",
    "In `nvlink_2.7b_4gpu` the all-gather kernels refused the 2.7B QKV's and out-projection "
    "backward's widths at TP=4 (1920 and 640 columns, in tiles of 256), where the layers then "
    "fell back to XLA; `nvlink_narrow` (later) times them on the tiles the layers have taken "
    "there since (`ag_matmul.NARROW`, [128, 128] per warpgroup), the FP8 kernel on "
    "`ag_matmul.fp8_tiling`'s choice as the layers (the bench had given it fixed tiles); "
    "`core[default]` and jax's example still take tiles of 256 only.",
    "In `nvlink_wt` `[w_t]` is the same kernel given its weight stored [N, K] and reading it "
    "transposed (`transpose_w`), as the layers' backward kernels do since that run.",
    "In `nvlink_waves`, `nvlink_ring_widths*` and `nvlink_fp8_widths` (later on 2026-11-27) "
    "`[tile_n=C]` gives every warpgroup tile C columns, the FP8 kernels' too. "
    "`fused` is the wide tiles (256 columns) in `nvlink_waves`; since then it is the layers' "
    "choice, the ring's tiles narrowed where a step's tiles leave a wave half empty "
    "(`ag_matmul.ring_tiling`: 192 columns at the 1.3B QKV at TP=4; 128 at the 2.7B MLP-in at "
    "TP=4 and out-projection backward at TP=2), and `[tile_n=256]` the tiles before. At "
    "the out-projection's backward the plain `[tile_n=128]` still pulls in clusters of 2, which "
    "then read each remote row tile twice; 192 columns do not divide its 512.",
    "In `nvlink_row_ready` and `nvlink_row_ready_vs_chunk` (last on 2026-11-27) the all-gather "
    "ring's tiles (`fused`, `fused_fp8`) wait for their A rows, a semaphore per step and row "
    "tile, instead of whole chunks, at TP=2 too; `[chunk_waits]` is the ring waiting for whole "
    "chunks, as before (`_chunk_waits`). Since these runs the ring waits for rows from 3 ranks on "
    "(`ag_matmul.ROW_WAITS_FROM`; TP=2 keeps the chunk waits) and narrows its tiles only where "
    "it waits for chunks: in `nvlink_row_ready` the QKV's `fused` ran on 192 columns, "
    "`[tile_n=256]` on the wide tiles TP=4 takes since.",
)


def collective_matmul_section() -> str:
  parts = []
  for name, d in _load("bench_collective_matmul_*.json"):
    if "cases" not in d or not any("ms" in v for c in d["cases"] for v in c["variants"].values()):
      continue
    cols = _cm_columns(d["cases"])
    fp8 = "fused_fp8" if "fused_fp8" in cols else "gemm_fp8"
    plain = "fused" if "fused" in cols else "rank0"  # on one GPU: rank 0 alone
    rows = []
    for c in d["cases"]:
      v = c["variants"]
      ms = lambda k: v.get(k, {}).get("ms")  # noqa: E731
      ratio = lambda a, b: ms(a) / ms(b) if ms(a) and ms(b) else None  # noqa: E731
      rows.append([c["model"], c["layer"], CM_COLLECTIVE[c["kind"]],
                   f"{_cm_message_bytes(c) / MIB:.0f}"] + [ms(k) for k in cols]
                  + [_kernel_ms(v.get(fp8, {})), ratio("fused", "cublas"),
                     ratio(f"{plain}_fp8", plain), ratio("xla", "fused")])
    gpus = d.get("gpus", d["tp"])
    parts.append((d.get("date", ""), name,
                  f"#### {gpus}x {d['device']}, shapes of TP={d['tp']}, batch {d['batch']} x "
                  f"seq {d['seq']}{_calls(d)} (`{name}`)\n\n"
                  + _table(["model", "layer", "collective", "MiB/device"]
                           + [f"{k} ms" for k in cols]
                           + [f"{fp8} kernel ms", "fused / cublas", "fp8 / plain",
                              "xla / fused"], rows) + "\n"))
  variants = "\n".join(f"- {v}" for v in CM_VARIANTS)
  return _section(
      "Fused collective matmuls (`benchmarks/bench_collective_matmul.py`)",
      f"{CM_COLUMNS} Every kernel but the `[skip=...]` variants was checked against its "
      f"reference before it was timed; – where it did not run. Newest run first; the runs "
      f"before the newest {CM_OPEN} are folded below them.\n\n"
      f"<details><summary>The bracketed variants, run by run</summary>\n\n{variants}\n\n"
      f"</details>\n", _newest_open(parts, CM_OPEN))


def _calls(run: dict) -> str:
  """A collective-matmul run's calls per median where not the default 20 (runs before
  2026-11-28 did not record it: they took the default), back to back: many of them keep
  the GPU at its power cap."""
  iters = run.get("iters", 20)
  return "" if iters == 20 else f", median of {iters} calls back to back"


def _newest_open(parts: list[tuple[str, str, str]], shown: int) -> list[str]:
  """The ``(date, name, text)`` parts newest first, all but the first ``shown`` folded in
  one ``<details>`` block (a long history of runs, kept but out of the way)."""
  texts = [text for *_, text in sorted(parts, reverse=True)]
  if len(texts) <= shown:
    return texts
  earlier = texts[shown:]
  return texts[:shown] + [f"<details><summary>{len(earlier)} earlier runs</summary>\n\n"
                          + "\n".join(earlier) + "\n</details>\n"]


def peer_copy_section() -> str:
  """bench_peer_copy: GB/s one rank receives, by copy direction, SMs and blocks in flight,
  beside NCCL's on the same shards."""
  parts = []
  for name, d in _load("bench_peer_copy_*.json"):
    if d["device"] == "cpu":
      continue
    for case in d["cases"]:
      v = case["variants"]
      nccl = [(k, r) for k, r in v.items() if k.startswith("xla_") and "gb_s" in r]
      grid = {}
      for k, r in v.items():
        if k.startswith(("pull[", "push[")):
          spec = _spec_of(k)
          grid.setdefault((k[:4], spec["sms"], spec["rows"]), {})[spec["depth"]] = r
      depths = sorted({depth for row in grid.values() for depth in row})
      rows = [[mode, sms, rows_ * d.get("cols", 256) * 2 // 1024,
               *[row.get(depth, {}).get("gb_s") for depth in depths]]
              for (mode, sms, rows_), row in grid.items()]
      parts.append(
          f"#### {d['n']}x {d['device']}: {case['shard_mib']} MiB from "
          f"{'the next rank' if case['peers'] == 'one' else 'every peer'} "
          f"({case['received_mib']} MiB received per rank; `{name}`)\n\n"
          + _table(["copy", "SMs", "KiB per block",
                    *[f"GB/s, {depth} blocks per SM" for depth in depths]], rows)
          + "".join(f"\n\nNCCL's `{k[4:]}`: {r['gb_s']:.0f} GB/s." for k, r in nccl) + "\n")
  return _section(
      "In-kernel copies between GPUs (`benchmarks/bench_peer_copy.py`)",
      "What TMA copies to and from peer memory move inside a Mosaic GPU kernel that does "
      "nothing else (`pallas_kernels/peer_copy.py`): GB/s one rank receives over the copy "
      "kernel's own device time (CUPTI, median of 20; without the cross-GPU barrier XLA runs "
      "before it), every result checked bit for bit first. `pull`: each rank loads its "
      "sources' blocks from their memory; `push`: each stores its blocks into theirs. NCCL: "
      "XLA's `all_gather` or `ppermute` of the same shards, in the same process "
      "(NCCL_NVLS_ENABLE=0).", parts)


def exchange_section() -> str:
  """bench_exchange: parallel.tp_exchange's all-to-all, our kernel against NCCL's."""
  rows, fused_rows, iters = [], [], set()
  for name, d in _load("bench_exchange_*.json"):
    if d["platform"] != "gpu":
      continue
    iters.add(d.get("iters", 20))  # runs before the field used the default, 20
    for case in d["cases"]:
      v = case["variants"]
      if case["way"] in ("matmul_backward", "matmul_forward"):
        fused_rows.append(_fused_exchange_row(name, d, case))
        continue
      xla, kernel = v.get("xla_all_to_all", {}), v.get("kernel", {})
      ratio = xla["ms"] / kernel["ms"] if "ms" in xla and "ms" in kernel else None
      rows.append([name.removesuffix(".json"), f"{d['gpus']}x {d['device']}", case["model"],
                   case["way"],
                   "x".join(map(str, case["shape"])), case["received_mib"], xla.get("ms"),
                   kernel.get("ms"), ratio, xla.get("gb_s"), kernel.get("gb_s")])
  return _section(
      "The exchange's all-to-all (`benchmarks/bench_exchange.py`)",
      "`parallel.tp_exchange`'s all-to-all of the attention's input (`forward`: rows to "
      "columns) and of its gradient (`backward`), one GPU group as the TP axis: NCCL's "
      "(`lax.all_to_all`, NCCL_NVLS_ENABLE=0) and our kernel (`pallas_kernels/exchange.py`), "
      f"ms of device time (CUPTI, median of {' or '.join(map(str, sorted(iters)))}; the "
      "kernel's with the cross-GPU barrier XLA runs before it), every result checked bit for "
      "bit first; GB/s that a rank receives.",
      [_table(["run", "GPUs", "model", "way", "x per rank", "MiB received", "NCCL ms",
               "kernel ms", "NCCL / kernel", "NCCL GB/s", "kernel GB/s"], rows) + "\n"]
      + ["The exchange's matmuls with their exchange in one kernel (`fused`): the "
         "out-projection's input gradient (`matmul_backward`: `dout @ w.T`, w the whole "
         "`[d_model, d_model]` weight read transposed, then the exchange back; "
         "`pallas_kernels/matmul_all_to_all.py`) and its forward (`matmul_forward`: the "
         "exchange, then `@ w`; `pallas_kernels/all_to_all_matmul.py`, the fastest of its "
         "mover counts), against NCCL's all-to-all or our exchange kernel beside cuBLAS, and "
         "the matmul alone (cuBLAS: the ideal), ms of device time as above; every result "
         "checked first (the fused kernel bit for bit against our GEMM core and XLA's "
         "all-to-all, also eight calls chained in one program where the run has `fused "
         "x8`).\n",
         _table(["run", "GPUs", "model", "way", "per rank", "NCCL + cuBLAS ms",
                 "our exchange + cuBLAS ms", "fused ms", "cuBLAS alone ms", "apart / fused",
                 "fused / cuBLAS alone", "fused x8 checked"], fused_rows) + "\n"
         ] * bool(fused_rows)
      if rows else [])


def _fused_exchange_row(name: str, d: dict, case: dict) -> list:
  """A ``matmul_backward`` or ``matmul_forward`` case's row of `exchange_section`."""
  v = {k: x.get("ms") for k, x in case["variants"].items()}
  forward = case["way"] == "matmul_forward"
  nccl, split = (v.get("xla+cublas"), v.get("kernel+cublas")) if forward else (
      v.get("cublas+xla"), v.get("cublas+kernel"))
  timed = [(ms, k) for k, ms in v.items() if (k == "fused" or k.startswith("fused[")) and ms]
  fused, label = min(timed) if timed else (None, "")
  chained = case["variants"].get("fused x8", {}).get("ok", "–")
  return [name.removesuffix(".json"), f"{d['gpus']}x {d['device']}", case["model"],
          case["way"].removeprefix("matmul_") + label.removeprefix("fused"),
          "x".join(map(str, case["shape"])), nccl, split, fused, v.get("cublas"),
          split / fused if split and fused else None,
          fused / v["cublas"] if fused and v.get("cublas") else None, chained]


def _spec_of(variant: str) -> dict:
  """``{"sms": 132, "depth": 2, "rows": 64}`` of ``pull[sms=132+depth=2+rows=64]``."""
  return spec_fields(variant[variant.index("[") + 1:variant.rindex("]")])


def readme_text(old: str) -> str:
  body = "\n".join(s for s in (codec_section(), collectives_section(), transport_section(),
                                fused_decode_section(), collective_matmul_section(),
                                peer_copy_section(), exchange_section(),
                                train_section(),
                                bench_train_section(), profile_section(),
                                accuracy_section(), dp_codec_section(),
                                trainer_cpu_section()) if s)
  head, _, rest = old.partition(BEGIN)
  _, _, tail = rest.partition(END)
  return (f"{head}{BEGIN}\n<!-- generated by `python -m benchmarks.report`; do not edit -->\n\n"
          f"{body}\n{END}{tail}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--check", action="store_true", help="fail if an output is stale")
  args = ap.parse_args(argv)
  stale = []
  for path, new in [(README, readme_text(README.read_text())), (MEASURED, measured_module())]:
    old = path.read_text() if path.exists() else ""
    if old != new:
      stale.append(path.name)
      if not args.check:
        path.write_text(new)
  if args.check and stale:
    print(f"stale: {', '.join(stale)}; run python -m benchmarks.report", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
