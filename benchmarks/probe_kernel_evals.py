"""Why the kernel layers' evaluations return NaN: one compiled evaluation, asked several ways.

`bench_accuracy`'s kernel run (`on_all_cm`: every TP message in FP8 through the fused
collective-matmul kernels) returned a NaN validation loss in 50 of 125 evaluations on
2xH200 while its training steps stayed finite (docs/parallel.md, "NaN in the kernels'
evaluations"). This trains that configuration with the kernel step and, every `--every`
steps, evaluates the same parameters on the same `--batches` validation batches these ways:

  behind_step    dispatched right behind the training step that made the parameters,
                 before anything waits for it, then the losses fetched;
  behind_step_one_by_one   (every other evaluation, instead) behind the step too, but each
                 batch's loss fetched before the next is dispatched: one call queued at most;
  trainer_order  the trainer's (`runner`): once the step has finished, each batch made (copied
                 to the GPUs) just before its call, then the losses fetched;
  trainer_order_kept    the same, every batch held until the losses are fetched (none is
                 freed, so no batch's memory is reused by the next one's copy);
  trainer_order_synced  the same, each batch's copy waited for before its call (no copy to
                 the GPUs runs beside a kernel);
  back_to_back   the same from batches made beforehand;
  again          the same, once more: a loss that changes between identical calls is a race;
  one_by_one     each batch's loss fetched before the next is dispatched;
  collectives    through XLA's collectives with the same codecs (how the trainer evaluated
                 kernel runs until the kernels' evaluations were confirmed);
  behind_other   every batch queued behind a long computation without kernels (matmuls on
                 every GPU, about a training step long): a queue without the step.

Found on 2026-11-26: `trainer_order` (and `trainer_order_kept`) returned NaN in 16 of 190
evaluations, every other way in none; compiled without CUDA graphs
(`XLA_FLAGS=--xla_gpu_enable_command_buffer=`), none in 74, and later none in 360 over
every way; with CUDA graphs for all but the kernels (``--graphs fusions``), none in 360
(the trainer's since 2026-11-27, `step.KERNEL_XLA_OPTIONS`). The evaluation is compiled
with the trainer's options (`config.compiler_options`); ``--graphs none`` compiles no graph,
``--graphs all`` graphs for the kernels too (as before 2026-11-26). The probe also
records how the compiled training and evaluation steps hand each Mosaic GPU kernel its
zeroed scratch (the semaphores; `kernel_scratch`). With ``--step-check N`` it first asks
the same of the training step: N steps from one fresh state, fed three ways
(``STEP_WAYS``) twice each, compared bit for bit (`step_check`).

Results: benchmarks/results/probe_kernel_evals_<label>_<n><kind>_<date>.json, per
evaluation the losses of each way (NaN as null) and a summary.

GPU, 2 GPUs (120 steps by default; gpu_suite's probe_evals runs 200 in <= 7 minutes):
  python -m benchmarks.probe_kernel_evals --label nvlink
CPU smoke test (8 fake devices, tiny model; the kernels fall back to XLA there):
  python -m benchmarks.probe_kernel_evals --smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import add_output_args, parse_with_smoke, start_watchdog, write_report
from benchmarks.bench_accuracy import REPO, configure, load_config

# right behind the training step, on alternate evaluations; then, once it has finished:
BEHIND_STEP = ("behind_step", "behind_step_one_by_one")
AFTER_STEP = ("trainer_order", "trainer_order_kept", "trainer_order_synced", "back_to_back",
              "again", "one_by_one", "collectives", "behind_other")
WAYS = BEHIND_STEP + AFTER_STEP
GRAPHS = ("fusions", "none", "all")  # --graphs: step.KERNEL_GRAPHS' keys (no jax import yet)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=str(REPO / "configs" / "gpt_125m_tp4.py"))
  p.add_argument("--tp", type=int, default=2)
  p.add_argument("--steps", type=int, default=120, help="training steps")
  p.add_argument("--every", type=int, default=4, help="evaluate every this many steps")
  p.add_argument("--batches", type=int, default=16, help="validation batches per evaluation")
  p.add_argument("--corpus", default="python", help="python | embedded | a data.path")
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--ways", default=",".join(WAYS),
                 help="comma-separated ways to evaluate (default: every one)")
  p.add_argument("--step-check", type=int, default=0,
                 help="first train this many steps from the same fresh state each way of "
                      "STEP_WAYS, twice, and compare losses and parameters bit for bit")
  p.add_argument("--deadline-s", type=float, default=None,
                 help="stop training after this many seconds and report what was evaluated")
  p.add_argument("--graphs", default="fusions", choices=GRAPHS,
                 help="the kernel layers' CUDA graphs: fusions (XLA's fusions and library "
                      "calls only: the trainer's), none, or all (as before 2026-11-26)")
  add_output_args(p, label="nvlink", smoke="CPU, 8 fake devices, tiny model")
  args = parse_with_smoke(p, argv, dict(config=str(REPO / "configs" / "parallel_tiny.py"),
                                        tp=4, steps=4, every=2, batches=2,
                                        corpus="embedded", label="smoke"))
  if unknown := set(args.ways.split(",")) - set(WAYS):
    p.error(f"--ways: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WAYS)}")
  return args


def finite_or_none(losses) -> list:
  return [float(x) if math.isfinite(float(x)) else None for x in losses]


def summarize(evals: list[dict]) -> dict:
  """Per way: of the evaluations it ran in, those with a NaN (a null loss) and the batches
  that had one; and the evaluations whose back-to-back losses changed between the two
  identical calls."""
  out = {}
  for way in WAYS:
    ran = [e for e in evals if way in e]
    bad = [e for e in ran if None in e[way]]
    out[way] = dict(evaluations_with_nan=len(bad), of=len(ran),
                    batches_with_nan=sorted({i for e in bad
                                             for i, x in enumerate(e[way]) if x is None}))
  out["calls_that_differ"] = [e["step"] for e in evals
                              if "again" in e and e["back_to_back"] != e["again"]]
  return out


# how the training steps are fed, for --step-check: each batch made just before its step and
# nothing waited for (the runner's order); every batch made (and copied) before the first
# step; each step's loss fetched before the next batch is made
STEP_WAYS = ("trainer_order", "premade", "one_by_one")


def step_check(train, fresh, batch, steps: int) -> dict:
  """Trains ``steps`` steps from the same fresh state (``fresh()``) each way of
  ``STEP_WAYS``, twice, and compares every run with the first one-by-one run: a run that
  differs where the two one-by-one runs agree was fed in an order that changed what the
  kernels computed."""
  import jax
  import numpy as np

  def run(way):
    params, opt_state = fresh()
    made = jax.block_until_ready([batch(i) for i in range(steps)]) if way == "premade" else None
    losses = []
    for i in range(steps):
      params, opt_state, m = train(params, opt_state, made[i] if made else batch(i))
      losses.append(m["loss"])
      if way == "one_by_one":
        jax.block_until_ready(m["loss"])
    return np.asarray(jax.device_get(losses), np.float64), jax.device_get(params)

  runs = {f"{way}_{k}": run(way) for k in range(2) for way in STEP_WAYS}
  ref_losses, ref_params = runs["one_by_one_0"]
  out = {}
  for name, (losses, params) in runs.items():
    differs = np.flatnonzero(losses != ref_losses)
    out[name] = dict(
        losses_equal=bool(differs.size == 0),
        first_step_that_differs=int(differs[0]) + 1 if differs.size else None,
        nonfinite_losses=int(np.sum(~np.isfinite(losses))),
        final_loss=float(losses[-1]),
        params_equal=all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(params), jax.tree.leaves(ref_params))))
  return dict(steps=steps, against="one_by_one_0", runs=out)


def busy_work(mesh, small: bool):
  """A function that queues, on every device of ``mesh``, tens of milliseconds of matmuls
  (a few on CPU) with no collective and no kernel of ours, and returns without waiting."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  n, reps = (64, 2) if small else (4096, 200)
  x = jax.device_put(jnp.full((n, n), 1 / n, jnp.bfloat16), NamedSharding(mesh, P()))
  step = jax.jit(lambda y: jax.lax.fori_loop(0, reps, lambda i, z: jnp.tanh(z @ z), y))
  step(x).block_until_ready()  # compiled now, not while timing the queue
  return lambda: step(x)


