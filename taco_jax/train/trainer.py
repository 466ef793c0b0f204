"""The trainer: `train(config, workdir) -> summary`, for every config and mesh.

Run by `python -m taco_jax.train --config=...`. One device is the mesh (1, 1, 1): the same
step (`taco_jax.tp.step`), loop (`runner.run_steps`), progress output and checkpoint layout
as on any (data, pipeline, tensor) mesh.

Order of work: validate the config (every error before anything is built or compiled), load
and check the data, store config.json, build or restore (params, opt_state), compile the
step (after the link policy, `link_policy`: which messages pay for compression on this
mesh), then loop. Batch i is `data.batch_at(train_tokens, i, seed=config.seed, ...)`, so a
run resumed from a checkpoint at step k continues with exactly the batches (and losses) of
an uninterrupted one. Params and optimizer state are global jax.Arrays with NamedShardings, so a
checkpoint written on one mesh resumes on another (orbax reshards on restore). Started as
one of several processes (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or
parallel.distributed), it calls `jax.distributed.initialize()` first; each process feeds its
own batch shards. The step is compiled with `config.compiler_options` (parallel.interleave,
xla_overlap, collectives_in_flight); with parallel.pgle it is a `pgle.ProfileGuidedStep`,
compiled again from a profile of the run's first steps (cached in <workdir>/pgle).
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from tqdm import tqdm

from taco_jax import collectives, data, link_probe
from taco_jax.models.decoder import flops_per_token
from taco_jax.plan import describe_plan
from taco_jax.tp import layout as layout_lib, mesh as mesh_lib, step as step_lib, zero
from taco_jax.train import checkpoint, link_policy, metrics, optim, pgle
from taco_jax.train.config import (compiler_options, devices, parallel_spec, store_config,
                                   validate)
from taco_jax.train.runner import (NonFiniteLossError, Steps, corpus_line,  # noqa: F401
                                   finished_summary, run_header, run_steps, start_message)


def load_data(config) -> data.Corpus:
  """The config's corpus, checked against its sequence length and vocabulary."""
  d = config.data
  corpus = data.load_corpus(d.path, cache_dir=d.cache_dir or data.default_cache_dir(),
                            val_fraction=d.val_fraction, max_corpus_bytes=d.max_corpus_bytes,
                            bin_dtype=d.bin_dtype, include=d.include)
  data.check_corpus(corpus, seq_len=d.seq_len, vocab_size=config.model.vocab_size)
  return corpus


def make_optimizer(optim_cfg, total_steps: int) -> optax.GradientTransformation:
  """`taco_jax.train.optim`'s AdamW, with a decay mask that knows stacked layer params."""
  return optim.make_optimizer(optim_cfg, total_steps, decay_mask=layout_lib.decay_mask)


def opt_state_target(tx, params_target, mesh, spec=None):
  """ShapeDtypeStructs of the optimizer state on `mesh`: moments sharded like their params,
  everything else (step counts) replicated. With `spec.shard_optimizer` the moments are
  sharded over "data" as well, and the master weights come with them where the step keeps
  them (`taco_jax.tp.zero`)."""
  sharded = spec is not None and spec.shard_optimizer
  like = zero.state_target(spec, params_target, mesh) if sharded else params_target
  shapes = jax.eval_shape(tx.init, like)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tx_state = optax.tree_map_params(
      tx, lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding), shapes,
      like, transform_non_params=lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=rep))
  return zero.opt_state(spec, tx_state, like) if sharded else tx_state


def shardings(tree):
  """The shardings of `tree`'s leaves (arrays or ShapeDtypeStructs), as a tree."""
  return jax.tree.map(lambda x: x.sharding, tree)


def fresh_state(spec, mesh, tx, opt_target, seed: int) -> tuple:
  """A new run's (params, optimizer state) on `mesh`, the state laid out as `opt_target`
  (`opt_state_target`) says."""
  params = layout_lib.init_params(spec.cfg, mesh, seed)
  return params, jax.jit(zero.init(spec, tx), out_shardings=shardings(opt_target))(params)


