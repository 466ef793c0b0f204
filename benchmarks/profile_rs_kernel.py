"""Where the matmul + reduce-scatter kernel's time goes, seen from inside it.

Mosaic GPU's on-device profiler (``gemm.profiling``) records, for every warpgroup of every
SM, when each named region of the kernel begins and ends: ``mma`` (a tile's pipelined
matmul), ``epilogue``, and inside or between them the waits: ``wait_read`` (a read of a
peer's partials landing), ``wait_peers`` (the peers' partials of a phase written),
``signal`` (a sent loop's stores landed and counted), ``release`` (the peers done reading
this rank's outbox). It found the per-warpgroup signals that held the kernel (see
``matmul_rs``). The profiled kernel runs about twice as long as the unprofiled one: read
its regions as proportions. This runs the kernels of the 1.3B layers at TP = the
local GPU count, plain and FP8, and writes per device and region the mean time per compute
warpgroup (and of its first occurrence), beside the kernel's span and its unprofiled device
time in the same process; and the raw traces (Perfetto / chrome://tracing), in one
``rs_traces_<model>.tar.gz``.

GPU: ``python3 -m benchmarks.profile_rs_kernel --out-dir $OUT`` (2 or more GPUs).
"""
from __future__ import annotations

import argparse
import builtins
import collections
import contextlib
import datetime
import itertools
import json
import os
import pathlib
import sys
import tarfile
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
  warpgroup (those that ran ``mma``), the mean count and the mean time of its first
  occurrence (the first loop's wait, say); ``other``: a compute warpgroup's span outside its
  top-level regions."""
  tracks = collections.defaultdict(list)
  for e in trace["traceEvents"]:
    tracks[(e["pid"], e["tid"])].append(e)
  totals, firsts = collections.defaultdict(float), collections.defaultdict(float)
  counts = collections.Counter()
  first, last, compute = float("inf"), float("-inf"), 0
  for events in tracks.values():
    first = min(first, events[0]["ts"])
    last = max(last, events[-1]["ts"])
    if not any(e["name"] == "mma" for e in events):
      continue
    compute += 1
    stack, top, seen = [], 0.0, set()
    for e in events:
      if e["ph"] == "B":
        stack.append(e)
        continue
      begin = stack.pop()
      totals[begin["name"]] += e["ts"] - begin["ts"]
      counts[begin["name"]] += 1
      if begin["name"] not in seen:
        seen.add(begin["name"])
        firsts[begin["name"]] += e["ts"] - begin["ts"]
      if not stack:
        top += e["ts"] - begin["ts"]
    totals["other"] += events[-1]["ts"] - events[0]["ts"] - top
  compute = max(compute, 1)
  return dict(span_us=last - first, compute_warpgroups=compute,
              regions={k: dict(mean_us=v / compute, mean_count=counts[k] / compute,
                               first_mean_us=firsts[k] / compute)
                       for k, v in sorted(totals.items())})


@contextlib.contextmanager
def trace_per_device():
  """Mosaic GPU's profiler names a call's trace once, when the kernel is lowered, so the
  devices of one call race for one file and all but the first only warn (jax 0.11.2's
  ``pallas_call_registration.dump_profile``, which opens it with mode "x"). Inside, that
  module's ``open`` takes the next free ``-dev<i>`` name instead: a trace per device."""
  from jax._src.pallas.mosaic_gpu import pallas_call_registration as registration

  def open_free(path, mode="r", *args, **kwargs):
    for i in itertools.count() if mode == "x" else [0]:
      name = path if i == 0 else path.replace("-trace.json", f"-dev{i}-trace.json")
      try:
        return builtins.open(name, mode, *args, **kwargs)
      except FileExistsError:
        continue
  registration.open = open_free
  try:
    yield
  finally:
    del registration.open


def _traced_call(fn, args, trace_dir: pathlib.Path, calls: int = 3) -> list[pathlib.Path]:
  """Runs ``fn`` ``calls`` times and returns the last call's traces, one per device (in no
  known order of devices): caches and clocks are warm by then. Each call's traces are moved
  aside, into a folder of their own, before the next, as the profiler writes none where its
  file exists. (Until 2026-11-27 they were renamed in place, where the next call's glob
  found them again: the reports of that day and before hold every call's traces.)"""
  import jax
  kept = []
  with trace_per_device():
    for i in range(calls):
      jax.block_until_ready(fn(*args))
      (trace_dir / f"call{i}").mkdir()
      kept = [f.rename(trace_dir / f"call{i}" / f.name)
              for f in sorted(trace_dir.glob("*-trace.json"))]
  if not kept:
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
  kept = []  # (name, path) of every trace, into one archive (the device tool returns 8 files)
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
        traces = _traced_call(jax.jit(smap(fn)), (y, w), trace_dir)
      case["traced"] = [summarize(json.loads(t.read_text())) for t in traces]
      kept += [(f"rs_trace_{args.model}_{layer}_{name}_{i}.json", t)
               for i, t in enumerate(traces)]
      report["cases"][f"{layer}/{name}"] = case
      for i, traced in enumerate(case["traced"]):
        print(f"{layer} {name} trace {i}: unprofiled {case['unprofiled']['ms']:.3f} ms | "
              f"traced span {traced['span_us']:.0f} us | " + " ".join(
                  f"{k} {v['mean_us']:.0f} (first {v['first_mean_us']:.0f})"
                  for k, v in traced["regions"].items()), flush=True)
  with tarfile.open(out_dir / f"rs_traces_{args.model}.tar.gz", "w:gz") as tar:
    for name, path in kept:
      tar.add(path, arcname=name)
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
