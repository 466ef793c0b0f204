"""Collective speedup: plain bf16 vs raw FP8 payload vs TACO-compressed, 1-256 MiB/device.

For each per-device message size (bf16 bytes of each device's input), on a 1-D mesh over
all local devices, times three variants of all-gather, reduce-scatter and all-reduce, each
jitted in its own ``shard_map``, interleaved, on the same random input (N(0,1) times a
log-normal scale per row):

* ``bf16``:       the plain ``jax.lax`` collective (``compression=None``).
* ``raw_fp8``:    a bare clip+cast to e4m3, moved as u8, cast back: no scales, no codec.
                  The bound for a free codec.
* ``compressed``: ``taco_jax.collectives`` with a ``CompressionConfig``: compress,
                  communicate (codes as u8 + fp32 scales) and decompress all included.

Timing: each program runs the collective ``--inner`` times in a ``lax.fori_loop`` (each
iteration's input depends on the previous output through one element, so nothing is
hoisted or deleted); host wall-clock around ``block_until_ready`` of one such call,
divided by ``--inner``; median over ``--iters`` interleaved repetitions after warm-up.
The whole SPMD program is timed, so no max over devices is needed. Bus bandwidth uses
NCCL's conventions on the *bf16* bytes (so compressed variants show effective bandwidth).
Ceilings measured in the same run with ``benchmarks/common.py``: device copy bandwidth and
bf16 matmul rate (the plain bf16 collective is the third ceiling).

GPU (the lead's runs; NVLink multicast is always off, see NCCL_NVLS_ENABLE below):
  python benchmarks/bench_collectives.py --label nvlink
  NCCL_P2P_DISABLE=1 python benchmarks/bench_collectives.py --label p2p_disabled
CPU smoke test (8 fake devices, < 1 minute):
  python benchmarks/bench_collectives.py --smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import add_output_args, parse_with_smoke, write_report  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes-mib", default="1,2,4,8,16,32,64,128,256",
                 help="comma-separated per-device message sizes in MiB (bf16 input bytes)")
  p.add_argument("--collectives", default="all_gather,reduce_scatter,all_reduce")
  p.add_argument("--iters", type=int, default=25, help="timed repetitions (median; >= 20)")
  p.add_argument("--inner", type=int, default=0,
                 help="collectives per timed call; 0 = enough for ~20 ms per call")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--hidden", type=int, default=4096, help="last dim (groups run along it)")
  p.add_argument("--format", default="e4m3", choices=["e4m3", "e5m2"])
  p.add_argument("--group-size", type=int, default=128)
  p.add_argument("--hadamard", action=argparse.BooleanOptionalAction, default=False,
                 help="Walsh-Hadamard transform in the codec (off: the measured better default)")
  p.add_argument("--implementation", default="auto", choices=["auto", "pallas", "xla"])
  p.add_argument("--algorithm", default="two_shot", choices=["one_shot", "two_shot"])
  add_output_args(p, label="default", smoke="CPU, 8 fake devices, tiny sizes")
  args = parse_with_smoke(p, argv, dict(sizes_mib="0.0625,0.25", iters=3, inner=2, warmup=1,
                                        hidden=512, label="smoke"))
  args.warmup = max(args.warmup, 1)
  return args


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks import common  # ceilings and environment (timing here is interleaved)
  from benchmarks import report as report_lib  # the threshold rule
  from taco_jax import CompressionConfig
  from taco_jax import collectives as tc

  devices = jax.devices()
  n = len(devices)
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  cfg = CompressionConfig(format=args.format, group_size=args.group_size,  # every size
                          hadamard=args.hadamard, implementation=args.implementation, link=None)
  fp8, fmax = cfg.fp8_dtype, {"e4m3": 448.0, "e5m2": 57344.0}[args.format]
  d = args.hidden

  def to_u8(a):
    return jax.lax.bitcast_convert_type(jnp.clip(a, -fmax, fmax).astype(fp8), jnp.uint8)

  def from_u8(u, dtype):
    return jax.lax.bitcast_convert_type(u, fp8).astype(dtype)

  def raw_rs(x, out_dtype):  # all-to-all fp8 chunks, sum in fp32
    u = jax.lax.all_to_all(to_u8(x.reshape(n, -1, d)), "x", 0, 0, tiled=True)
    return from_u8(u, jnp.float32).sum(0).astype(out_dtype)

  def raw_ag(x):
    return from_u8(jax.lax.all_gather(to_u8(x), "x", tiled=True), x.dtype)

  def raw_ar(x):
    if args.algorithm == "one_shot":
      u = jax.lax.all_gather(to_u8(x), "x", tiled=False)
      return from_u8(u, jnp.float32).sum(0).astype(x.dtype)
    return raw_ag(raw_rs(x, jnp.float32)).astype(x.dtype)

  variants = {
      "all_gather": {
          "bf16": lambda x: tc.all_gather(x, "x"),
          "raw_fp8": raw_ag,
          "compressed": lambda x: tc.all_gather(x, "x", compression=cfg)},
      "reduce_scatter": {
          "bf16": lambda x: tc.reduce_scatter(x, "x"),
          "raw_fp8": lambda x: raw_rs(x, x.dtype),
          "compressed": lambda x: tc.reduce_scatter(x, "x", compression=cfg)},
      "all_reduce": {
          "bf16": lambda x: tc.all_reduce(x, "x"),
          "raw_fp8": raw_ar,
          "compressed": lambda x: tc.all_reduce(x, "x", compression=cfg,
                                                algorithm=args.algorithm)},
  }
  # NCCL bus-bandwidth conventions, on the bf16 bytes S of each device's input.
  algbw_bytes = {"all_gather": lambda s: n * s, "reduce_scatter": lambda s: s,
                 "all_reduce": lambda s: s}
  bus_factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                "all_reduce": 2 * (n - 1) / n}

  def program(coll):
    def body(x, inner):
      def step(_, carry):
        x, out = carry
        out = coll(x)
        flag = out.reshape(-1)[0]  # one element: a dependency, not a pass over x
        x = x.at[0, 0].set(jnp.where(flag == 12345.5, jnp.zeros_like(x[0, 0]), x[0, 0]))
        return x, out
      out0 = jax.eval_shape(coll, x)
      init = jnp.zeros(out0.shape, out0.dtype)
      return jax.lax.fori_loop(0, inner, step, (x, init))[1]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                 check_vma=False))

  @functools.partial(jax.jit, static_argnums=1, out_shardings=NamedSharding(mesh, P("x")))
  def make_input(key, shape):
    k1, k2 = jax.random.split(key)
    row_scale = jnp.exp(jax.random.normal(k2, shape[:-1] + (1,), jnp.float32))
    return (jax.random.normal(k1, shape, jnp.float32) * row_scale).astype(jnp.bfloat16)

  def time_call(f, x, inner):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x, inner))
    return (time.perf_counter() - t0) / int(inner)

  colls = [c for c in args.collectives.split(",") if c]
  sizes = [float(s) for s in args.sizes_mib.split(",")]
  results = []
  for size in sizes:
    rows = max(n, int(size * 2**20) // (2 * d) // n * n)
    s_bytes = rows * d * 2
    x = make_input(jax.random.key(0), (n * rows, d))
    for coll in colls:
      progs = {v: program(f) for v, f in variants[coll].items()}
      inner = args.inner
      for v, f in progs.items():  # compile + warm up
        for _ in range(args.warmup):
          t = time_call(f, x, jnp.int32(max(inner, 1)))
        if not args.inner:
          inner = max(inner, min(200, max(1, int(0.02 / max(t, 1e-6)))))
      times = {v: [] for v in progs}
      inner_arr = jnp.int32(max(inner, 1))
      for _ in range(args.iters):  # interleaved
        for v, f in progs.items():
          times[v].append(time_call(f, x, inner_arr))
      med = {v: statistics.median(ts) for v, ts in times.items()}
      for v in progs:
        algbw = algbw_bytes[coll](s_bytes) / med[v] / 1e9
        results.append(dict(
            collective=coll, size_mib=s_bytes / 2**20, variant=v, inner=int(inner_arr),
            median_ms=med[v] * 1e3, min_ms=min(times[v]) * 1e3, max_ms=max(times[v]) * 1e3,
            algbw_GBps=algbw, busbw_GBps=algbw * bus_factor[coll],
            speedup_vs_bf16=med["bf16"] / med[v], speedup_vs_raw_fp8=med["raw_fp8"] / med[v]))
      print(f"{coll:15s} {s_bytes / 2**20:8.3f} MiB  " + "  ".join(
          f"{v} {med[v] * 1e3:8.3f} ms" for v in progs), flush=True)
    del x

  small = args.smoke
  ceilings = dict(
      copy_one_device=common.copy_bandwidth(int(max(sizes) * 2**20), samples=3 if small else 20),
      matmul_bf16=common.matmul_rate(256 if small else 8192, samples=3 if small else 20))

  return dict(
      benchmark="bench_collectives", label=args.label, device=devices[0].device_kind,
      platform=devices[0].platform, num_devices=n, jax_version=jax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      timing="host wall-clock around block_until_ready of a jitted fori_loop of `inner` "
             "collectives, / inner; median of `iters` interleaved repetitions",
      env=common.run_env(),
      config=dict(vars(args), compression=dataclasses.asdict(cfg),
                  resolved_implementation=cfg.resolved_implementation()),
      environment=common.environment(), ceilings=ceilings, results=results,
      threshold_mib=report_lib.threshold_mib(results))


def table(report: dict) -> str:
  lines = [f"{report['label']}: {report['num_devices']}x {report['device']}, "
           f"jax {report['jax_version']}, {report['date']}",
           f"{'collective':15s} {'MiB/dev':>8s} {'bf16 ms':>9s} {'raw ms':>9s} {'comp ms':>9s} "
           f"{'bf16 bus':>9s} {'comp bus':>9s} {'vs bf16':>8s} {'vs raw':>7s}"]
  rows = {}
  for r in report["results"]:
    rows.setdefault((r["collective"], r["size_mib"]), {})[r["variant"]] = r
  for (coll, size), v in rows.items():
    b, w, c = v["bf16"], v["raw_fp8"], v["compressed"]
    lines.append(f"{coll:15s} {size:8.3f} {b['median_ms']:9.3f} {w['median_ms']:9.3f} "
                 f"{c['median_ms']:9.3f} {b['busbw_GBps']:9.2f} {c['busbw_GBps']:9.2f} "
                 f"{c['speedup_vs_bf16']:7.2f}x {c['speedup_vs_raw_fp8']:6.2f}x")
  c = report["ceilings"]
  lines.append(f"ceilings: device copy {c['copy_one_device']['gbps']:.1f} GB/s (read+write), "
               f"bf16 matmul {c['matmul_bf16']['tflops']:.1f} TFLOP/s")
  lines.append("threshold (smallest MiB/dev from which compressed beats bf16 at every "
               "larger size): " + ", ".join(f"{k}={v}" for k, v in
                                            report["threshold_mib"].items()))
  return "\n".join(lines)


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  report = run(args)
  return write_report("collectives", args, report, table(report))


if __name__ == "__main__":
  main()
