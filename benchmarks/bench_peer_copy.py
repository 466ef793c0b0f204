"""The link's rate from inside a kernel: how fast ``pallas_kernels.peer_copy`` moves a TP
message between GPUs, by SMs, blocks in flight and direction, beside NCCL's.

The collective-matmul kernels reach 160-280 GB/s at TP=4 (issue 15). This measures what
copies alone reach on the same GPUs, at the kernels' message sizes: a ``--shard-mib`` shard
per rank, received by every rank from its next rank (``one``: a ring step) or from every
peer (``all``: an all-gather), pulled or pushed (``peer_copy``'s docstring), on ``--sms``
SMs with ``--depths`` blocks of ``--block-rows`` x ``--cols`` bf16 per SM in shared memory.
Beside them, in the same process on the same shards: XLA's ``all_gather`` and
``ppermute`` (NCCL, ``NCCL_NVLS_ENABLE=0``).

Every variant's result is first checked against the reference (bit for bit); one that fails
is reported, not timed. Times: CUPTI kernel durations, as ``bench_collective_matmul``
measures them (per kernel name the minimum over devices, summed; median of ``--iters``);
``gb_s``: the bytes one rank receives over the copy kernel's own time (``kernel_ms``, without
the cross-GPU barrier XLA runs before it).

GPU: ``python3 benchmarks/bench_peer_copy.py --out-dir $OUT`` (2 or more GPUs).
CPU (--smoke): the NCCL stand-ins and the checks' plumbing on fake devices; the copy kernel
needs a GPU (tests/test_collective_matmul.py runs its block loop on CPU).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import pathlib
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import (add_output_args, parse_with_smoke, run_on_devices,  # noqa: E402
                             write_results)
from benchmarks.bench_collective_matmul import timed_or_error  # noqa: E402

AXIS = "x"
MIB = 2 ** 20


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shard-mib", default="16", help="comma-separated shard sizes per rank")
  p.add_argument("--cols", type=int, default=256)
  p.add_argument("--modes", default="pull,push")
  p.add_argument("--peers", default="one,all", help="'one' (a ring step) and/or 'all'")
  p.add_argument("--sms", default="132,66,33", help="comma-separated SM counts")
  p.add_argument("--depths", default="2,4,6", help="comma-separated blocks per SM")
  p.add_argument("--block-rows", default="64", help="comma-separated rows per block")
  p.add_argument("--iters", type=int, default=20)
  add_output_args(p, label="nvlink", smoke="CPU: 8 fake devices, NCCL stand-ins only")
  return parse_with_smoke(p, argv, dict(shard_mib="1"))


def _listed(text: str, kind=str) -> list:
  return [kind(x) for x in text.split(",") if x]


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from taco_jax.pallas_kernels import peer_copy

  mesh, smap, results = one_group(AXIS)
  n, on_gpu = results["n"], results["platform"] == "gpu"
  results["cols"] = args.cols
  peers_list = [q for q in _listed(args.peers) if n > 2 or q == "all"]  # n = 2: one is all

  def expected(peers):  # each rank's dst, from every rank's shard gathered by XLA
    return jax.jit(smap(lambda shard: peer_copy.reference(
        lax.all_gather(shard, AXIS), lax.axis_index(AXIS), peers)))

  # NCCL on the same shards: all_gather receives every rank's shard (its own too, as
  # [n, R, C]), ppermute the next rank's, as the kernel's dst
  baselines = {
      "all": ("xla_all_gather", jax.jit(smap(lambda s: lax.all_gather(s, AXIS))),
              lambda shards: jnp.tile(jax.device_get(shards).reshape(n, -1, args.cols),
                                      (n, 1, 1))),
      "one": ("xla_ppermute", jax.jit(smap(lambda s: lax.ppermute(
          s, AXIS, [(i, (i - 1) % n) for i in range(n)])[None])), None)}

  for mib in _listed(args.shard_mib, int):
    rows = mib * MIB // (args.cols * 2)
    shards = jax.device_put(
        jax.random.normal(jax.random.key(mib), (n * rows, args.cols), jnp.bfloat16),
        NamedSharding(mesh, P(AXIS)))
    for peers in peers_list:
      case = dict(shard_mib=mib, peers=peers, n=n,
                  received_mib=mib * peer_copy.sources(n, peers), variants={})
      results["cases"].append(case)
      want = expected(peers)(shards)
      name, base, base_want = baselines[peers]
      variants = {name: base}
      for mode, sms, depth, block_rows in itertools.product(
          _listed(args.modes), _listed(args.sms, int), _listed(args.depths, int),
          _listed(args.block_rows, int)):
        kernel = functools.partial(peer_copy.peer_copy, axis_name=AXIS, n=n, mode=mode,
                                   peers=peers, block_rows=block_rows, depth=depth,
                                   num_sms=sms)
        variants[f"{mode}[sms={sms}+depth={depth}+rows={block_rows}]"] = jax.jit(smap(kernel))
      for name, fn in variants.items():
        if not on_gpu and name.startswith(("pull", "push")):
          case["variants"][name] = dict(skipped="the copy kernel runs on a GPU only")
          continue
        reference = base_want(shards) if name == "xla_all_gather" else want
        check = case["variants"][name] = checked_then_timed(fn, (shards,), reference,
                                                            args.iters, n, on_gpu)
        if "ms" in check:
          own = [ms for k, ms in check.get("kernels", {}).items()
                 if "peer_copy" in k or name.startswith("xla")]
          if own:
            check["kernel_ms"] = sum(own)
            check["gb_s"] = case["received_mib"] * MIB / (check["kernel_ms"] * 1e-3) / 1e9
        write_results("bench_peer_copy", args, results)
      print(_line(case), flush=True)
  return results


def one_group(axis: str):
  """All local devices as one group on mesh axis ``axis``: ``(mesh, smap, results)``, with
  ``smap(f)`` the shard_map of f over it (sharded along the first dimension, in and out) and
  ``results`` the JSON's head (devices, platform, SMs, NCCL_NVLS_ENABLE; no cases yet)."""
  import jax
  from jax.sharding import PartitionSpec as P
  from taco_jax.pallas_kernels import gemm
  devs = jax.devices()
  mesh = jax.make_mesh((len(devs),), (axis,), devices=devs)
  smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                           check_vma=False)
  return mesh, smap, dict(n=len(devs), gpus=len(devs), device=devs[0].device_kind,
                          platform=jax.default_backend(), num_sms=gemm.num_sms(),
                          nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), cases=[])


