"""Where the matmul + reduce-scatter kernel's time goes, seen from inside it.

Mosaic GPU's on-device profiler (``gemm.profiling``) records, for every warpgroup of every
SM, when each named region of the kernel begins and ends: ``mma`` (a tile's pipelined
matmul), ``epilogue``, and inside or between them the waits: ``wait_read`` (a read of a
peer's partials landing), ``wait_peers`` (the peers' partials of a phase written),
``signal`` (a sent loop's stores landed and counted), ``release`` (the peers done reading
this rank's outbox). It found the per-warpgroup signals that held the kernel (see
``matmul_rs``). The profiled kernel runs about twice as long as the unprofiled one: read
its regions as proportions. This runs the kernels of the 1.3B layers at TP = the
local GPU count, plain and FP8, and writes per region the mean time per compute warpgroup
of one device, beside the kernel's span and its unprofiled device time in the same process;
and the raw traces (Perfetto / chrome://tracing).

GPU: ``python3 -m benchmarks.profile_rs_kernel --out-dir $OUT`` (2 or more GPUs).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import add_output_args, parse_with_smoke, results_path  # noqa: E402
from benchmarks.bench_collective_matmul import FP8, device_time_ms, layer_shapes  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="1.3b")
  p.add_argument("--layers", default="proj,down")
  p.add_argument("--iters", type=int, default=10)
  add_output_args(p, label="nvlink", smoke="not supported: the kernels need a GPU")
  return parse_with_smoke(p, argv, {})


def summarize(trace: dict) -> dict:
  """A Chrome trace of one kernel call (one device) as: its span (first begin to last end,
  us), the compute warpgroups' count, and per region the mean total time per compute
  warpgroup (those that ran ``mma``) and the mean count; ``other``: a compute warpgroup's
  span outside its top-level regions."""
  tracks = collections.defaultdict(list)
  for e in trace["traceEvents"]:
    tracks[(e["pid"], e["tid"])].append(e)
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  first, last, compute = float("inf"), float("-inf"), 0
  for events in tracks.values():
    first = min(first, events[0]["ts"])
    last = max(last, events[-1]["ts"])
    if not any(e["name"] == "mma" for e in events):
      continue
    compute += 1
    stack, top = [], 0.0
    for e in events:
      if e["ph"] == "B":
        stack.append(e)
        continue
      begin = stack.pop()
      totals[begin["name"]] += e["ts"] - begin["ts"]
      counts[begin["name"]] += 1
      if not stack:
        top += e["ts"] - begin["ts"]
    totals["other"] += events[-1]["ts"] - events[0]["ts"] - top
  compute = max(compute, 1)
  return dict(span_us=last - first, compute_warpgroups=compute,
              regions={k: dict(mean_us=v / compute, mean_count=counts[k] / compute)
                       for k, v in sorted(totals.items())})


def _traced_call(fn, args, trace_dir: pathlib.Path, calls: int = 3) -> pathlib.Path:
  """Runs ``fn`` ``calls`` times and returns the last call's trace: caches and clocks are
  warm by then. The profiler names a kernel's trace by the kernel, and writes none where
  that file exists: each call's is moved aside before the next (the devices of one call
  share the name, so one device's trace is kept)."""
  import jax
  kept = None
  for i in range(calls):
    jax.block_until_ready(fn(*args))
    for f in sorted(trace_dir.glob("*-trace.json")):
      kept = f.rename(trace_dir / f"call{i}-{f.name}")
  if kept is None:
    raise RuntimeError(f"the profiler wrote no trace to {trace_dir}")
  return kept


def run(args) -> dict:
  import functools
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from taco_jax.pallas_kernels import gemm, matmul_rs

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("t",))
  sms = gemm.num_sms()
  report = dict(benchmark="profile_rs_kernel", model=args.model, tp=n, num_sms=sms,
                devices=[d.device_kind for d in jax.devices()], cases={})
  out_dir = pathlib.Path(args.out_dir or ".")
  smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, None, "t"), P("t")),
                           out_specs=(P(None, "t"),), check_vma=False)
  for layer in args.layers.split(","):
    kind, y_shape, w_shape = layer_shapes(args.model, n, 8, 2048)[layer]
    if kind != "rs":
      raise SystemExit(f"{layer} is an all-gather layer: this profiles the reduce-scatter")
    ky, kw = jax.random.split(jax.random.key(0))
    y = jax.random.normal(ky, y_shape, jnp.bfloat16)
    w = jax.random.normal(kw, w_shape, jnp.bfloat16) * w_shape[0] ** -0.5
    y = jax.device_put(y, jax.NamedSharding(mesh, P(None, None, "t")))
    w = jax.device_put(w, jax.NamedSharding(mesh, P("t")))
    for name, fp8 in (("plain", None), ("fp8", FP8)):
      def fn(y, w, fp8=fp8):
        return (matmul_rs.matmul_reduce_scatter(y, w, "t", num_sms=sms, fp8=fp8),)
      case = dict(unprofiled=device_time_ms(jax.jit(smap(fn)), (y, w), args.iters, n))
      trace_dir = pathlib.Path(tempfile.mkdtemp())
      with gemm.profiling(str(trace_dir)):
        trace = _traced_call(jax.jit(smap(fn)), (y, w), trace_dir)
      case["traced"] = summarize(json.loads(trace.read_text()))
      shutil.copy(trace, out_dir / f"rs_trace_{args.model}_{layer}_{name}.json")
      report["cases"][f"{layer}/{name}"] = case
      print(f"{layer} {name}: unprofiled {case['unprofiled']['ms']:.3f} ms | traced span "
            f"{case['traced']['span_us']:.0f} us | " + " ".join(
                f"{k} {v['mean_us']:.0f}" for k, v in case["traced"]["regions"].items()),
            flush=True)
  return report


def main(argv=None):
  args = parse_args(argv)
  if args.smoke:
    raise SystemExit("profile_rs_kernel needs GPUs (the kernels do not run on CPU)")
  os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
  import jax
  report = run(args)
  report.update(num_devices=jax.device_count(), platform=jax.default_backend(),
                date=datetime.date.today().isoformat())
  path = results_path("profile_rs_kernel", args, num_devices=report["num_devices"],
                      platform="gpu", date=report["date"])
  path.write_text(json.dumps(report, indent=1))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
