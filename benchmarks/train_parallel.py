"""End-to-end: 3D-parallel GPT training, TACO compression off vs on, per (dp, pp, tp) layout.

For each layout, both variants start from the same parameters and train on the same
batches (the embedded byte corpus; model vocab padded to a realistic 50304 so the
vocab-parallel head costs what it would with a BPE vocab), in turns of
`--steps-per-turn` steps per variant (the order rotating every turn). Timing: host
wall-clock between the completions of steps dispatched back to back, as the trainer
dispatches them (steps are well over 10 ms on the target GPUs; `step_ms_synced`: a step
alone, dispatch to completion); tokens/s from the median step time after `--warmup`
samples. MFU = model FLOP/s / (devices x the device's dense bf16 peak,
`common.peak_tflops`); `mfu_of_measured` divides by the bf16 matmul rate measured in
the same run instead. The compiled program's collective instructions are
summarized per mesh axis and dtype (`comm_bytes_static`: bytes per device summed over the
instructions, each counted once even inside the layer / pipeline loops), so the JSON shows
which dtypes each axis moves and their ratio, and listed one by one (`comm_ops`: kind, dtype,
shape, axes and the jax op that made it).

GPU (the lead's 4xH200 run; --deadline-s keeps it under ~6 minutes including 6 compiles;
NVLink multicast off):
  python benchmarks/train_parallel.py
CPU smoke test (8 fake devices, tiny model, < 1 minute):
  python benchmarks/train_parallel.py --smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import add_output_args, parse_with_smoke, results_path  # noqa: E402

# (n_layers, d_model, n_heads, d_ff)
SIZES = {"tiny": (2, 64, 8, 256), "125m": (12, 768, 12, 3072), "350m": (24, 1024, 16, 4096),
         "760m": (24, 1536, 16, 6144), "1.3b": (24, 2048, 16, 8192),
         "2.7b": (32, 2560, 32, 10240)}
DEFAULT_COMPRESS = "tp_forward,tp_backward,pp"  # the families the `on` variants compress


# --smoke: a tiny fp32 model on 8 fake CPU devices (each script adds its layouts)
SMOKE = dict(model="tiny", steps=4, warmup=1, seq=32, batch=8, microbatches=2, vocab=256,
             dtype="float32", group_size=32, label="smoke")


TIMING = ("host wall-clock between the completions of steps dispatched back to back "
          "(--steps-per-turn per variant, the variants' order rotating every turn, on the "
          "same batches); median after warm-up; step_ms_synced: a step alone, dispatch to "
          "completion (the timing of results before 2026-11-23)")


def add_run_args(p: argparse.ArgumentParser, *, model: str, layouts: str, steps: int,
                 warmup: int, seq: int, batch: int) -> None:
  """The model, layout, data, optimizer and codec flags of both end-to-end scripts."""
  p.add_argument("--model", default=model, choices=sorted(SIZES))
  p.add_argument("--layouts", default=layouts, help="dp,pp,tp;... (product = devices)")
  p.add_argument("--steps", type=int, default=steps, help="training steps per variant (max)")
  p.add_argument("--warmup", type=int, default=warmup,
                 help="step times left out of the timing (the first turns')")
  p.add_argument("--steps-per-turn", type=int, default=4,
                 help="steps a variant runs back to back before the next variant's turn; "
                      "each but the turn's first is timed completion to completion "
                      "(1: every step synced, dispatch to completion)")
  p.add_argument("--seq", type=int, default=seq)
  p.add_argument("--batch", type=int, default=batch, help="global batch (sequences)")
  p.add_argument("--microbatches", type=int, default=4, help="GPipe micro-batches (pp > 1)")
  p.add_argument("--vocab", type=int, default=50304)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--lr", type=float, default=6e-4)
  p.add_argument("--compress", default=DEFAULT_COMPRESS,
                 help="families compressed in the 'on' variant (tp_forward,tp_backward,pp,dp,"
                      "dp_params; dp_params needs a sharded optimizer: bench_train's _zero)")
  p.add_argument("--format", default="e4m3", choices=["e4m3", "e5m2"])
  p.add_argument("--group-size", type=int, default=128)
  p.add_argument("--hadamard", action=argparse.BooleanOptionalAction, default=False,
                 help="Walsh-Hadamard transform in the codec (off: the measured better default)")
  p.add_argument("--min-bytes", type=int, default=0,
                 help="the codec's min_bytes: smaller messages (per device) go plain")
  p.add_argument("--implementation", default="auto", choices=["auto", "pallas", "xla"],
                 help="the codec's kernels: Pallas, or the jnp reference (which XLA can fuse "
                      "into the ops around it)")
  p.add_argument("--attention", default="auto", choices=["auto", "cudnn", "xla"],
                 help="model.attention: cuDNN flash attention where it runs (auto), forced "
                      "(an error where it cannot), or XLA's")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_run_args(p, model="350m", layouts="1,1,4;1,2,2;2,1,2", steps=200, warmup=5, seq=1024,
               batch=16)
  p.add_argument("--remat", action="store_true")
  p.add_argument("--deadline-s", type=float, default=320.0,
                 help="wall-clock budget of the whole run (compiles included): each layout "
                      "steps until its share of what is left (fewer steps are recorded)")
  add_output_args(p, label="nvlink", smoke="CPU, 8 fake devices, tiny model")
  return parse_with_smoke(p, argv, dict(SMOKE, layouts="2,1,4;2,2,2;4,1,2"))


def comm_record(hlo_text: str, mesh) -> dict:
  """What the compiled step (its HLO text) communicates, statically (an instruction inside a
  loop counts once): ``comm_static``, bytes per device by mesh axis and dtype, and
  ``comm_ops``, each collective instruction's kind, dtype, shape, mesh axes and the end of
  the jax op that made it (which collectives XLA still runs, e.g. beside the kernel
  layers). GSPMD's replica groups may print as mesh['axis_0'=..]: named by the mesh."""
  from taco_jax.testing import hlo
  names = {f"axis_{i}": a for i, a in enumerate(mesh.axis_names)}
  summary, ops = {}, []
  for c in hlo.collectives(hlo_text, mesh):
    axes = sorted(names.get(a, a) for a in c.axes)
    per_dtype = summary.setdefault("+".join(axes) or "none", {})
    per_dtype[c.dtype] = per_dtype.get(c.dtype, 0) + c.bytes
    op = re.search(r'op_name="([^"]*)"', c.line)
    ops.append(dict(kind=c.kind, dtype=c.dtype, shape=list(c.shape), axes=axes,
                    op=op[1][-120:] if op else ""))
  return dict(comm_static=summary, comm_ops=ops)


