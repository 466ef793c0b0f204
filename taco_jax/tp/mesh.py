"""The ("data", "pipeline", "tensor") device mesh and the checks of a layout against it.

`layout_errors` lists every way a layout does not fit the model, the batch and the devices
(`taco_jax.train.config.validate` runs it on a config, `ParallelSpec` on its fields).
`make_mesh` puts "tensor" innermost (fastest-varying device index), so with devices
ordered by (process, local id) a tensor group never leaves a host; data and pipeline span
hosts. `maybe_initialize_distributed` starts multi-process JAX when the environment asks.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np

from taco_jax import models

AXES = ("data", "pipeline", "tensor")
TP_OVERLAP = ("none", "ring", "kernel")  # parallel.tp_overlap
SCHEDULES = ("gpipe", "1f1b", "interleaved")  # parallel.schedule (taco_jax.tp.schedules)
DATA, PIPE, TENSOR = AXES
# the mesh axis each compression family's collectives cross (taco_jax.plan.FAMILIES)
FAMILY_AXES = {"tp_forward": TENSOR, "tp_backward": TENSOR, "pp": PIPE, "dp": DATA,
               "dp_params": DATA}


def sending_families(*, dp: int, pp: int, tp: int, shard_optimizer: bool) -> tuple[str, ...]:
  """The compression families whose collectives send something on a (dp, pp, tp) mesh:
  those whose axis has more than one device; dp_params only with the sharded optimizer
  (its parameter all-gather)."""
  size = {DATA: dp, PIPE: pp, TENSOR: tp}
  return tuple(f for f, axis in FAMILY_AXES.items()
               if size[axis] > 1 and (f != "dp_params" or shard_optimizer))


def _model_sizes(m) -> dict:
  """The model sizes that must split evenly, from a model config (GPT or Qwen); KV heads
  only where the model groups queries (Qwen), as GPT's are its n_heads."""
  n_kv = m.n_kv_heads if models.kind(m) == "qwen" else None
  return dict(n_heads=m.n_heads, d_model=m.d_model, d_ff=m.d_ff, vocab_size=m.vocab_size,
              n_layers=m.n_layers, n_kv_heads=n_kv)


def layout_errors(model, *, dp, pp, tp, microbatches=1, interleave=1, save_tp_outputs=False,
                  save_dots=False, save_attention=False, tp_overlap="none", schedule="gpipe",
                  virtual_stages=1, log_errors=False, overlap_grad_reduce=False,
                  shard_optimizer=False,
                  batch_size: int | None = None, seq_len: int | None = None,
                  n_devices: int | None = None, n_local_devices: int | None = None
                  ) -> list[str]:
  """Every way a (dp, pp, tp) layout does not fit the model, the batch and the devices.

  ``model``: a model config (``GPTConfig`` / ``QwenConfig``; ``models.model_config`` of a
  config's model section).
  The batch (``batch_size`` sequences of ``seq_len`` tokens) and the devices are checked
  when given. Messages name the config fields (``parallel.*``, ``model.*``, ``data.*``),
  which ``ParallelSpec``'s fields and the model config's mirror: the config path
  (``taco_jax.train.config.validate``) and the Python API (``taco_jax.tp.step``) run these
  same checks.
  """
  mb, il = microbatches, interleave
  errs = []
  for n, v in (("dp", dp), ("pp", pp), ("tp", tp), ("microbatches", mb), ("interleave", il),
               ("virtual_stages", virtual_stages)):
    if not (isinstance(v, int) and v > 0):
      errs.append(f"parallel.{n}={v!r} must be a positive integer")
  if errs:
    return errs
  if tp_overlap not in TP_OVERLAP:
    errs.append(f"parallel.tp_overlap={tp_overlap!r} must be one of {TP_OVERLAP}")
  for name, on in (("save_tp_outputs", save_tp_outputs), ("save_dots", save_dots),
                   ("save_attention", save_attention)):
    if on and not model.remat:
      errs.append(f"parallel.{name}=True keeps what model.remat would recompute, but "
                  f"model.remat is off; set model.remat=True or leave {name} off")
  if n_devices is not None and dp * pp * tp != n_devices:
    errs.append(f"parallel.dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} but there are "
                f"{n_devices} devices; choose dp, pp, tp whose product is {n_devices}")
  if n_local_devices is not None and n_devices is not None and n_local_devices < n_devices \
      and n_local_devices % tp:
    errs.append(f"parallel.tp={tp} does not divide the {n_local_devices} devices of one host; "
                "a tensor group must stay inside a host: pick tp dividing it")
  s = _model_sizes(model)
  for name, what in (("n_heads", "attention heads"), ("d_model", "hidden width"),
                     ("d_ff", "MLP width"), ("vocab_size", "vocabulary (vocab-parallel "
                                             "embedding)"), ("n_kv_heads", "KV heads")):
    if s[name] is not None and s[name] % tp:
      errs.append(f"model.{name}={s[name]} ({what}) is not divisible by parallel.tp={tp}; "
                  f"pick tp dividing it or change model.{name}")
  if s["n_layers"] % pp:
    errs.append(f"model.n_layers={s['n_layers']} is not divisible by parallel.pp={pp} "
                "(pipeline stages hold equal numbers of layers); change pp or n_layers")
  errs += _schedule_errors(schedule, virtual_stages, pp, s["n_layers"], log_errors)
  if schedule != "gpipe" and pp > 1 and tp_overlap != "none":
    errs.append(f"parallel.schedule={schedule!r} runs each stage's TP layers inside "
                f"per-stage branches, where parallel.tp_overlap={tp_overlap!r} cannot run "
                "(its ring permutes and its kernels' cross-GPU barrier involve every device, "
                "so the stages would wait on each other): use tp_overlap='none' or "
                "schedule='gpipe'")
  if overlap_grad_reduce and (pp > 1 or mb > 1 or shard_optimizer):
    errs.append("parallel.overlap_grad_reduce=True reduces each layer's gradients once, "
                "inside the backward pass, which needs one backward pass per step over "
                "replicated optimizer state: parallel.pp=1, parallel.microbatches=1 and "
                f"parallel.shard_optimizer=False (now {pp}, {mb}, {shard_optimizer})")
  if seq_len is not None and seq_len % tp:
    errs.append(f"data.seq_len={seq_len} is not divisible by parallel.tp={tp} (sequence "
                f"parallelism shards it); use a multiple of {tp}")
  if batch_size is None:
    return errs
  if batch_size % (dp * mb):
    errs.append(f"data.batch_size={batch_size} is not divisible by parallel.dp * "
                f"parallel.microbatches = {dp}*{mb} = {dp * mb}; use a batch size that is a "
                f"multiple of {dp * mb}")
  elif batch_size % (dp * mb * il):
    errs.append(f"data.batch_size={batch_size} is not divisible by parallel.dp * "
                f"parallel.microbatches * parallel.interleave = {dp}*{mb}*{il} = "
                f"{dp * mb * il} (each micro-batch splits into {il} sub-batches); use a "
                f"multiple of {dp * mb * il} or a smaller parallel.interleave")
  return errs


