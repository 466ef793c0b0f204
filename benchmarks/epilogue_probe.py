"""What the GEMM-epilogue probes (``probe_gelu_gemm``, ``probe_qkv_gemm``) share: the kernel
layers' all-gather kernel run as rank 0 in local mode on one GPU, the variants timed in
rounds that take turns, their ratios, and the CPU smoke run's set-up."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax

from benchmarks import common
from benchmarks.args import add_output_args

FP8 = dict(group_size=128, fmt="e4m3", dual_scale=True, lam=1e-6)  # the codec's defaults
METHOD = ("min over rounds of the median device time (CUPTI, all kernels of a call) of "
          "iters calls; the variants take turns on the same inputs")


def rank0_all_gather(x, x_full, w, *, tp: int, sms: int, tiling=None, epilogue=None,
                     transpose_w: bool = False, pulled: bool = False, fp8: bool = False):
  """The all-gather kernel (``ag_matmul``) as rank 0 of ``tp`` in local mode: the peers'
  chunks read from ``x_full``, what goes to rank r - 1 written locally. On the layers' tiles
  (``plain_tiling`` or ``fp8_tiling``, fitted to ``epilogue``) unless ``tiling`` is given;
  ``pulled``: in clusters of 2; ``fp8``: the compressed kernel, its call encoding the whole
  gathered x (local mode's stand-in for the peers'). The epilogue's outputs (the product
  without one), each ``[M, .]``."""
  from taco_jax.pallas_kernels import ag_matmul
  from taco_jax.pallas_kernels.encode import encode
  w_kn = w.shape[::-1] if transpose_w else w.shape
  if tiling:
    base = tiling
  elif fp8:
    base = ag_matmul.fp8_tiling(x.shape, w_kn, FP8["group_size"])
  else:
    base = ag_matmul.plain_tiling(x.shape, w_kn, tp, sms)
  if pulled:
    base = dataclasses.replace(base, cluster_n=2)
  kw = dict(tiling=epilogue.fit(base) if epilogue else base, num_sms=sms,
            transpose_w=transpose_w, epilogue=epilogue, rank=0)
  if fp8:
    b, s, k = x.shape
    codes, alpha, scale = encode(x_full.reshape(-1, k), hadamard=False, **FP8)
    codes = codes.reshape(x_full.shape)
    mult = ag_matmul.multipliers(alpha, scale)
    mine = mult.reshape(-1, b, x_full.shape[1])[:, :, :s].reshape(mult.shape[0], -1)
    outs = ag_matmul.all_gather_matmul_fp8(
        codes[:, :s], mine, w, "t", group_size=FP8["group_size"], dtype=x.dtype,
        local_gathered=(codes, mult), **kw)
  else:
    outs = ag_matmul.all_gather_matmul(x, w, "t", local_gathered=x_full, **kw)
  m = x_full.shape[0] * x_full.shape[1]  # the epilogue's outputs, then the gathered x, ...
  n_out = 1 if epilogue is None else len(epilogue.outputs(m, w_kn[1], x.dtype))
  return [o.reshape(-1, o.shape[-1]) for o in outs[:n_out]]


def time_and_compare(case: dict, fns: dict, iters: int, rounds: int, pairs: dict) -> None:
  """Times ``fns`` (name -> (function, its inputs)) that passed their checks (``case``'s
  variants' ``ok``; the ``[fp8]`` ones are checked only) in ``rounds`` rounds that take
  turns, into ``case["variants"]``, and sets ``case[key]`` to the ratio of the best times of
  each ``pairs`` entry ``key: (variant, baseline)`` where both ran."""
  from benchmarks.bench_collective_matmul import best_of_rounds
  vs = case["variants"]
  for name, times in best_of_rounds(
      {name: (jax.jit(fn), args) for name, (fn, args) in fns.items()
       if vs[name]["ok"] and "[fp8]" not in name}, iters, rounds).items():
    vs[name].update(times)
  for key, (variant, baseline) in pairs.items():
    if vs.get(variant, {}).get("best_ms") and vs.get(baseline, {}).get("best_ms"):
      case[key] = vs[variant]["best_ms"] / vs[baseline]["best_ms"]


@contextlib.contextmanager
def smoke_run():
  """The CPU smoke run: 8 CPU devices where JAX has not started yet, jax's GPU interpreter,
  and small tiles as the layers' (the warpgroups split the rows). Yields the tiling."""
  try:  # jax's GPU interpreter runs each warpgroup on a thread of the CPU backend's pool,
    #     and one CPU device's pool starves kernels whose warpgroups wait on each other
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  except RuntimeError:  # JAX already runs (e.g. under pytest, on 8 devices)
    pass
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from taco_jax.pallas_kernels import gemm
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    yield gemm.Tiling(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32,
                      split="m")


def smoke_verdict(case: dict) -> int:
  """Prints how many variants matched their references; 1 if any did not."""
  bad = [n for n, v in case["variants"].items() if not v["ok"]]
  print(f"smoke: {len(case['variants']) - len(bad)} / {len(case['variants'])} match", bad)
  return 1 if bad else 0


def parse_args(argv, description: str, width: str) -> argparse.Namespace:
  """A probe's command line: ``--tp`` (the layer's width is ``width`` / tp), ``--iters``,
  ``--rounds``, ``--all-gather`` and the output arguments."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--tp", default="1,2", help=f"the layer's width is {width} / tp")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--all-gather", action="store_true",
                 help="at tp > 1, also the kernel layers' all-gather kernel in local mode")
  add_output_args(p, label="h200", smoke="CPU: tiny shapes, the kernels in interpret mode, untimed")
  return p.parse_args(argv)


def report(name: str, cases: list[dict], width: str, args) -> None:
  """Prints a row per case (its ``width`` key, each variant's best time, the ratios) and
  writes the cases to ``<name>_<label>``'s results."""
  rows = [dict({width: c[width]}, **{k: v.get("best_ms") for k, v in c["variants"].items()},
               **{k: v for k, v in c.items() if "_over_" in k}) for c in cases]
  print(common.table(rows, list(dict.fromkeys(k for r in rows for k in r))))
  common.write_results(f"{name}_{args.label}", dict(env=common.environment(), cases=cases,
                                                    method=METHOD), args.out_dir)
