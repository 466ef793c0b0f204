"""The fused GELU MLP (`model.mlp_gelu='fused'`) against XLA's, on one random batch of a
model's MLP shapes: ``gelu(x @ w_in + b) @ w_out`` forward and backward (the output and the
gradients of x, w_in, b, w_out) three ways on one device: the GELU GEMMs
(`models.gelu_mlp`), XLA in the compute dtype, and XLA on the fp32 upcast of the same inputs
(the reference). Per output, the relative L2 error ||a - ref|| / ||ref|| of each against the
reference, so the kernels' error reads beside XLA's own rounding. Inputs are drawn at the
model's scales (x unit normal, as a LayerNorm leaves it; weights N(0, 0.02); the cotangent
unit normal).

GPU: python benchmarks/gelu_numerics.py --out-dir $OUT
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402

OUTPUTS = ("out", "dx", "dw_in", "db_in", "dw_out")


def _xla(x, w_in, b, w_out):
  return jax.nn.gelu(x @ w_in + b.astype(x.dtype), approximate=True) @ w_out


def _fused(x, w_in, b, w_out):
  from taco_jax.models import gelu_mlp
  kernels = gelu_mlp.kernel_problem(x.shape, w_in.shape) is None
  return gelu_mlp.gelu_mlp(x, w_in, b, w_out, gelu_mlp.LocalMatmuls(kernels))


def _forward_backward(fn, args, ct):
  out, vjp = jax.vjp(fn, *args)
  return (out, *vjp(ct))


def compare(tokens: int, d: int, f: int, seed: int = 0) -> dict:
  """The comparison above at ``[tokens, d] -> [tokens, f] -> [tokens, d]``."""
  from taco_jax.models import gelu_mlp
  ks = jax.random.split(jax.random.key(seed), 5)
  bf16 = jnp.bfloat16
  x = jax.random.normal(ks[0], (tokens, d), jnp.float32).astype(bf16)
  w_in = (0.02 * jax.random.normal(ks[1], (d, f), jnp.float32)).astype(bf16)
  w_out = (0.02 * jax.random.normal(ks[2], (f, d), jnp.float32)).astype(bf16)
  b = 0.02 * jax.random.normal(ks[3], (f,), jnp.float32)
  ct = jax.random.normal(ks[4], (tokens, d), jnp.float32).astype(bf16)
  args = (x, w_in, b, w_out)
  ref = jax.jit(lambda *a: _forward_backward(
      _xla, [v.astype(jnp.float32) for v in a[:4]], a[4].astype(jnp.float32)))(*args, ct)
  out = dict(tokens=tokens, d=d, f=f,
             kernels=gelu_mlp.kernel_problem(x.shape, w_in.shape) or "ran")
  for name, fn in (("fused", _fused), ("xla", _xla)):
    got = jax.jit(lambda *a, fn=fn: _forward_backward(fn, a[:4], a[4]))(*args, ct)
    out[f"{name}_vs_fp32"] = {
        o: float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
        for o, g, r in zip(OUTPUTS, got, ref)}
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="16384x2048x8192,16384x2048x4096",
                 help="tokens x d_model x d_ff (per rank: d_ff / tp), comma-separated")
  p.add_argument("--label", default="h200")
  p.add_argument("--out-dir", default=None)
  args = p.parse_args(argv)
  cases = [compare(*map(int, s.split("x"))) for s in args.shapes.split(",")]
  rows = [dict(shape=f"{c['tokens']}x{c['d']}x{c['f']}", way=w, **c[f"{w}_vs_fp32"])
          for c in cases for w in ("fused", "xla")]
  print(common.table(rows, ["shape", "way", *OUTPUTS]))
  return common.write_results(f"gelu_numerics_{args.label}", dict(
      env=common.environment(), cases=cases), args.out_dir)


if __name__ == "__main__":
  main()