def _schedule_errors(schedule, v, pp, n_layers, log_errors) -> list[str]:
  if schedule not in SCHEDULES:
    return [f"parallel.schedule={schedule!r} must be one of {SCHEDULES}"]
  errs = []
  if schedule != "interleaved" and v != 1:
    errs.append(f"parallel.virtual_stages={v} needs parallel.schedule='interleaved' (the "
                f"{schedule!r} schedule runs one chunk per stage); set it to 1 or change "
                "the schedule")
  if schedule == "interleaved":
    if v < 2:
      errs.append(f"parallel.schedule='interleaved' needs parallel.virtual_stages >= 2 "
                  f"chunks per stage, got {v} (with 1 it is parallel.schedule='1f1b')")
    if pp < 2:
      errs.append(f"parallel.schedule='interleaved' needs parallel.pp >= 2, got {pp}")
    if v >= 2 and n_layers % pp == 0 and n_layers % (pp * v):  # (n_layers % pp: said above)
      errs.append(f"model.n_layers={n_layers} is not divisible by parallel.pp * "
                  f"parallel.virtual_stages = {pp}*{v} = {pp * v} (the interleaved schedule "
                  f"cuts the model into {pp * v} equal chunks); change virtual_stages or "
                  "n_layers")
  if schedule != "gpipe" and log_errors:
    errs.append(f"compression.log_errors=True measures the messages of the GPipe step; "
                f"parallel.schedule={schedule!r} does not report them: use "
                "parallel.schedule='gpipe' or turn log_errors off")
  return errs


def host_ordered_mesh(sizes: dict[str, int], axis_names, devices=None) -> jax.sharding.Mesh:
  """Mesh of shape `sizes.values()` (keys name the sizes in errors, e.g. "dp"); devices
  ordered by (process, id), so the innermost axis ("tensor") stays inside a host."""
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(sizes.values())
  if math.prod(shape) != len(devices):
    raise ValueError(f"{'*'.join(sizes)} = {'*'.join(map(str, shape))} = {math.prod(shape)} "
                     f"does not match the {len(devices)} devices")
  devices.sort(key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), tuple(axis_names))


def make_mesh(dp: int, pp: int, tp: int, devices=None) -> jax.sharding.Mesh:
  """Mesh of shape (dp, pp, tp) over ("data", "pipeline", "tensor")."""
  return host_ordered_mesh(dict(dp=dp, pp=pp, tp=tp), AXES, devices)


def maybe_initialize_distributed(c=None) -> bool:
  """Calls `jax.distributed.initialize()` when started as one of several processes.

  Triggered by `parallel.distributed=True` or by JAX_COORDINATOR_ADDRESS with
  JAX_NUM_PROCESSES > 1 in the environment (JAX_PROCESS_ID names this process). Must run
  before anything touches a JAX backend. Returns whether it initialized.
  """
  flag = bool(c is not None and c.parallel.distributed)
  n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
  if not (flag or (os.environ.get("JAX_COORDINATOR_ADDRESS") and n > 1)):
    return False
  if jax.distributed.is_initialized():
    return True
  kw = {}
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    kw = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=n,
              process_id=int(os.environ["JAX_PROCESS_ID"]))
  jax.distributed.initialize(**kw)
  return True