def model_and_optimizer(args, *, remat: bool):
  """The GPT config of `--model` and the AdamW schedule over `--steps` that every variant
  of the end-to-end benchmarks trains with."""
  import ml_collections
  from taco_jax.tp.layout import model_config
  from taco_jax.train.trainer import make_optimizer
  n_layers, d, h, f = SIZES[args.model]
  cfg = model_config(dict(vocab_size=args.vocab, n_layers=n_layers, d_model=d, n_heads=h,
                          d_ff=f, max_seq_len=args.seq, dtype=args.dtype, remat=remat,
                          attention=args.attention))
  optim = ml_collections.ConfigDict(dict(lr=args.lr, min_lr_ratio=0.1, warmup_steps=min(
      20, args.steps), weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0))
  return cfg, make_optimizer(optim, args.steps)


def compression_plan(args, link=None):
  """The codec of the compressed runs on every family of --compress (--format,
  --group-size, --hadamard, --min-bytes, --implementation; `link` None: every message from
  --min-bytes on)."""
  from taco_jax.codec import CompressionConfig
  from taco_jax.plan import CompressionPlan
  codec = CompressionConfig(format=args.format, group_size=args.group_size,
                            hadamard=args.hadamard, min_bytes=args.min_bytes, link=link,
                            implementation=args.implementation)
  return CompressionPlan(**{f: codec for f in args.compress.split(",") if f})


def build_step(layout, args, cfg, tx, plan, abstract: bool = False, **spec_fields):
  """Our sharded train step for one (dp, pp, tp) layout and codec plan, not yet compiled:
  (jitted step, (params, opt_state), tokens -> global batch, mesh). Parameters come from
  seed 0, so every variant of a layout starts from the same ones; with `abstract`, the
  state and the batch are shapes with their shardings, nothing allocated (to compile
  only). `spec_fields`: further `ParallelSpec` fields (tp_overlap, interleave). Shared
  with bench_train."""
  import jax
  from taco_jax.tp import layout as layout_lib, step as step_lib
  from taco_jax.tp.mesh import make_mesh
  from taco_jax.train.trainer import fresh_state, global_batch, opt_state_target, shardings

  dp, pp, tp = layout
  mesh = make_mesh(dp, pp, tp)
  m = args.microbatches if pp > 1 else 1
  spec = step_lib.ParallelSpec(cfg, dp, pp, tp, m, plan, **spec_fields)
  p_abs = layout_lib.abstract_params(cfg, mesh)
  o_abs = opt_state_target(tx, p_abs, mesh, spec)
  p_sh, o_sh = shardings(p_abs), shardings(o_abs)
  step = jax.jit(step_lib.make_train_step(spec, mesh, tx), donate_argnums=(0, 1),
                 out_shardings=(p_sh, o_sh, None))
  if abstract:
    b_sh = step_lib.batch_sharding(mesh)
    return step, (p_abs, o_abs), lambda tokens: jax.ShapeDtypeStruct(
        tokens.shape, tokens.dtype, sharding=b_sh), mesh
  params, opt_state = fresh_state(spec, mesh, tx, o_abs, seed=0)
  return step, (params, opt_state), lambda tokens: global_batch(tokens, mesh), mesh


