"""Where does the FP8 matmul + reduce-scatter kernel's extra time go?

On one H200 at the TP=2 shapes, rank 0's FP8 kernel takes 1.08-1.43x its plain kernel
(``bench_collective_matmul_rank0_dealt``): every partial tile it sends is encoded in the
epilogue, and each tile it owns is encoded, decoded and summed with the received partials.
This times rank 0's kernel in local mode with parts of that epilogue taken out, in one
process on the same inputs (the variants compute wrong results on purpose, so none is
checked; ``bench_collective_matmul`` checks the real kernel):

* ``plain`` / ``fp8``: the kernels as they are;
* ``fp8_own_only``: the owned tiles add no received partial (what reading and decoding
  them costs);
* ``fp8_no_own_codec``: the owned tiles' own partial is not encoded and decoded, only
  summed with the received ones.

A variant whose sent tiles held constant codes instead of encoded ones did not lower
(Mosaic GPU stores no splat-layout array of that shape; the 20261123 results file records
the error) and was dropped: the send side's encode is what the other two leave over.

GPU: ``python3 -m benchmarks.probe_rs_epilogue --out-dir $OUT`` (one GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import add_output_args, parse_with_smoke, results_path  # noqa: E402
from benchmarks.bench_collective_matmul import FP8, device_time_ms, layer_shapes  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="1.3b,2.7b")
  p.add_argument("--layers", default="proj,down")
  p.add_argument("--tp", type=int, default=2)
  p.add_argument("--iters", type=int, default=20)
  add_output_args(p, label="rank0", smoke="not supported: the kernels need a GPU")
  return parse_with_smoke(p, argv, {})


def _variants(rs):
  """name -> the ``_Epilogues`` class the kernel is built with."""
  import jax.numpy as jnp

  class OwnOnly(rs._Epilogues):
    def _fp8_sums(self, acc, wg, r, row, col, received):
      t = self.t
      for i in self._slabs():
        own = rs.decode_tile(*self._encode(acc[i * t.epi_m:(i + 1) * t.epi_m]), jnp.float32)
        yield i, own

    def prefetch(self, *args):
      pass

  class NoOwnCodec(rs._Epilogues):
    def _encode(self, x):
      if getattr(self, "_finishing", False):
        return x.astype(self.fp8["codes_dtype"]), jnp.ones(x.shape[:1], jnp.float32)
      return super()._encode(x)

    def _fp8_sums(self, *args):
      self._finishing = True
      try:
        yield from super()._fp8_sums(*args)
      finally:
        self._finishing = False

  return {"fp8": rs._Epilogues, "fp8_own_only": OwnOnly, "fp8_no_own_codec": NoOwnCodec}


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from taco_jax.pallas_kernels import gemm, matmul_rs as rs

  sms = gemm.num_sms()
  out = dict(device=jax.devices()[0].device_kind, tp=args.tp, fp8=FP8, cases=[],
             date=datetime.datetime.now().isoformat())
  original = rs._Epilogues
  for model in args.models.split(","):
    for layer in args.layers.split(","):
      kind, y_shape, w_shape = layer_shapes(model, args.tp, 8, 2048)[layer]
      ky, kw = jax.random.split(jax.random.key(0))
      f = y_shape[-1] // args.tp
      y = jax.random.normal(ky, (*y_shape[:-1], f), jnp.bfloat16)
      w = (jax.random.normal(kw, (f, w_shape[1]), jnp.float32) * f ** -0.5).astype(jnp.bfloat16)
      b, t, _ = y_shape
      case = dict(model=model, layer=layer, y_shape=y.shape, w_shape=w.shape, ms={})
      for name, cls in {"plain": original, **_variants(rs)}.items():
        fp8 = None if name == "plain" else FP8
        slots = [jnp.zeros(x.shape, x.dtype)
                 for x in rs.slot_shapes(args.tp, b * t // args.tp, w_shape[1], y.dtype, fp8)]
        rs._Epilogues = cls
        try:
          fn = jax.jit(lambda y, w, *rec, fp8=fp8: rs.matmul_reduce_scatter(
              y, w, "tensor", num_sms=sms, fp8=fp8, rank=0, n=args.tp, received=rec)[0])
          case["ms"][name] = device_time_ms(fn, (y, w, *slots), args.iters, 1)["ms"]
        except Exception as e:  # noqa: BLE001 (a variant that does not lower is reported)
          case["ms"][name] = f"{type(e).__name__}: {e}"[:500]
        finally:
          rs._Epilogues = original
      out["cases"].append(case)
      print(model, layer, {k: (round(v, 4) if isinstance(v, float) else v)
                           for k, v in case["ms"].items()}, flush=True)
  return out


def main(argv=None):
  args = parse_args(argv)
  import jax
  if args.smoke or jax.default_backend() != "gpu":
    sys.exit("probe_rs_epilogue: the kernels run on a Hopper GPU only (bench_collective_matmul "
             "--smoke checks the plumbing on CPU)")
  results = run(args)
  path = results_path("probe_rs_epilogue", args, num_devices=1, platform="gpu",
                      date=results["date"])
  path.write_text(json.dumps(results, indent=1, default=str))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
