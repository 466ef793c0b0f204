"""Does our GEMM core lose a partial wave where cuBLAS does not? Device time of cuBLAS (a
bf16 dot) and the GEMM core (``gemm.matmul``, default tiles) at the 1.3B TP=2 layer shapes,
for several row counts M: at M = 16384 the core's 128-row tiles make 128 row tiles, so
every round of its persistent loop leaves 4 of the H200's 132 SMs without a tile (3% of
the time); at M = 132 x 128 = 16896 the rounds are full. A kernel whose time follows its
waves takes as long at both; one that balances its tail takes 3.1% longer at the larger M.
Rounds of calls take turns, kernel by kernel, on the same inputs; each result is checked
against an fp32 reference.

GPU: python benchmarks/probe_waves.py --out-dir $OUT
CPU: python benchmarks/probe_waves.py --smoke   (tiny shapes, the core in interpret mode)
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.args import add_output_args  # noqa: E402

# (name, K, N) of one rank's matmul at the 1.3B model's TP=2 shapes (d = 2048, 4d MLP)
SHAPES = (("qkv", 2048, 3072), ("mlp_in", 2048, 4096), ("mlp_out", 4096, 2048),
          ("proj", 1024, 2048))
TOL = 2e-2


def _kernels(sms: int, interpret: bool):
  from taco_jax.pallas_kernels import gemm
  core = jax.jit(lambda a, w: gemm.matmul(a, w, num_sms=sms))
  cublas = jax.jit(lambda a, w: jnp.dot(a, w))
  return {"cublas": cublas, "core": core} if not interpret else {"core": core}


def probe(rows: list[int], shapes, iters: int, rounds: int, sms: int,
          interpret: bool = False) -> list[dict]:
  from benchmarks.bench_collective_matmul import best_of_rounds, rel_err
  kernels = _kernels(sms, interpret)
  cases = []
  for name, k, n in shapes:
    for m in rows:
      ka, kw = jax.random.split(jax.random.key(m * 7 + k + n))
      a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
      w = (jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
      want = jnp.dot(a.astype(jnp.float32), w.astype(jnp.float32))
      case = dict(shape=name, m=m, k=k, n=n, tiles=(m // 128) * (n // 256), sms=sms)
      for kname, fn in kernels.items():
        err = rel_err(fn(a, w), want)
        case[kname] = dict(rel_err=err, ok=err < TOL, ms=[])
      if not interpret:
        for kname, times in best_of_rounds({kname: (fn, (a, w)) for kname, fn in kernels.items()
                                            if case[kname]["ok"]}, iters, rounds).items():
          case[kname].update(times)
          if "best_ms" in times:
            case[kname]["tflops"] = 2 * m * k * n / times["best_ms"] / 1e9
      cases.append(case)
  return cases


def _ratios(cases: list[dict]) -> list[dict]:
  """Per shape and kernel: each M's time against the first M's, beside the work's ratio."""
  rows = []
  for name in dict.fromkeys(c["shape"] for c in cases):
    mine = [c for c in cases if c["shape"] == name]
    base = mine[0]
    for c in mine:
      row = dict(shape=name, m=c["m"], work=c["m"] / base["m"])
      for kname in ("cublas", "core"):
        if c.get(kname, {}).get("best_ms") and base.get(kname, {}).get("best_ms"):
          row[f"{kname}_ms"] = c[kname]["best_ms"]
          row[f"{kname}_time"] = c[kname]["best_ms"] / base[kname]["best_ms"]
      if row.get("cublas_ms") and row.get("core_ms"):
        row["core_over_cublas"] = row["core_ms"] / row["cublas_ms"]
      rows.append(row)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", default="16384,16896,15872",
                 help="row counts M (the first is each ratio's base)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--rounds", type=int, default=3)
  add_output_args(p, label="h200", smoke="CPU: tiny shapes, the core in interpret mode, untimed")
  args = p.parse_args(argv)
  rows = [int(r) for r in args.rows.split(",")]
  if args.smoke:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
      cases = probe([256, 384], (("tiny", 128, 256),), 1, 1, sms=2, interpret=True)
    bad = [c for c in cases if not c["core"]["ok"]]
    print(f"smoke: {len(cases) - len(bad)} / {len(cases)} core results match")
    return 1 if bad else 0
  from taco_jax.pallas_kernels import gemm
  sms = gemm.num_sms()
  cases = probe(rows, SHAPES, args.iters, args.rounds, sms)
  ratios = _ratios(cases)
  print(common.table(ratios, ["shape", "m", "work", "cublas_ms", "cublas_time", "core_ms",
                              "core_time", "core_over_cublas"]))
  common.write_results(f"probe_waves_{args.label}", dict(
      env=common.environment(), rows=rows, cases=cases, ratios=ratios,
      method=("min over rounds of the median device time (CUPTI) of iters calls; "
              "cuBLAS and the core take turns on the same inputs")), args.out_dir)
  return 0


if __name__ == "__main__":
  sys.exit(main())
