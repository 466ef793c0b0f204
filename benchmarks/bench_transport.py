"""Transport probe: how fast the bare collectives move a TP message, by element type and
NCCL setting.

On NVLink a compressed all-gather of the 1.3B model's activations is ~1.2x faster than
the bf16 one, and so is a bare fp8 cast (``bench_collectives``' raw_fp8), although it moves
half the bytes. This separates the transport from the codec: at the message sizes of
``bench_train``'s 1.3B TP=4 step it times, with no encode or decode,

* the plain path: ``all_gather`` and ``psum_scatter`` of bf16 ``[R, D]`` rows;
* the wire path: ``all_gather`` and ``all_to_all`` of the same rows' wire bytes
  (``D + 8 D / G`` per row, as ``taco_jax.codec.to_wire`` makes them), sent as u8, and
  as the same bytes reinterpreted as bf16 and as u32 (NCCL moves bytes either way; this
  finds out whether the element type changes what XLA or NCCL does);

once per ``--settings`` entry (environment assignments such as ``NCCL_PROTO=Simple`` or
``XLA_FLAGS=...``), each in a fresh process because NCCL reads its environment once.

GPU:  python benchmarks/bench_transport.py --label nvlink
CPU smoke test (8 fake devices):  python benchmarks/bench_transport.py --smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import add_output_args, parse_with_smoke, write_report  # noqa: E402

DEFAULT_SETTINGS = ("default;NCCL_PROTO=Simple;NCCL_PROTO=LL128;NCCL_MIN_NCHANNELS=32;"
                    "XLA_FLAGS=--xla_gpu_enable_nccl_user_buffers=true")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=int, default=8 * 2048 // 4,
                 help="rows per device (1.3B TP=4: batch 8 x seq 2048 / 4)")
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--group-size", type=int, default=128)
  p.add_argument("--settings", default=DEFAULT_SETTINGS,
                 help="';'-separated; each is 'default' or space-separated VAR=value")
  p.add_argument("--samples", type=int, default=20)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  add_output_args(p, label="default", smoke="CPU, 8 fake devices, tiny messages")
  return parse_with_smoke(p, argv, dict(rows=64, hidden=256, settings="default", samples=3,
                                        label="smoke"))


def setting_env(setting: str) -> dict:
  """'NCCL_PROTO=Simple XLA_FLAGS=--a=1' -> {'NCCL_PROTO': 'Simple', ...}; 'default' -> {}."""
  if setting.strip() == "default":
    return {}
  env = {}
  for item in shlex.split(setting):
    name, sep, value = item.partition("=")
    if not sep or not name.isidentifier():
      raise ValueError(f"--settings: {item!r} is not VAR=value")
    env[name] = value
  return env


def permute_all_to_all(x, axis_name: str):
  """``all_to_all(x, 0, 0)`` of ``[n, ...]`` blocks as n - 1 point-to-point sends (at shift
  s, block r + s goes to rank r + s): the same bytes through NCCL's send/receive pairs one
  peer at a time, where its all-to-all posts them all at once. At two ranks it measured as
  the all-to-all, through host memory and through sockets (2xH200, 2026-11-24)."""
  import jax
  import jax.numpy as jnp
  n, r = x.shape[0], jax.lax.axis_index(axis_name)
  got = [x[r]]  # got[s]: the block rank r - s sent here
  for s in range(1, n):
    block = jax.lax.dynamic_index_in_dim(x, (r + s) % n, keepdims=False)
    got.append(jax.lax.ppermute(block, axis_name, [(i, (i + s) % n) for i in range(n)]))
  return jnp.stack(got)[(r - jnp.arange(n)) % n]


def measure(args) -> list[dict]:
  """Times every transport in this process's environment; one row per (op, payload)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks import common
  from taco_jax.pallas_kernels import wire

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  rows, d = args.rows // n * n, args.hidden
  wire_bytes = wire.width(d, args.group_size)  # u8 codes, then an fp32 pair per group
  if wire_bytes % 4:
    raise ValueError(f"wire row of {wire_bytes} bytes does not split into u32 words")
  payloads = {"bf16": (jnp.bfloat16, d), "wire_u8": (jnp.uint8, wire_bytes),
              "wire_as_bf16": (jnp.bfloat16, wire_bytes // 2),
              "wire_as_u32": (jnp.uint32, wire_bytes // 4)}
  ops = {
      "all_gather": lambda x: jax.lax.all_gather(x, "x", axis=0, tiled=False),
      "all_to_all": lambda x: jax.lax.all_to_all(x.reshape(n, -1, x.shape[-1]), "x", 0, 0,
                                                 tiled=True),
      "psum_scatter": lambda x: jax.lax.psum_scatter(x.reshape(n, -1, x.shape[-1]), "x",
                                                     scatter_dimension=0, tiled=True),
      "permute_all_to_all": lambda x: permute_all_to_all(x.reshape(n, -1, x.shape[-1]), "x"),
  }
  # What the TP layers send: plain = all-gather + reduce-scatter of bf16; compressed =
  # all-gather + all-to-all of wire rows. The all-to-all input is the reduce-scatter's.
  plan = [("all_gather", p) for p in payloads] + [("psum_scatter", "bf16")] + [
      ("all_to_all", p) for p in payloads if p != "bf16"] + [("permute_all_to_all", "wire_u8")]
  out = []
  for op, name in plan:
    dtype, width = payloads[name]
    scatter_input = op != "all_gather"  # [n * rows] per device, as a reduce-scatter's input
    local_rows = rows * n if scatter_input else rows
    x = jax.device_put(jnp.zeros((n * local_rows, width), dtype), NamedSharding(mesh, P("x")))
    fn = jax.jit(jax.shard_map(ops[op], mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                               check_vma=False))
    t = common.time_fn(fn, x, samples=args.samples)
    nbytes = local_rows * width * jnp.dtype(dtype).itemsize
    # what each device receives: every peer's shard (all-gather), or the (n - 1) / n of its
    # input that the peers hold (the scatters). Files with GBps_per_device instead (up to
    # 2026-11-24) counted (n - 1) / n of the input for every op: half the all-gather's rate
    # at n = 2.
    received = nbytes * (n - 1) / (1 if op == "all_gather" else n)
    out.append(dict(op=op, payload=name, bytes_per_device=nbytes, median_ms=t.median_s * 1e3,
                    min_ms=t.min_s * 1e3, max_ms=t.max_s * 1e3, inner=t.inner,
                    received_GBps_per_device=received / t.median_s / 1e9))
  return out


def run(args) -> dict:
  """Runs ``measure`` once per setting, each in a child process with that environment."""
  results, meta = [], {}
  for setting in args.settings.split(";"):
    env = {**os.environ, **setting_env(setting)}
    cmd = [sys.executable, __file__, "--child", "--rows", str(args.rows), "--hidden",
           str(args.hidden), "--group-size", str(args.group_size), "--samples",
           str(args.samples)] + (["--smoke"] if args.smoke else [])
    print(f"setting {setting!r} ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
      sys.stderr.write(proc.stderr[-4000:])
      results.append(dict(setting=setting, error=proc.stderr.strip().splitlines()[-1:]))
      continue
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    results += [dict(setting=setting, **r) for r in child["rows"]]
    meta = child["meta"]
  return dict(benchmark="bench_transport", label=args.label, **meta,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              config={k: v for k, v in vars(args).items() if k != "child"}, results=results)


def table(report: dict) -> str:
  lines = [f"{report['label']}: {report['num_devices']}x {report['device']}, "
           f"rows/device {report['config']['rows']}, hidden {report['config']['hidden']}",
           f"{'setting':48s} {'op':13s} {'payload':13s} {'MiB/dev':>8s} {'ms':>8s} "
           f"{'recv GB/s':>9s}"]
  for r in report["results"]:
    if "error" in r:
      lines.append(f"{r['setting'][:48]:48s} failed: {r['error']}")
      continue
    lines.append(f"{r['setting'][:48]:48s} {r['op']:13s} {r['payload']:13s} "
                 f"{r['bytes_per_device'] / 2**20:8.2f} {r['median_ms']:8.4f} "
                 f"{r['received_GBps_per_device']:9.1f}")
  return "\n".join(lines)


def main(argv=None):
  args = parse_args(argv)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  if args.child:
    import jax
    rows = measure(args)
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, platform=dev.platform, num_devices=jax.device_count(),
                jax_version=jax.__version__)
    print(json.dumps(dict(meta=meta, rows=rows)))
    return None
  report = run(args)
  if "device" not in report:
    raise SystemExit("every setting failed; see the errors above")
  return write_report("transport", args, report, table(report))


if __name__ == "__main__":
  main()
