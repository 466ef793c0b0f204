"""Where a training step's time goes: a device trace of bench_train's variants, summarized.

For each variant (as in bench_train: off, on, ring_off, gspmd, ...) of one layout this
compiles the step, runs --warmup steps, then traces --steps steps (at most 3) with
`jax.profiler`, each dispatched before the last one completes, as the trainer and
bench_train's timing run them (traces before 2026-11-28 waited for each step, so they held
no time the host keeps the device waiting), and writes:

  profile_step_<label>_<devices><platform>_<date>.json   (--out-dir, else
      benchmarks/results) per variant and device: busy ms per step by kernel family (nccl,
      gemm, fusion, other), the NCCL time no compute kernel of that device overlapped, and
      the time the device ran nothing from its first kernel (not a copy) to its last; per
      variant (``clocks``) the GPUs' SM clocks and power while its steps were traced
      (``nvml.ClockSampler``; none off a GPU)
  hlo_<label>_<variant>.txt.gz     the optimized, scheduled HLO of the step  } --out-dir,
  trace_<label>_<variant>.json.gz  the Perfetto trace (when under 15 MiB)    } else a tmp dir

A trace's kernel times are CUPTI's: with kernels dispatched back to back they can overlap
one another by 10-15% on the GPU's own timeline (docs/measurements.md, "What slows them"),
so compare kernels across traces by more than a few percent only; a step's time is the
host's (bench_train).

GPU (4xH200): python benchmarks/profile_step.py --variants off,gspmd --out-dir $OUT
CPU smoke:    python benchmarks/profile_step.py --smoke
Again:        python benchmarks/profile_step.py --resummarize RESULT.json   (its variants
              summarized anew from the traces kept in traces/ beside it)
"""
from __future__ import annotations

import collections
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import bench_train, nvml  # noqa: E402 (no JAX import)
from benchmarks.train_parallel import model_and_optimizer  # noqa: E402


def family(name: str) -> str:
  n = name.lower()
  if n.startswith(("memcpy", "memset")):
    return "copy"
  if "nccl" in n:
    return "nccl"
  if any(k in n for k in ("gemm", "cublas", "cutlass", "sm90_xmma", "nvjet", "matmul")):
    return "gemm"
  if "fusion" in n or "triton" in n or "loop_" in n or "input_" in n:
    return "fusion"
  return "other"


def _merge(intervals):
  out = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return out


def _covered(intervals, cover) -> float:
  """Length of `intervals` (merged) inside the union `cover` (merged)."""
  total, j = 0.0, 0
  for a, b in intervals:
    while j < len(cover) and cover[j][1] <= a:
      j += 1
    k = j
    while k < len(cover) and cover[k][0] < b:
      total += min(b, cover[k][1]) - max(a, cover[k][0])
      k += 1
  return total


def kernel_name(name: str) -> str:
  """A kernel's name without XLA's numbering of fusions (``loop_add_fusion_12``) or
  Mosaic GPU's of kernels, so that the calls of one kind add up."""
  return re.sub(r"([._]\d+)+$", "", name)


CALL_BUCKET_US = 5  # the width of ``call_us``'s buckets


