"""3D-parallel trainer, run by `python -m taco_jax.train --config=configs/parallel_tiny.py`
(`python -m taco_jax.train.trainer` is an alias) for every config that needs it.

Same data, optimizer schedule, metrics, checkpoints and step loop
(`taco_jax.train.runner.run_steps`) as the single-device trainer (`taco_jax.train`, imported,
not copied); the step is `taco_jax.tp.step`. Params and optimizer state are global
jax.Arrays with NamedShardings, so a checkpoint written on one mesh resumes on another (orbax
reshards on restore). Started as one of several processes
(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or parallel.distributed),
it calls `jax.distributed.initialize()` first; each process feeds its own batch shards.
"""
from __future__ import annotations

import pathlib
import time

import jax
import numpy as np
import optax
from tqdm import tqdm

from taco_jax.models.decoder import flops_per_token
from taco_jax import collectives, data
from taco_jax.tp import mesh as mesh_lib, layout as layout_lib, step as step_lib
from taco_jax.plan import describe_plan, plan_from_config
from taco_jax.train import checkpoint, metrics, optim
from taco_jax.train.config import validate_config
from taco_jax.train.loop import load_data, store_config
from taco_jax.train.runner import (corpus_line, finished_summary, run_header, run_steps,
                                   start_message)


def validate(config, n_devices: int | None = None) -> None:
  """Raises ValueError naming every bad field: the shared checks, model block, parallel
  layout (against `n_devices`, or the running devices if None) and compression sections."""
  errs = []
  try:
    validate_config(config)  # the model section too (models.model_config)
  except ValueError as e:  # "invalid config:\n  a\n  b" -> [a, b]
    errs += [line.strip() for line in str(e).splitlines()[1:]] or [str(e)]
  try:
    plan_from_config(config.compression)
  except (TypeError, ValueError) as e:
    errs.append(str(e))
  if n_devices is None:
    n_devices = jax.device_count()
  errs += mesh_lib.parallel_errors(config, n_devices, jax.local_device_count()
                                   if n_devices == jax.device_count() else None)
  if errs:
    raise ValueError("invalid config:\n  " + "\n  ".join(errs))


def spec_from_config(config) -> step_lib.ParallelSpec:
  p = config.parallel
  return step_lib.ParallelSpec(layout_lib.model_config(config.model), p.dp, p.pp, p.tp,
                               p.get("microbatches", 1), plan_from_config(config.compression),
                               schedule=p.get("schedule", "gpipe"),
                               virtual_stages=p.get("virtual_stages", 1),
                               tp_overlap=p.get("tp_overlap", "none"),
                               interleave=p.get("interleave", 1),
                               save_tp_outputs=bool(p.get("save_tp_outputs", False)),
                               save_dots=bool(p.get("save_dots", False)))


def make_optimizer(optim_cfg, total_steps: int) -> optax.GradientTransformation:
  """`taco_jax.train.optim`'s AdamW, with a decay mask that knows stacked layer params."""
  return optim.make_optimizer(optim_cfg, total_steps, decay_mask=layout_lib.decay_mask)


def opt_state_target(tx, params_target, mesh):
  """ShapeDtypeStructs of tx.init(params) on `mesh`: moments sharded like their params,
  everything else (step counts) replicated."""
  shapes = jax.eval_shape(tx.init, params_target)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(
      tx, lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding), shapes,
      params_target, transform_non_params=lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=rep))


def global_batch(tokens_BT1: np.ndarray, mesh) -> jax.Array:
  """The global batch as a jax.Array sharded over "data"; each process fills its shards."""
  sharding = step_lib.batch_sharding(mesh)
  return jax.make_array_from_callback(tokens_BT1.shape, sharding, lambda i: tokens_BT1[i])


