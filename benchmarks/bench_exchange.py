"""``parallel.tp_exchange``'s all-to-all: our kernel (``pallas_kernels.exchange``) against
XLA's (NCCL, ``NCCL_NVLS_ENABLE=0``), at the attention's input of the GPT configs, both ways.

Per model (``--models``), on all local GPUs as one TP group, the exchange of the attention's
input ``[batch, seq, d_model / tp]`` (``forward``: rows to columns) and of its gradient
``[batch, seq / tp, d_model]`` (``backward``: back). Each variant's result is first checked
against ``lax.all_to_all`` bit for bit; one that fails is reported, not timed. Times: CUPTI
kernel durations as ``bench_collective_matmul`` measures them (median of ``--iters``), with
the cross-GPU barrier XLA runs before our kernel; ``gb_s``: the bytes a rank receives from
its peers over that time.

GPU: ``python3 benchmarks/bench_exchange.py --out-dir $OUT`` (2 or more GPUs).
CPU (--smoke): XLA's side and the checks' plumbing on fake devices.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import (add_output_args, parse_with_smoke, run_on_devices,  # noqa: E402
                             write_results)
from benchmarks.bench_peer_copy import MIB, checked_then_timed, one_group  # noqa: E402

AXIS = "tensor"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="1.3b,2.7b")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--iters", type=int, default=20)
  add_output_args(p, label="nvlink", smoke="CPU: 8 fake devices, XLA's side only")
  return parse_with_smoke(p, argv, dict(models="tiny", batch=2, seq=512))


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from taco_jax.pallas_kernels import exchange, gemm
  from benchmarks.train_parallel import SIZES

  mesh, smap, results = one_group(AXIS)
  n, on_gpu = results["n"], results["platform"] == "gpu"
  results.update(batch=args.batch, seq=args.seq, iters=args.iters)
  for model in args.models.split(","):
    d = SIZES[model][1]  # d_model
    for way, split, shape in (("forward", 1, (args.batch, args.seq, d // n)),
                              ("backward", 2, (args.batch, args.seq // n, d))):
      x = jax.device_put(jax.random.normal(jax.random.key(split), (n * shape[0], *shape[1:]),
                                           jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
      received = (n - 1) * shape[0] * shape[1] * shape[2] * 2 // n
      case = dict(model=model, way=way, shape=list(shape), received_mib=received / MIB,
                  misfit=exchange.misfit(shape, n, split), variants={})
      results["cases"].append(case)
      xla = jax.jit(smap(lambda x, s=split: lax.all_to_all(x, AXIS, s, 3 - s, tiled=True)))
      want = xla(x)
      variants = {"xla_all_to_all": xla}
      if case["misfit"] is None:
        variants["kernel"] = jax.jit(smap(lambda x, s=split: exchange.all_to_all(
            x, AXIS, n=n, split_axis=s, num_sms=gemm.num_sms())))
      for name, fn in variants.items():
        if not on_gpu and name == "kernel":
          case["variants"][name] = dict(skipped="the kernel runs on a GPU only")
          continue
        check = case["variants"][name] = checked_then_timed(fn, (x,), want, args.iters, n,
                                                            on_gpu)
        if "ms" in check:
          check["gb_s"] = received / (check["ms"] * 1e-3) / 1e9
        write_results("bench_exchange", args, results)
      timed = {k: v["ms"] for k, v in case["variants"].items() if "ms" in v}
      print(f"{model} {way} {shape}: " + ", ".join(f"{k} {ms:.4f} ms" for k, ms in timed.items())
            + "".join(f" {k} FAILED: {v.get('error', 'wrong result')[:300]}"
                      for k, v in case["variants"].items() if v.get("ok") is False),
            flush=True)
  return results


def main(argv=None):
  return run_on_devices("bench_exchange", parse_args(argv), run)


if __name__ == "__main__":
  main()