def run_layout(layout, args, cfg, tx, corpus, step_until):
  """Compiles both variants, then steps them interleaved until `args.steps` or the time
  `step_until(compile_s)` returns (an absolute perf_counter deadline)."""
  from taco_jax import data
  from taco_jax.plan import CompressionPlan

  dp, pp, tp = layout
  tokens_at = lambda i: data.batch_at(corpus, i, seed=0, batch_size=args.batch,  # noqa: E731
                                     seq_len=args.seq)
  runs = {}
  for name, plan in (("off", CompressionPlan()), ("on", compression_plan(args))):
    step, state, batch, mesh = build_step(layout, args, cfg, tx, plan)
    t0 = time.perf_counter()
    exe = step.lower(*state, batch(tokens_at(0))).compile()
    runs[name] = dict(exe=exe, state=state, compile_s=time.perf_counter() - t0,
                      batch=batch, plan=plan, **comm_record(exe.as_text(), mesh))
  t_end = step_until(sum(r["compile_s"] for r in runs.values()))
  failed = step_interleaved(runs, tokens_at, args, t_end)
  if failed:  # off and on are a pair: one alone compares nothing
    raise RuntimeError(f"layout {dp},{pp},{tp}: {failed}")
  m = args.microbatches if pp > 1 else 1
  return [dict(layout=f"{dp},{pp},{tp}", dp=dp, pp=pp, tp=tp, microbatches=m, compression=name,
               plan=dataclasses.asdict(r["plan"]), **timing_record(r, args))
          for name, r in runs.items()]


def step_interleaved(runs: dict, tokens_at, args, t_end: float) -> dict[str, str]:
  """Steps every run on the same batches, in turns of `args.steps_per_turn` steps per run
  (the runs' order rotating every turn), until `args.steps` or (after warm-up) `t_end`.

  Within a turn the steps are dispatched back to back, as the trainer runs them (it
  fetches its metrics every `log_every` steps): each step after the first is timed from
  the previous step's completion to its own, so the host's dispatch of a step runs while
  the device computes the one before. `r["times"]` holds those intervals; `r["synced"]`
  the turn's first step, dispatch to completion (host overhead included, the timing of
  results before 2026-11-23). With one step per turn, `times` is that too.

  A run holds `exe` (compiled step), `state` (params, opt_state) and `batch` (tokens ->
  the program's input). A run whose step fails on the device (e.g. out of memory beside
  the others) is taken out of `runs`, freeing its buffers, and the rest go on; returns
  {name: error} of those."""
  from taco_jax.train.metrics import device_peak_bytes
  import jax
  names, failed, k = list(runs), {}, max(1, args.steps_per_turn)
  for r in runs.values():
    r["times"], r["synced"], r["losses"] = [], [], []
  timed = 0  # step times each run has so far
  for turn, first in enumerate(range(0, args.steps, k)):
    if not names:
      break
    tokens = [tokens_at(i) for i in range(first, min(first + k, args.steps))]
    timed += max(len(tokens) - 1, 1)
    for name in names[turn % len(names):] + names[:turn % len(names)]:
      r = runs[name]
      try:
        done, state = _turn(r, [r["batch"](t) for t in tokens])
      except jax.errors.JaxRuntimeError as e:
        failed[name] = f"{type(e).__name__} at step {first}: {str(e)[:2000]}"
        print(f"{name}: {failed[name][:300]}", flush=True)
        names.remove(name)
        del runs[name]
        continue
      r["synced"].append(done[1] - done[0])
      r["times"].extend([b - a for a, b in zip(done[1:], done[2:])] or r["synced"][-1:])
      if turn == 0:  # memory_stats: the process's peak so far (None on CPU)
        r["device_peak_bytes"] = device_peak_bytes()
      r["state"] = state
    if time.perf_counter() > t_end and timed > args.warmup + 2:
      break
  return failed


def _turn(r: dict, batches: list):
  """One run's steps on `batches`, each dispatched before the previous one's loss is read:
  ([dispatch of the first, completion of each step...], the state after the last). The
  losses go to r["losses"]."""
  import jax
  state, pending, done = r["state"], None, [time.perf_counter()]
  for b in batches:
    params, opt_state, met = r["exe"](*state, b)
    state = (params, opt_state)
    if pending is not None:
      r["losses"].append(float(jax.block_until_ready(pending)))
      done.append(time.perf_counter())
    pending = met["loss"]
  r["losses"].append(float(jax.block_until_ready(pending)))
  done.append(time.perf_counter())
  return done, state