def checked_then_timed(fn, args, want, iters: int, n: int, on_gpu: bool,
                       rtol: float | None = None, repeats: int = 1) -> dict:
  """``{"ok": ...}`` of ``fn(*args)`` against ``want``, bit for bit (``repeats`` calls, the
  wrong ones counted in ``wrong_calls``: a race shows in some calls only), or with ``rtol``
  to within that ``max_rel_err`` (the largest difference over the largest ``|want|``),
  with the error where it raised (reported, not fatal); where right on a GPU, its device
  time too (`timed_or_error`: ``ms``, ``kernels``, or ``timing_error``)."""
  import jax.numpy as jnp
  check = {}
  try:
    got = fn(*args)
    if rtol is None:
      wrong = sum(not bool(jnp.array_equal(fn(*args) if i else got, want))
                  for i in range(repeats))
      check["ok"] = wrong == 0
      if repeats > 1:
        check.update(calls=repeats, wrong_calls=wrong)
    else:
      want32 = jnp.asarray(want, jnp.float32)
      err = jnp.max(jnp.abs(jnp.asarray(got, jnp.float32) - want32)) / jnp.max(jnp.abs(want32))
      check["max_rel_err"] = float(err)
      check["ok"] = check["max_rel_err"] <= rtol
  except Exception as e:  # noqa: BLE001 (reported, not timed)
    check.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
  if check["ok"] and on_gpu:
    check.update(timed_or_error(fn, args, iters, n))
  return check


def _line(case) -> str:
  best = sorted(((v["gb_s"], k) for k, v in case["variants"].items() if "gb_s" in v),
                reverse=True)[:3]
  return (f"{case['shard_mib']} MiB x {case['peers']}: "
          + ", ".join(f"{k} {g:.0f} GB/s" for g, k in best))


def main(argv=None):
  return run_on_devices("bench_peer_copy", parse_args(argv), run)


if __name__ == "__main__":
  main()