def summarize_trace(events: list[dict], steps: int, top: int = 24, calls: int = 4) -> dict:
  """Per device (a trace process whose name mentions a device): ms per step by kernel
  family, NCCL ms per step not overlapped by any compute kernel of that device, ms per step
  the device ran nothing (``idle_ms``: from its first kernel, not copy, to its last, so
  without the first step's start, where XLA copies each collective kernel's table of peer
  addresses while the host prepares the step), the ``top`` kernels by ms per step
  (``kernel_name``: fusions of one kind together), and for the first ``calls`` of them and
  every GEMM among them how long their calls took (``call_us``: calls per step by duration,
  in buckets of ``CALL_BUCKET_US`` named by their lower bound; whether one kind's calls all
  take the same time, as in a kernel benchmark, or some take much longer), and the same
  for the calls of each pass (``call_us_passes``, where ``pass_bounds`` finds the passes),
  else for the first and the second half of each step's calls (``call_us_halves``: for a
  kernel called alike in both passes, each layer's forward calls come before its
  backward's, so the halves are the forward and the backward pass; a kernel called in one
  pass only, as cuBLAS's are, each layout of operands a kernel of its own, needs the
  passes). ``beside_nccl``: for each timed kernel some of whose calls ran beside one of
  NCCL's collective kernels (not the barriers XLA runs before a peer kernel, on its
  stream), those calls per step and their mean length against the others' (an NCCL kernel
  takes SMs and link from a kernel it runs beside)."""
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  per_dev = collections.defaultdict(lambda: collections.defaultdict(list))
  durations = collections.defaultdict(lambda: collections.defaultdict(list))
  collectives = collections.defaultdict(list)  # NCCL's collective kernels, not its barriers
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    dev = names.get(e["pid"], "")
    if "GPU" not in dev and "/device:" not in dev:
      continue
    per_dev[dev][family(e["name"])].append((e["ts"], e["ts"] + e["dur"]))
    durations[dev][kernel_name(e["name"])].append((e["ts"], e["dur"]))
    if e["name"].lower().startswith("nccl"):
      collectives[dev].append((e["ts"], e["ts"] + e["dur"]))
  out = {}
  for dev, fams in sorted(per_dev.items()):
    kernels = collections.Counter({k: sum(d for _, d in v) for k, v in durations[dev].items()})
    timed = [k for i, (k, _) in enumerate(kernels.most_common(top))
             if i < calls or family(k) == "gemm"]
    compute = _merge([i for f in ("gemm", "fusion", "other", "copy") for i in fams.get(f, [])])
    nccl = _merge(fams.get("nccl", []))
    busy = {f: sum(b - a for a, b in _merge(v)) / 1e3 / steps for f, v in fams.items()}
    nccl_ms = sum(b - a for a, b in nccl) / 1e3 / steps
    hidden = _covered(nccl, compute) / 1e3 / steps
    everything = _merge([i for v in fams.values() for i in v])
    start = min((a for f, v in fams.items() for a, _ in v if f != "copy"),
                default=everything[0][0])
    everything = [[max(a, start), b] for a, b in everything if b > start]
    span = everything[-1][1] - everything[0][0]
    out[dev] = dict(busy_ms=busy, nccl_ms=nccl_ms, nccl_exposed_ms=nccl_ms - hidden,
                    compute_ms=sum(b - a for a, b in compute) / 1e3 / steps,
                    idle_ms=(span - sum(b - a for a, b in everything)) / 1e3 / steps,
                    top_kernels_ms={k: us / 1e3 / steps
                                    for k, us in kernels.most_common(top)},
                    call_us={k: _buckets([d for _, d in durations[dev][k]], steps)
                             for k in timed})
    beside = {k: _beside(durations[dev][k], _merge(collectives[dev]), steps) for k in timed
              if family(k) != "nccl"}
    out[dev]["beside_nccl"] = {k: v for k, v in beside.items() if v["calls"]}
    bounds = pass_bounds(fams.get("gemm", []), steps)
    if bounds:
      out[dev]["call_us_passes"] = {k: _by_pass(durations[dev][k], bounds, steps)
                                    for k in timed}
    else:
      out[dev]["call_us_halves"] = {k: _halves(durations[dev][k], steps) for k in timed}
  return out


def _beside(calls: list[tuple[float, float]], cover, steps: int) -> dict:
  """{calls: those per step that overlap `cover` (merged intervals), us: their mean length,
  alone_us: the other calls' mean length} of (start, duration) calls."""
  split = {True: [], False: []}
  for t, d in calls:
    split[_covered([[t, t + d]], cover) > 0].append(d)
  mean = lambda ds: sum(ds) / len(ds) if ds else None  # noqa: E731
  return dict(calls=len(split[True]) / steps, us=mean(split[True]), alone_us=mean(split[False]))


HEAD_FACTOR = 4  # a GEMM call this many times the median one is the head's (vocabulary)


