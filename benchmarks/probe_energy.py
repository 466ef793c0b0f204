"""Energy per call of our GEMM core against cuBLAS, at the 1.3B TP=2 layer shapes, one GPU.

In a training step the GPUs run at their power cap, and there our core loses more time to
cuBLAS than in a kernel benchmark (docs/measurements.md, "What the step does show"). If the
core spends more energy per multiply-add, the cap turns that energy into time. This reads
NVML's energy counter (``benchmarks.nvml``: ``nvmlDeviceGetTotalEnergyConsumption``) around
``--seconds`` of calls back to back of each kernel, in rounds (cuBLAS, core, cuBLAS, core,
...) so that both see the same thermal history, and records per kernel, shape and round:
mJ per call, ms per call (wall time over the calls: the GPU never waits for the host at
these sizes), the mean power, the SM clock at the end, and J per TFLOP.

GPU:       python benchmarks/probe_energy.py --out-dir $OUT
CPU smoke: python benchmarks/probe_energy.py --smoke   (XLA's matmul only, tiny, no counter)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import nvml  # noqa: E402
from benchmarks.args import (add_output_args, one_device_report,  # noqa: E402
                             parse_with_smoke, write_report)
# a kernel's name suffix: it reads the weight stored [N, K]; tilings as --core-tilings gives
from benchmarks.bench_collective_matmul import TRANSPOSED, _sms, _tiling  # noqa: E402

# (rows, contraction, columns) of one rank's matmul at the 1.3B TP=2 shapes
SHAPES = {"qkv": (16384, 2048, 3072), "mlp_in": (16384, 2048, 4096),
          "mlp_out": (16384, 4096, 2048)}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--seconds", type=float, default=1.0, help="each kernel's run, per round")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--core-tilings", default="default",
                 help="comma-separated gemm.Tiling overrides of the core, each 'k=v+k=v' "
                      "(e.g. 'default,cluster_n=2'), timed as core[...]")
  p.add_argument("--transposed", action="store_true",
                 help="also cuBLAS and the default core on the weight stored [N, K], as the "
                      "backward passes read it (cublas[w_t], core[w_t])")
  add_output_args(p, label="default", smoke="CPU, a tiny XLA matmul, no energy counter")
  return parse_with_smoke(p, argv, dict(seconds=0.05, rounds=1, label="smoke"))


def kernels(on_gpu: bool, core_tilings: str = "default", transposed: bool = False) -> dict:
  """name -> matmul of (a, w [K, N]): cuBLAS (XLA's bf16 dot) and, on a GPU, our GEMM
  core on each of ``core_tilings`` (``core``, ``core[cluster_n=2]``, ...); with
  ``transposed`` also both on w stored [N, K] (``TRANSPOSED``-suffixed names: each takes
  w and transposes it outside the timed calls, see ``operands``)."""
  import jax
  import jax.numpy as jnp
  out = {"cublas": jax.jit(lambda a, w: jnp.dot(a, w))}
  if transposed:
    out["cublas" + TRANSPOSED] = jax.jit(lambda a, w_t: jnp.einsum("mk,nk->mn", a, w_t))
  if on_gpu:
    from taco_jax.pallas_kernels import gemm
    cores = [(spec, False) for spec in core_tilings.split(",")] + [("default", True)] * transposed
    for spec, t_w in cores:
      name = ("core" if spec == "default" else f"core[{spec}]") + (TRANSPOSED if t_w else "")
      out[name] = jax.jit(functools.partial(
          gemm.matmul, tiling=_tiling(gemm.Tiling(), spec), num_sms=_sms(spec, gemm.num_sms()),
          transpose_w=t_w))
  return out


def operands(name: str, a, w) -> tuple:
  """The arguments ``kernels()[name]`` takes: w [K, N], or stored [N, K] for a
  ``TRANSPOSED`` kernel."""
  return (a, w.T if name.endswith(TRANSPOSED) else w)  # eager: a transposed copy


def _energy(gpu) -> int | None:
  return gpu.energy_mj() if gpu else None


def run_for(fn, a, w, seconds: float, gpu) -> dict:
  """Calls ``fn(a, w)`` back to back for about ``seconds`` (the count from one timed call)
  and what they cost."""
  import jax
  t = time.perf_counter()
  jax.block_until_ready(fn(a, w))
  calls = max(3, int(seconds / max(time.perf_counter() - t, 1e-6)))
  e0, t0 = _energy(gpu), time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn(a, w)
  jax.block_until_ready(out)
  e1, t1 = _energy(gpu), time.perf_counter()
  flops = 2 * a.shape[0] * a.shape[1] * w.shape[1]
  rec = dict(calls=calls, ms_per_call=(t1 - t0) / calls * 1e3,
             sm_mhz_after=gpu.sm_mhz() if gpu else None)
  if e0 is not None and e1 is not None:
    mj = (e1 - e0) / calls
    rec.update(mj_per_call=mj, watts=(e1 - e0) / 1e3 / (t1 - t0),
               j_per_tflop=mj / 1e3 / (flops / 1e12))
  return rec


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  on_gpu = jax.default_backend() == "gpu"
  gpu = next(iter(nvml.gpus()), None)  # the first GPU's counters; None on CPU
  fns = kernels(on_gpu, args.core_tilings, args.transposed)
  results = []
  for shape in args.shapes.split(","):
    m, k, n = SHAPES[shape] if not args.smoke else (128, 64, 32)
    ka, kw = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    args_of = {name: operands(name, a, w) for name in fns}
    want = fns["cublas"](a, w).astype(jnp.float32)
    errors = {name: float(jnp.linalg.norm(fn(*args_of[name]).astype(jnp.float32) - want)
                          / jnp.linalg.norm(want)) for name, fn in fns.items()}
    for r in range(args.rounds):
      for name, fn in fns.items():
        rec = dict(shape=shape, m=m, k=k, n=n, kernel=name, round=r, rel_err=errors[name],
                   **run_for(fn, *args_of[name], args.seconds, gpu))
        results.append(rec)
        print(json.dumps(rec), flush=True)
  return one_device_report("probe_energy", args, results)


def main(argv=None):
  args = parse_args(argv)
  report = run(args)
  return write_report("probe_energy", args, report, json.dumps(
      {f"{r['shape']} {r['kernel']} {r['round']}": [round(r["ms_per_call"], 4),
                                                     r.get("mj_per_call")]
       for r in report["results"]}))


if __name__ == "__main__":
  main()