def train(config, workdir) -> dict:
  """Trains (or resumes, on any mesh) per `config` in `workdir`; returns a summary dict."""
  mesh_lib.maybe_initialize_distributed(config)
  validate(config)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  d, t, lead = config.data, config.train, jax.process_index() == 0
  mesh, spec = mesh_lib.mesh_from_config(config), spec_from_config(config)
  corpus = load_data(config)
  ckpt = checkpoint.Checkpoints(workdir, keep=t.keep_checkpoints)
  start = ckpt.latest_step() or 0
  if lead:
    store_config(config, workdir, has_checkpoint=start > 0)
  if start >= t.steps:
    ckpt.close()
    if lead:
      tqdm.write(f"{config.name}: {start_message(workdir, start, t.steps)}")
    return finished_summary(workdir, start)
  tx = make_optimizer(config.optim, t.steps)
  p_abs = layout_lib.abstract_params(spec.cfg, mesh)
  o_abs = opt_state_target(tx, p_abs, mesh)
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  n_params = sum(x.size for x in jax.tree.leaves(p_abs))
  if lead:
    tqdm.write(run_header(config.name, n_params, workdir, dict(mesh.shape)))
  if start:
    params, opt_state, _ = ckpt.restore(start, p_abs, o_abs)
    if lead:
      tqdm.write(start_message(workdir, start, t.steps))
  else:
    params = layout_lib.init_params(spec.cfg, mesh, config.seed)
    opt_state = jax.jit(tx.init, out_shardings=shardings(o_abs))(params)
  batch = lambda i, s=0, src=corpus.train: global_batch(data.batch_at(
      src, i, seed=config.seed, stream=s, batch_size=d.batch_size, seq_len=d.seq_len), mesh)
  xla = step_lib.compiler_options(spec.interleave)
  train_step = jax.jit(step_lib.make_train_step(spec, mesh, tx), donate_argnums=(0, 1),
                       out_shardings=(shardings(p_abs), shardings(o_abs), None),
                       compiler_options=xla)
  eval_step = jax.jit(step_lib.make_eval_step(spec, mesh), compiler_options=xla)
  t0 = time.perf_counter()
  with collectives.recording_decisions() as decisions:  # compiled now: out of the throughput
    lowered = train_step.lower(params, opt_state, batch(start))
  train_step = lowered.compile()
  fpt, tok = flops_per_token(spec.cfg, d.seq_len), d.batch_size * d.seq_len
  summary = dict(workdir=str(workdir), start_step=start, n_params=n_params, mesh=dict(
      mesh.shape), attention=spec.cfg.attention_backend(d.seq_len),
                 compile_s=time.perf_counter() - t0, train_loss=None, val_loss=None,
                 tokens_per_s=None, mfu=None,
                 compressed_messages=collectives.decision_summary(decisions))
  if lead:
    tqdm.write(f"  {corpus_line(corpus)}, {summary['attention']} attention, compression "
               f"{describe_plan(spec.plan)}; step compiled in {summary['compile_s']:.1f}s")
    _report_plain_messages(summary["compressed_messages"])
  writer = metrics.MetricsWriter(workdir, start) if lead else None
  pbar = tqdm(total=t.steps, initial=start, disable=not t.progress_bar, dynamic_ncols=True,
              desc=config.name) if lead else None
  peak = metrics.configured_peak(t, jax.devices()[0].device_kind)
  # A second Ctrl-C is not caught: a process of a multi-process run must not save alone.
  run_steps(params, opt_state, start=start, train_cfg=t, train_step=train_step,
            eval_step=eval_step, train_batch=batch, val_batch=lambda i: batch(i, 1, corpus.val),
            ckpt=ckpt, checkpoint_meta=lambda s: {"step": s, "mesh": dict(mesh.shape)},
            schedule=optim.lr_schedule(config.optim, t.steps), tokens_per_step=tok,
            mfu=lambda tps: metrics.mfu(tps, fpt, peak, mesh.size), summary=summary,
            writer=writer, pbar=pbar, model_dtype=config.model.dtype,
            evaluate_when_interrupted=True, save_on_second_interrupt=False)
  if lead:
    metrics.write_summary(workdir / "summary.json", summary)
  return summary


def _report_plain_messages(by_collective: dict) -> None:
  """Says which messages a codec was configured for but went plain (below ``min_bytes``
  or the size measured to pay on the link, ``CompressionConfig.link``), so that a
  configured compression that does nothing on this machine is not silent."""
  plain = {c: r for c, r in by_collective.items() if r["plain"]}
  if plain:
    tqdm.write("sent plain, below the size from which compression pays (compression.*.link / "
               "min_bytes): " + "; ".join(
                   f"{r['plain']} of {r['plain'] + r['compressed']} {c} call sites (up to "
                   f"{r['plain_max_bytes'] / 2**20:.2f} MiB per device)"
                   for c, r in plain.items()))


def main(argv=None):
  """Alias of `python -m taco_jax.train` (which picks this trainer when the config needs it)."""
  from taco_jax.train.cli import run
  run(argv)


if __name__ == "__main__":
  main()
