"""Can XLA fold the decode of a gathered message into the matmul that consumes it?

On NVLink the codec's own HBM passes cost about half of what the smaller transfers save
(docs/parallel.md, "What compression can recover on NVLink"); the all-gather's decode,
which writes the full bf16 tensor only for the next matmul to read it back, is most of
that traffic. This times, on one GPU at the 1.3B TP=4 layer's shapes, the consumers of a
gathered x [M, D] given as wire rows:

* ``bf16``:          x @ w on a bf16 x (cuBLAS; the uncompressed layer's matmul);
* ``pallas_decode``: the Pallas decode kernel, then x @ w (the compressed layer today);
* ``xla_decode``:    the jnp reference decode, left to XLA to fuse, then x @ w;
* ``*_triton_any``:  the same compiled with ``xla_gpu_triton_gemm_any`` (XLA may emit
                     the matmul as a Triton GEMM with the decode in its prologue);
* ``decode_only``:   the Pallas decode alone (what fusion could save at most);

for the forward product x @ w and the weight gradient x.T @ dy. Each record says whether
the compiled program still has a cuBLAS call and whether it has a Triton GEMM fusion.

GPU:  python benchmarks/probe_fused_decode.py --out-dir $OUT
CPU smoke (tiny, interpret mode):  python benchmarks/probe_fused_decode.py --smoke
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import (add_output_args, one_device_report,  # noqa: E402
                             parse_with_smoke, write_report)

TRITON_ANY = {"xla_gpu_triton_gemm_any": True}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=int, default=8 * 2048, help="M: batch x sequence")
  p.add_argument("--hidden", type=int, default=2048, help="D: the gathered width")
  p.add_argument("--widths", default="1536,2048",
                 help="F per product: QKV (3 D / 4) and MLP-in (4 D / 4) at TP=4")
  p.add_argument("--samples", type=int, default=20)
  add_output_args(p, label="default", smoke="CPU, tiny shapes, Pallas in interpret mode")
  return parse_with_smoke(p, argv, dict(rows=64, hidden=256, widths="128", samples=2,
                                        label="smoke"))


def compiled_kinds(fn, *args, options=None) -> dict:
  import jax
  text = jax.jit(fn, compiler_options=options or {}).lower(*args).compile().as_text()
  return dict(cublas="cublas" in text, triton_gemm="triton_gemm" in text)


def run(args) -> dict:
  import jax
  import jax.numpy as jnp

  from benchmarks import common
  from taco_jax.codec import CompressionConfig, from_wire, to_wire

  m, d = args.rows, args.hidden
  pallas = CompressionConfig(implementation="pallas", link=None)
  xla = CompressionConfig(implementation="xla", link=None)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, d), jnp.bfloat16)
  wire = jax.jit(lambda a: to_wire(a, pallas))(x)
  decode = {"pallas": lambda u: from_wire(u, pallas, d), "xla": lambda u: from_wire(u, xla, d)}
  results = []
  for f in (int(v) for v in args.widths.split(",")):
    w = (jax.random.normal(kw, (d, f), jnp.float32) / d**0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kw, (m, f), jnp.bfloat16)
    products = {"x@w": (lambda a: a @ w), "x.T@dy": (lambda a: a.T @ dy)}
    for product, mm in products.items():
      cases = {
          "bf16": (mm, x, None),
          "bf16_triton_any": (mm, x, TRITON_ANY),
          "pallas_decode": (lambda u, mm=mm: mm(decode["pallas"](u)), wire, None),
          "xla_decode": (lambda u, mm=mm: mm(decode["xla"](u)), wire, None),
          "xla_decode_triton_any": (lambda u, mm=mm: mm(decode["xla"](u)), wire, TRITON_ANY),
          "decode_only": (decode["pallas"], wire, None),
      }
      for name, (fn, arg, options) in cases.items():
        t = common.time_fn(fn, arg, samples=args.samples, compiler_options=options)
        rec = dict(product=product, m=m, d=d, f=f, variant=name, median_ms=t.median_s * 1e3,
                   min_ms=t.min_s * 1e3, inner=t.inner, **compiled_kinds(fn, arg, options=options))
        results.append(rec)
        print(f"{product:7s} F={f:5d} {name:22s} {rec['median_ms']:8.4f} ms  "
              f"cublas={rec['cublas']} triton_gemm={rec['triton_gemm']}", flush=True)
  return one_device_report("probe_fused_decode", args, results)


def main(argv=None):
  args = parse_args(argv)
  report = run(args)
  return write_report("fused_decode", args, report, json.dumps(
      {f"{r['product']} F={r['f']} {r['variant']}": round(r["median_ms"], 4)
       for r in report["results"]}, indent=1))


if __name__ == "__main__":
  main()