def timing_record(r: dict, args) -> dict:
  """Step-time statistics (median after warm-up), tokens/s and the loss of a stepped run."""
  timed = r["times"][args.warmup:] or r["times"]
  med = statistics.median(timed)
  synced = r["synced"][1:] or r["synced"]  # the first turn's includes the first run
  return dict(steps=len(r["losses"]), compile_s=r["compile_s"], step_ms=med * 1e3,
              step_ms_min=min(timed) * 1e3, step_ms_max=max(timed) * 1e3,
              step_ms_synced=statistics.median(synced) * 1e3,
              tokens_per_s=args.batch * args.seq / med, step_times_s=r["times"],
              loss_curve=r["losses"], final_loss=statistics.fmean(r["losses"][-10:]),
              comm_bytes_static=r["comm_static"], comm_ops=r["comm_ops"])


def bench_setup(args):
  """What the end-to-end benchmarks share: the (dp, pp, tp) layouts (checked against the
  devices), the training corpus, the bf16 matmul ceiling, and `step_until(left_after,
  compile_s)`: the wall-clock time until which the current layout may step, its share of
  what is left of `args.deadline_s` after reserving the later layouts' compiles."""
  import jax
  from benchmarks import common
  from taco_jax import data
  layouts = [tuple(int(v) for v in s.split(",")) for s in args.layouts.split(";") if s]
  n = jax.device_count()
  bad = [lay for lay in layouts if lay[0] * lay[1] * lay[2] != n]
  if bad:
    raise SystemExit(f"layouts {bad} do not multiply to the {n} devices")
  corpus = data.load_corpus("", cache_dir=tempfile.gettempdir(),
                            max_corpus_bytes=8_000_000).train
  ceiling = common.matmul_rate(256 if args.smoke else 8192, samples=3 if args.smoke else 20)
  t0, compile_est = time.perf_counter(), [0.0]

  def step_until(left_after, compile_s):
    compile_est[0] = max(compile_est[0], compile_s)
    now = time.perf_counter()
    left = t0 + args.deadline_s - now - compile_est[0] * left_after
    return now + max(left, 0.0) / (left_after + 1)

  return layouts, corpus, ceiling, step_until


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  import jax
  from benchmarks import common
  from taco_jax.models.decoder import flops_per_token

  cfg, tx = model_and_optimizer(args, remat=args.remat)
  t0 = time.perf_counter()
  layouts, corpus, ceiling, step_until = bench_setup(args)
  n = jax.device_count()
  fpt = flops_per_token(cfg, args.seq)
  env = common.environment()
  rows = []
  for k, lay in enumerate(layouts):
    until = lambda c, k=k: step_until(len(layouts) - k - 1, c)
    for r in run_layout(lay, args, cfg, tx, corpus, until):
      r["mfu"] = common.mfu(r["tokens_per_s"], fpt, n, env["device_kind"])
      r["mfu_of_measured"] = r["tokens_per_s"] * fpt / (n * ceiling["tflops"] * 1e12)
      rows.append(r)
      print(f"{r['layout']:>7s} {r['compression']:>3s}: {r['step_ms']:8.2f} ms/step "
            f"{r['tokens_per_s']:10.0f} tok/s  loss {r['final_loss']:.4f}", flush=True)
  for r in rows:
    base = next(b for b in rows if b["layout"] == r["layout"] and b["compression"] == "off")
    r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    r["accuracy_cost"] = (r["final_loss"] - base["final_loss"]) / base["final_loss"]
  report = dict(benchmark="train_parallel", label=args.label, device=env["device_kind"],
                num_devices=n, jax_version=jax.__version__, date=env["date"],
                timing=TIMING,
                env=common.run_env(),
                config=dict(vars(args), model_cfg=dataclasses.asdict(cfg),
                            flops_per_token=fpt),
                environment=env, ceilings=dict(matmul_bf16=ceiling), results=rows,
                wall_s=time.perf_counter() - t0)
  path = results_path("train_parallel", args, num_devices=n, platform=env["platform"],
                      date=env["date"])
  path.write_text(json.dumps(report, indent=1))
  print(f"{args.model} GPT, seq {args.seq}, batch {args.batch}, {n}x {env['device_kind']}, "
        f"bf16 matmul ceiling {ceiling['tflops']:.0f} TFLOP/s")
  print(common.table(rows, ["layout", "compression", "steps", "compile_s", "step_ms",
                            "tokens_per_s", "speedup", "mfu", "final_loss", "accuracy_cost"]))
  print(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