def pass_bounds(gemms: list[tuple[float, float]], steps: int) -> list[tuple[float, float]]:
  """Each step's (backward start, backward end) from its GEMM calls (start, end), or []
  where they do not show ``steps`` steps. The head's GEMMs, ``HEAD_FACTOR`` times the median
  call or longer, come in one group a step: the forward pass ends where the group begins.
  The backward pass ends where the longest stretch without a GEMM after it begins (the
  optimizer's update), or with the trace."""
  if not gemms:
    return []
  gemms = sorted(gemms)
  lengths = sorted(b - a for a, b in gemms)
  long_calls = [a for a, b in gemms if b - a >= HEAD_FACTOR * lengths[len(lengths) // 2]]
  span = gemms[-1][1] - gemms[0][0]
  heads = [t for i, t in enumerate(long_calls)
           if i == 0 or t - long_calls[i - 1] > span / steps / 2]
  if len(heads) != steps:
    return []
  bounds = []
  for i, head in enumerate(heads):
    until = heads[i + 1] if i + 1 < len(heads) else None
    inside = [g for g in gemms if g[0] >= head and (until is None or g[0] < until)]
    gaps = [(inside[j + 1][0] - inside[j][1], inside[j][1]) for j in range(len(inside) - 1)]
    end = max(gaps)[1] if until is not None and gaps else inside[-1][1]
    bounds.append((head, end))
  return bounds


def _by_pass(calls: list[tuple[float, float]], bounds, steps: int) -> dict:
  """``_buckets`` of the calls (start, duration) in the forward and in the backward pass
  (``pass_bounds``: a call in the backward if it starts inside a step's bounds, else in the
  forward)."""
  forward, backward = [], []
  for t, d in calls:
    (backward if any(a <= t < b for a, b in bounds) else forward).append(d)
  return {"forward": _buckets(forward, steps), "backward": _buckets(backward, steps)}


def _buckets(durations_us: list[float], steps: int) -> dict[int, float]:
  """Calls per step by duration, in buckets of ``CALL_BUCKET_US`` (by lower bound)."""
  count = collections.Counter(int(d // CALL_BUCKET_US) * CALL_BUCKET_US for d in durations_us)
  return {b: n / steps for b, n in sorted(count.items())}


def _halves(calls: list[tuple[float, float]], steps: int) -> list[dict[int, float]]:
  """``_buckets`` of the first and of the second half of each step's calls, the calls
  (start, duration) taken in time order, ``steps`` equal runs of them (any left over
  ignored)."""
  durations = [d for _, d in sorted(calls)]
  per_step = len(durations) // steps
  half = per_step // 2
  runs = [durations[i * per_step:(i + 1) * per_step] for i in range(steps)]
  return [_buckets([d for run in runs for d in run[:half]], steps),
          _buckets([d for run in runs for d in run[half:]], steps)]


TRACES = "traces"  # where a result's traces are kept, beside it, for --resummarize


def resummarize(result: pathlib.Path) -> pathlib.Path:
  """Rewrites a run's variant summaries from its traces (``TRACES/trace_<label>_<variant>
  .json.gz`` beside it), with today's ``summarize_trace``: what was added to the summary
  since the run (``call_us_passes``, ...) for the run's own steps."""
  report = json.loads(result.read_text())
  for variant in report["variants"]:
    trace = result.parent / TRACES / f"trace_{report['label']}_{variant}.json.gz"
    if not trace.exists():
      raise FileNotFoundError(f"{result.name}: no trace of {variant} at {trace}")
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    report["variants"][variant] = summarize_trace(events, report["traced_steps"])
  report["resummarized_from"] = f"{TRACES}/trace_{report['label']}_*.json.gz"
  result.write_text(json.dumps(report, indent=1))
  return result


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--resummarize"]:
    if len(argv) != 2:
      raise SystemExit("usage: profile_step.py --resummarize RESULT.json")
    print(f"wrote {resummarize(pathlib.Path(argv[1]))}")
    return
  args = bench_train.parse_args(argv)
  if note := bench_train.link_note(args):
    print(note, flush=True)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  bench_train.add_overlap_flags(args)
  import jax
  from benchmarks import common
  from benchmarks.args import results_path
  from taco_jax import data

  cfg, tx = model_and_optimizer(args, remat=not args.no_remat)
  layout = tuple(int(v) for v in args.layouts.split(";")[0].split(","))
  corpus = data.load_corpus("", cache_dir=tempfile.gettempdir(),
                            max_corpus_bytes=8_000_000).train
  args._tokens0 = data.batch_at(corpus, 0, seed=0, batch_size=args.batch, seq_len=args.seq)
  out_dir = pathlib.Path(args.out_dir or tempfile.mkdtemp())  # HLO and traces
  gpus = nvml.gpus() if jax.default_backend() == "gpu" else []
  out_dir.mkdir(parents=True, exist_ok=True)
  trace_steps = min(args.steps, 3)
  report = dict(benchmark="profile_step", label=args.label, layout=args.layouts.split(";")[0],
                device=jax.devices()[0].device_kind, num_devices=jax.device_count(),
                config={k: v for k, v in vars(args).items() if not k.startswith("_")},
                traced_steps=trace_steps, dispatch="back to back",
                idle_from="first kernel", variants={}, clocks={})
  for variant in args._variants:
    v = variant.name
    exe, state, batch, *_ = bench_train.build(variant, layout, args, cfg, tx)
    common.write_hlo(exe, out_dir / f"hlo_{args.label}_{v}.txt.gz")
    b = batch(args._tokens0)
    for _ in range(args.warmup):
      *state, met = exe(*state, b)
      jax.block_until_ready(met)
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir, create_perfetto_trace=True), \
          nvml.ClockSampler(gpus) as clocks:
        for _ in range(trace_steps):
          *state, met = exe(*state, b)
        jax.block_until_ready(met)
      report["clocks"][v] = clocks.summary()
      del exe, state
      path, = pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz")
      trace_gz = path.read_bytes()
    events = json.loads(gzip.decompress(trace_gz))
    events = events["traceEvents"] if isinstance(events, dict) else events
    report["variants"][v] = summarize_trace(events, trace_steps)
    if len(trace_gz) < 15 << 20:
      (out_dir / f"trace_{args.label}_{v}.json.gz").write_bytes(trace_gz)
    print(v, json.dumps(report["variants"][v], indent=1)[:3000], flush=True)
  env = common.environment()
  report["environment"] = env
  dest = results_path("profile_step", args, num_devices=jax.device_count(),
                      platform=env["platform"], date=env["date"])
  dest.write_text(json.dumps(report, indent=1))
  print(f"wrote {dest}")


if __name__ == "__main__":
  main()
