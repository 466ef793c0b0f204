"""What the MLP's activation costs a training step, in three formulations (one process, same
inputs, device-timed with `common.time_fn`).

A GPT block computes gelu(y + b) of its MLP-in output y ([b, T, d_ff], bf16). With
`parallel.save_dots` the step runs it in the forward pass and, in the backward pass, once
more for the MLP-out weight gradient beside its derivative and the bias gradient. A 1.3B
step on one H200 spent 0.74 ms a layer in those three fusions, about twice what their
bytes take (profile_step_attn_hlo). The formulations:

  bf16      jax.nn.gelu on the bf16 sum (the model's before 2026-11-28)
  f32       the same on the sum in fp32, rounded to bf16 once
  vjp_f32   fp32 math with its own derivative (`models.layers.gelu_tanh`)

Per formulation: the forward (y, b -> gelu) and the backward as the step runs it (y, b, dz ->
gelu, dy, db), in ms, the error of each output against an fp32 reference, and the time the
bytes take at XLA's copy rate (`common.copy_bandwidth`).

GPU: python benchmarks/probe_activation.py --out-dir $OUT
CPU: python benchmarks/probe_activation.py --smoke
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from taco_jax.models.layers import gelu_tanh  # noqa: E402

FORMULATIONS = {
    "bf16": lambda x: jax.nn.gelu(x, approximate=True),
    "f32": lambda x: jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype),
    "vjp_f32": gelu_tanh,
}


def passes(act):
  """(forward, backward) of `act` on y + b, the backward as the remat step runs it."""
  def forward(y, b):
    return act(y + b)

  def backward(y, b, dz):
    g, vjp = jax.vjp(forward, y, b)
    return (g, *vjp(dz))
  return jax.jit(forward), jax.jit(backward)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="8,2048,8192", help="y's shape (1.3B, TP=1, batch 8)")
  p.add_argument("--smoke", action="store_true", help="tiny shape, few samples (CPU)")
  p.add_argument("--label", default="gelu")
  p.add_argument("--out-dir", default=None)
  args = p.parse_args(argv)
  shape = (2, 64, 256) if args.smoke else tuple(int(s) for s in args.shape.split(","))
  timing = dict(samples=3, warmup=1) if args.smoke else {}
  ky, kb, kz = jax.random.split(jax.random.key(0), 3)
  y = (2 * jax.random.normal(ky, shape, jnp.float32)).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(kb, shape[-1:], jnp.float32)).astype(jnp.bfloat16)
  dz = (1e-3 * jax.random.normal(kz, shape, jnp.float32)).astype(jnp.bfloat16)
  ref_fwd, ref_bwd = passes(lambda x: jax.nn.gelu(x, approximate=True))
  f32 = lambda *a: [x.astype(jnp.float32) for x in a]  # noqa: E731
  want_fwd, want_bwd = ref_fwd(*f32(y, b)), ref_bwd(*f32(y, b, dz))
  elem = y.size * y.dtype.itemsize
  rate = common.copy_bandwidth(elem, **timing)["gbps"] * 1e9 if not args.smoke else None
  rows = []
  for name, act in FORMULATIONS.items():
    fwd, bwd = passes(act)
    errs = {}
    for what, got, want in (("fwd", [fwd(y, b)], [want_fwd]),
                            ("bwd", bwd(y, b, dz), want_bwd)):
      for i, (g, w) in enumerate(zip(got, want)):
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        errs[f"{what}_{i}_max_rel"] = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) / scale
    row = dict(formulation=name, fwd_ms=common.time_fn(fwd, y, b, **timing).median_s * 1e3,
               bwd_ms=common.time_fn(bwd, y, b, dz, **timing).median_s * 1e3, **errs)
    if rate:  # the bytes: forward reads y, writes gelu; backward reads y, dz, writes 2
      row.update(fwd_bytes_ms=2 * elem / rate * 1e3, bwd_bytes_ms=4 * elem / rate * 1e3)
    rows.append(row)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
  base = rows[0]
  for row in rows:
    row["fwd_vs_bf16"] = row["fwd_ms"] / base["fwd_ms"]
    row["bwd_vs_bf16"] = row["bwd_ms"] / base["bwd_ms"]
  print(common.table(rows, ["formulation", "fwd_ms", "bwd_ms", "fwd_vs_bf16", "bwd_vs_bf16",
                            "fwd_0_max_rel", "bwd_1_max_rel"]))
  path = common.write_results(
      f"probe_activation_{args.label}_{common.device_slug()}",
      dict(benchmark="probe_activation", label=args.label, shape=list(shape),
           rows=rows),
      "/tmp" if args.smoke and not args.out_dir else args.out_dir)
  print("wrote", path)


if __name__ == "__main__":
  main()