def scratch_summary(hlo_text: str) -> dict:
  """How a compiled step's kernels get their zeroed scratch (semaphores): the kernels, the
  opcodes that make their scratch, the most instructions that read one scratch, and the
  opcodes of every reader."""
  from taco_jax.testing import hlo
  rows = hlo.kernel_scratch_inputs(hlo_text)
  producers: dict[str, int] = {}
  for r in rows:
    producers[r["producer"]] = producers.get(r["producer"], 0) + 1
  return dict(kernels=len(rows), producers=producers,
              most_readers=max((len(r["reader_ops"]) for r in rows), default=0),
              reader_ops=sorted({op for r in rows for op in r["reader_ops"]}))


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  start_watchdog()
  import jax
  import numpy as np
  from benchmarks import common
  from taco_jax.tp import fused, step as step_lib
  from taco_jax.train import trainer
  from taco_jax.train.config import compiler_options, validate

  root = pathlib.Path(tempfile.mkdtemp(prefix="taco_probe_"))
  accuracy_args = argparse.Namespace(corpus=args.corpus, seed=args.seed, steps=args.steps,
                                     eval_every=0, smoke=args.smoke, tp=args.tp)
  config = configure(load_config(args.config), accuracy_args, "on_all_cm", root)
  validate(config)
  mesh, spec, tx, p_abs, o_abs = trainer.run_parts(config)  # tx over train.steps = --steps
  corpus = trainer.load_data(config)
  params, opt_state = trainer.fresh_state(spec, mesh, tx, o_abs, config.seed)
  batch = trainer.batches(config, corpus, mesh)
  val_batch = lambda i: batch(i, 1, corpus.val)  # noqa: E731 (the runner's val_batch)
  val = [val_batch(i) for i in range(args.batches)]
  t0 = time.perf_counter()
  xla = compiler_options(config, kernel_graphs=args.graphs) or None
  train = jax.jit(step_lib.make_train_step(spec, mesh, tx), donate_argnums=(0, 1),
                  out_shardings=(trainer.shardings(p_abs), trainer.shardings(o_abs), None)
                  ).lower(params, opt_state, batch(0)).compile(xla)
  evaluate = {way: jax.jit(step_lib.make_eval_step(
      dataclasses.replace(spec, tp_overlap="none") if way == "collectives" else spec, mesh)
      ).lower(params, val[0]).compile(xla) for way in ("kernels", "collectives")}
  scratch = {name: scratch_summary(exe.as_text())
             for name, exe in (("train", train), ("evaluate", evaluate["kernels"]))}
  print(f"kernels' scratch inputs: {scratch}", flush=True)

  busy = busy_work(mesh, small=args.smoke)
  steps_checked = None
  if args.step_check:
    steps_checked = step_check(
        train, lambda: trainer.fresh_state(spec, mesh, tx, o_abs, config.seed), batch,
        args.step_check)
    print("step check: " + "; ".join(
        f"{name} losses {'=' if r['losses_equal'] else '!='} (first at "
        f"{r['first_step_that_differs']}), params {'=' if r['params_equal'] else '!='}"
        for name, r in steps_checked["runs"].items()), flush=True)

  def losses(way):
    f = evaluate["collectives" if way == "collectives" else "kernels"]
    if way.endswith("one_by_one"):
      return finite_or_none([np.asarray(f(params, b)) for b in val])
    if way == "behind_other":
      busy()
    if way.startswith("trainer_order"):  # as the runner: each batch made just before its call
      made = []

      def kept(i):  # held until the losses are fetched
        made.append(val_batch(i))
        return made[-1]
      feed = dict(trainer_order=val_batch, trainer_order_kept=kept,
                  trainer_order_synced=lambda i: jax.block_until_ready(val_batch(i)))[way]
      return finite_or_none(jax.device_get([f(params, feed(i))
                                            for i in range(args.batches)]))
    return finite_or_none(jax.device_get([f(params, b) for b in val]))

  ways = args.ways.split(",")
  behind_ways = [w for w in BEHIND_STEP if w in ways]
  after_ways = [w for w in AFTER_STEP if w in ways]
  evals = []
  for s in range(1, args.steps + 1):
    if args.deadline_s and time.perf_counter() - t0 > args.deadline_s:
      print(f"deadline: stopped before step {s}", flush=True)
      break
    params, opt_state, m = train(params, opt_state, batch(s - 1))
    if s % args.every == 0:
      # at most one way behind the step, before anything has waited for it: they alternate
      got = {w: losses(w) for w in behind_ways[len(evals) % 2:][:1]}
      evals.append(dict(step=s, train_loss=float(m["loss"]), **got,
                        **{way: losses(way) for way in after_ways}))
      bad = [w for w in WAYS if None in evals[-1].get(w, ())]
      print(f"step {s}: train loss {evals[-1]['train_loss']:.4f}; NaN in "
            f"{', '.join(bad) or 'none'}", flush=True)
  env = common.environment()
  report = dict(benchmark="probe_kernel_evals", label=args.label, device=env["device_kind"],
                num_devices=jax.device_count(), platform=env["platform"], date=env["date"],
                jax_version=jax.__version__, config=dict(vars(args)), environment=env,
                mesh=dict(mesh.shape), kernel_fallbacks=fused.fallbacks(),
                kernel_scratch=scratch, step_check=steps_checked,
                wall_s=time.perf_counter() - t0, evaluations=evals, summary=summarize(evals))
  lines = [f"{way}: NaN in {r['evaluations_with_nan']} of {r['of']} evaluations (batches "
           f"{r['batches_with_nan']})" for way, r in report["summary"].items()
           if way in WAYS]
  lines.append(f"identical calls that differ: {report['summary']['calls_that_differ']}")
  return write_report("probe_kernel_evals", args, report, "\n".join(lines))


if __name__ == "__main__":
  main()
