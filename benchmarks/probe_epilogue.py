"""Does XLA fold the MLP-in's bias and GELU into cuBLASLt's epilogue? Three forms of
gelu(x @ w + b), device-timed in one process on the same inputs, with the epilogue each
compiled GEMM got (from the optimized HLO):

  dot_kept    gelu(x @ w + b), returning x @ w too (what `parallel.save_dots` keeps: the
              dot's own output)
  sum_kept    the same, returning x @ w + b (the output after the bias) instead
  alone       gelu(x @ w + b) only

GPU: python benchmarks/probe_epilogue.py --out-dir $OUT
CPU: python benchmarks/probe_epilogue.py --smoke
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402


def _gelu(y):
  return jax.nn.gelu(y, approximate=True)


FORMS = {
    "dot_kept": lambda x, w, b: (lambda y: (_gelu(y + b), y))(x @ w),
    "sum_kept": lambda x, w, b: (lambda y: (_gelu(y), y))(x @ w + b),
    "alone": lambda x, w, b: _gelu(x @ w + b),
}


def epilogues(hlo: str) -> list[str]:
  """The cuBLAS(Lt) epilogues of the GEMM custom calls in optimized HLO text."""
  return re.findall(r'"epilogue":"(\w+)"', hlo)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--mkn", default="16384,2048,8192", help="M, K, N (1.3B MLP-in, batch 8)")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--label", default="mlp_in")
  p.add_argument("--out-dir", default=None)
  args = p.parse_args(argv)
  m, k, n = (128, 64, 256) if args.smoke else (int(s) for s in args.mkn.split(","))
  timing = dict(samples=3, warmup=1) if args.smoke else {}
  kx, kw, kb = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n,), jnp.float32).astype(jnp.bfloat16)
  want = FORMS["alone"](x, w, b).astype(jnp.float32)
  rows = []
  for name, form in FORMS.items():
    f = jax.jit(form)
    hlo = f.lower(x, w, b).compile().as_text()
    got = jax.tree.leaves(f(x, w, b))[0].astype(jnp.float32)
    rows.append(dict(form=name, ms=common.time_fn(f, x, w, b, **timing).median_s * 1e3,
                     epilogues=epilogues(hlo), fusions=len(re.findall(r" fusion\(", hlo)),
                     max_abs_err=float(jnp.max(jnp.abs(got - want)))))
    print(rows[-1], flush=True)
  print(common.table(rows, ["form", "ms", "epilogues", "fusions", "max_abs_err"]))
  print("wrote", common.write_results(
      f"probe_epilogue_{args.label}_{common.device_slug()}",
      dict(benchmark="probe_epilogue", label=args.label, mkn=[m, k, n], rows=rows),
      "/tmp" if args.smoke and not args.out_dir else args.out_dir))


if __name__ == "__main__":
  main()