def batches(config, corpus: data.Corpus, mesh):
  """``batch(i, stream=0, split=corpus.train)``: the run's global batch i of that stream of
  the split, sharded over "data" (`global_batch`); stream 1 of ``corpus.val`` validates."""
  d = config.data
  return lambda i, stream=0, split=corpus.train: global_batch(data.batch_at(
      split, i, seed=config.seed, stream=stream, batch_size=d.batch_size,
      seq_len=d.seq_len), mesh)


def memory_line(params, opt_state, spec) -> str:
  """'memory per device: params 1.00 MiB, optimizer state 0.50 MiB (sharded over data)'."""
  mib = lambda tree: zero.bytes_per_device(tree) / 2**20
  how = 'sharded over data' if spec.shard_optimizer and spec.dp > 1 else 'replicated over data'
  return (f'memory per device: params {mib(params):.2f} MiB, optimizer state '
          f'{mib(opt_state):.2f} MiB ({how})')


def global_batch(tokens_BT1: np.ndarray, mesh) -> jax.Array:
  """The global batch as a jax.Array sharded over "data"; each process fills its shards."""
  sharding = step_lib.batch_sharding(mesh)
  return jax.make_array_from_callback(tokens_BT1.shape, sharding, lambda i: tokens_BT1[i])


class RunParts(NamedTuple):
  """What every compiled run of a config starts from: the trainer's, calibration's
  (`apps.calibrate.capture`) and the GPU probes'."""
  mesh: jax.sharding.Mesh
  spec: step_lib.ParallelSpec
  tx: optax.GradientTransformation
  p_abs: Any  # the parameters' abstract values, with their shardings
  o_abs: Any  # the optimizer state's (`opt_state_target`)


def run_parts(config) -> RunParts:
  """``config``'s mesh, layout, optimizer (its schedule over ``train.steps``) and the
  abstract sharded state the training step takes."""
  p = config.parallel
  mesh, spec = mesh_lib.make_mesh(p.dp, p.pp, p.tp, devices(config)), parallel_spec(config)
  tx = make_optimizer(config.optim, config.train.steps)
  p_abs = layout_lib.abstract_params(spec.cfg, mesh)
  return RunParts(mesh, spec, tx, p_abs, opt_state_target(tx, p_abs, mesh, spec))


