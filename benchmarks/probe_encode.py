"""Where does the encode kernel's time go? Times variants of encode_pallas on one input.

python -m benchmarks.probe_encode [--size-mib 256]
"""
import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks import common
from taco_jax import pallas_kernels  # noqa: F401

enc = sys.modules["taco_jax.pallas_kernels.encode"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--size-mib", type=float, default=256)
  ap.add_argument("--d", type=int, default=4096)
  args = ap.parse_args()
  rows = int(args.size_mib * common.MIB) // 2 // args.d
  x = (jax.random.t(jax.random.key(0), 3.0, (rows, args.d), jnp.float32)).astype(jnp.bfloat16)
  nbytes = x.size * 2 + x.size + 8 * x.size // 128
  try:
    import cupy as cp
    a = cp.ones(256 << 20, cp.uint8); b = cp.empty_like(a)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3): b[...] = a
    ts = []
    for _ in range(20):
      s.record(); cp.copyto(b, a); e.record(); e.synchronize(); ts.append(cp.cuda.get_elapsed_time(s, e))
    ts.sort(); print(f"cupy memcpy D2D: {2 * a.nbytes / (ts[10] / 1e3) / 1e9:.0f} GB/s")
  except Exception as err:  # noqa: BLE001
    print("no cupy memcpy:", err)
  print(f"xla elementwise copy: {common.copy_bandwidth(1 << 30)['gbps']:.0f} GB/s")
  orig_sum = enc.sum_of_squares
  interpret = jax.default_backend() != "gpu"  # CPU: a (slow) check that the script runs

  def run(name, **kw):
    jax.clear_caches()
    t = common.time_fn(lambda v: enc.encode_pallas(v, group_size=128, interpret=interpret,
                                                   **kw), x)
    print(f"{name:40s} {t.median_s * 1e3:8.3f} ms  {nbytes / t.median_s / 1e9:7.0f} GB/s", flush=True)

  run("base")
  run("dual_scale=False", dual_scale=False)
  run("hadamard=False", hadamard=False)
  run("hadamard=False dual_scale=False", hadamard=False, dual_scale=False)
  run("h_iota", h_iota=True)
  for br, bk, w in [(16, 8, 8), (32, 4, 8), (4, 8, 4), (8, 16, 8), (64, 2, 8)]:
    run(f"tile {br}x{bk} warps {w}", block_rows=br, block_groups=bk, num_warps=w)
  run("num_stages 1", num_stages=1)
  run("num_stages 3", num_stages=3)
  # The reference's fixed pairwise order, compiled for the GPU (the kernel normally lets
  # Triton pick the order there; docs/codec.md). Dot-based sums were slower still.
  enc.sum_of_squares = lambda v, fixed_order: orig_sum(v, fixed_order=True)
  run("sum of squares in fixed pairwise order")
  enc.sum_of_squares = orig_sum
  t = common.time_fn(lambda v: pallas_kernels.encode_reference(v, group_size=128), x)
  print(f"{'xla reference':40s} {t.median_s * 1e3:8.3f} ms  {nbytes / t.median_s / 1e9:7.0f} GB/s")


if __name__ == "__main__":
  main()
