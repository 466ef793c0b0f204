"""The GEMM core's ping-pong schedule (gemm.Tiling(split="tiles")) against the split core and
cuBLAS at the 1.3B MLP shapes, one GPU, device time; the forward GELU kernel both ways. Run
once (2026-11-29) and reverted with the schedule: python benchmarks/probe_pingpong.py."""
import pathlib
sys_path = str(pathlib.Path(__file__).resolve().parents[1])
import functools, json, os, sys
sys.path.insert(0, sys_path)
import jax, jax.numpy as jnp
from benchmarks.bench_collective_matmul import best_of_rounds, rel_err
from taco_jax.pallas_kernels import gemm, gelu_gemm
sms = gemm.num_sms()
m, d = 16384, 2048
out = {}
for f in (8192, 4096):
  ks = jax.random.split(jax.random.key(f), 3)
  x = jax.random.normal(ks[0], (m, d)).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (d, f)) / d ** .5).astype(jnp.bfloat16)
  b = 0.1 * jax.random.normal(ks[2], (f,))
  ref = jnp.dot(x, w, preferred_element_type=jnp.float32)
  T = lambda **kw: gemm.Tiling(split="tiles", **kw)
  cores = {"split": gemm.Tiling(), "pp6": T(stages=6), "pp6_w16": T(stages=6, grid_width=16),
           "pp6_w4": T(stages=6, grid_width=4), "pp6_n8": T(stages=6, grid_minor="n"),
           "pp3_k128": T(stages=3, tile_k=128), "pp4_m64n256": T(stages=4, tile_m=64, tile_n=256),
           "pp4_m64n256_w16": T(stages=4, tile_m=64, tile_n=256, grid_width=16)}
  timed = {}
  for name, t in cores.items():
    try:
      fn = jax.jit(functools.partial(gemm.matmul, num_sms=sms, tiling=t))
      err = rel_err(fn(x, w), ref)
      print(f, name, "err", err, flush=True)
      timed["core_" + name] = (fn, (x, w))
    except Exception as e:
      print(f, name, "FAIL", str(e)[:300], flush=True)
  timed["cublas"] = (jax.jit(lambda a, c: a @ c), (x, w))
  for name, t in {"split": gelu_gemm.FORWARD_TILING, "pp6_w16": T(stages=6, grid_width=16),
                  "pp6_n8": T(stages=6, grid_minor="n")}.items():
    timed["fwd_" + name] = (jax.jit(functools.partial(gelu_gemm.matmul_bias_gelu, num_sms=sms,
                                                      tiling=t, approx_math=True)), (x, w, b))
  res = best_of_rounds(timed, 20, 3)
  out[f] = {k: v.get("best_ms") for k, v in res.items()}
  print(f, json.dumps(out[f], indent=0), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "scratch_pp.json"), "w"), indent=1)