def train(config, workdir) -> dict:
  """Trains (or resumes, on any mesh) per `config` in `workdir`; returns a summary dict."""
  mesh_lib.maybe_initialize_distributed(config)
  validate(config)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  d, t, lead = config.data, config.train, jax.process_index() == 0
  p = config.parallel
  ckpt = checkpoint.Checkpoints(workdir, keep=t.keep_checkpoints)
  start = ckpt.latest_step() or 0
  if lead:
    store_config(config, workdir, has_checkpoint=start > 0)
  if start >= t.steps:  # nothing to build: no mesh, no state, no data
    ckpt.close()
    if lead:
      tqdm.write(f'{config.name}: {start_message(workdir, start, t.steps)}')
    return finished_summary(workdir, start)
  mesh, spec, tx, p_abs, o_abs = run_parts(config)
  corpus = load_data(config)
  if lead and config.compression.enabled and mesh.size == 1:
    print('note: compression.enabled has no effect on one device (nothing is sent)',
          file=sys.stderr)
  n_params = sum(x.size for x in jax.tree.leaves(p_abs))
  if lead:
    tqdm.write(run_header(config.name, n_params, workdir, dict(mesh.shape)))
  if start:
    params, opt_state = checkpoint.restore_state(ckpt, start, spec.cfg, p_abs, o_abs, tx)
    if lead:
      tqdm.write(start_message(workdir, start, t.steps))
  else:
    params, opt_state = fresh_state(spec, mesh, tx, o_abs, config.seed)
  batch = batches(config, corpus, mesh)
  xla = compiler_options(config)

  def lower(spec):  # (train step lowered, eval step, the decisions of the train step)
    step = jax.jit(step_lib.make_train_step(spec, mesh, tx), donate_argnums=(0, 1),
                   out_shardings=(shardings(p_abs), shardings(o_abs), None))
    with collectives.recording_decisions() as decisions:
      lowered = step.lower(params, opt_state, batch(start))
    evaluate = jax.jit(step_lib.make_eval_step(spec, mesh), compiler_options=xla)
    return lowered, evaluate, decisions

  t0 = time.perf_counter()  # compiled now: out of the throughput
  lowered, eval_step, decisions = lower(spec)
  link = link_policy.resolve(config, spec, mesh, decisions, workdir)
  if link_probe.changes(decisions, link.plan):  # the probe sends otherwise: trace that
    lowered, eval_step, decisions = lower(dataclasses.replace(spec, plan=link.plan))
  if p.pgle:  # the plain step for its first steps, profiled, then compiled again (pgle.py)
    train_step = pgle.ProfileGuidedStep(
        lowered, xla, steps_left=t.steps - start, first_step=start + 1,
        cache=pgle.ProfileCache(workdir / 'pgle') if lead else None,
        key=pgle.cache_key(lowered, xla, mesh), log=tqdm.write if lead else None,
        platform=mesh.devices.flat[0].platform)
  else:
    train_step = lowered.compile(xla or None)
  compile_s = time.perf_counter() - t0 - link.probe_s
  fpt, tok = flops_per_token(spec.cfg, d.seq_len), d.batch_size * d.seq_len
  attention = spec.cfg.attention_backend(d.seq_len)
  compressed = collectives.decision_summary(decisions)
  if lead:
    tqdm.write(f'  {corpus_line(corpus)}, {fpt:.3g} FLOPs/token, {attention} attention, '
               f'compression {describe_plan(spec.plan)}; step compiled in {compile_s:.1f}s')
    tqdm.write(f'  {memory_line(p_abs, o_abs, spec)}')
    for line in link.lines:
      tqdm.write(f'  {line}')
    _report_plain_messages(compressed)
  writer = metrics.MetricsWriter(workdir, start) if lead else None
  pbar = tqdm(total=t.steps, initial=start, disable=not t.progress_bar, dynamic_ncols=True,
              desc=config.name) if lead else None
  peak = metrics.configured_peak(t, jax.devices()[0].device_kind)
  t_start = time.perf_counter()
  untimed = (lambda: train_step.untimed_s) if p.pgle else (lambda: 0.0)
  try:
    outcome = run_steps(
        params, opt_state, Steps(train=train_step, eval=eval_step, train_batch=batch,
                                 val_batch=lambda i: batch(i, 1, corpus.val),
                                 untimed_s=untimed),
        ckpt, config=config, start=start, meta={'mesh': dict(mesh.shape)},
        tokens_per_step=tok, mfu=lambda tps: metrics.mfu(tps, fpt, peak, mesh.size),
        writer=writer, pbar=pbar)
  finally:
    if p.pgle:
      train_step.close()
  summary = dict(workdir=str(workdir), start_step=start, n_params=n_params,
                 mesh=dict(mesh.shape), shard_optimizer=spec.shard_optimizer,
                 params_bytes_per_device=zero.bytes_per_device(p_abs),
                 opt_state_bytes_per_device=zero.bytes_per_device(o_abs),
                 device_peak_bytes=metrics.device_peak_bytes(),
                 attention=attention, compile_s=compile_s, xla_options=xla,
                 pgle=train_step.summary() if p.pgle else None,
                 compressed_messages=compressed, link_policy=link.summary,
                 train_loss=outcome.train_loss,
                 val_loss=outcome.val_loss, tokens_per_s=outcome.tokens_per_s,
                 mfu=outcome.mfu, status=outcome.status, step=outcome.step,
                 last_checkpoint=outcome.last_checkpoint,
                 wall_s=time.perf_counter() - t_start)
  if lead:
    metrics.write_summary(workdir / 'summary.json', summary)
  return summary


def _report_plain_messages(by_collective: dict) -> None:
  """Says which messages a codec was configured for but went plain (below ``min_bytes``
  or the size measured to pay on the link, ``CompressionConfig.link``, or probed at
  start-up, `link_policy`), so that a configured compression that does nothing on this
  machine is not silent."""
  plain = {c: r for c, r in by_collective.items() if r['plain']}
  if plain:
    tqdm.write('sent plain, below the size from which compression pays (link policy / '
               'compression.*.min_bytes): ' + '; '.join(
                   f"{r['plain']} of {r['plain'] + r['compressed']} {c} call sites (up to "
                   f"{r['plain_max_bytes'] / 2**20:.2f} MiB per device)"
                   for c, r in plain.items()))
