"""The optimizer sharded over "data" (ZeRO-1/2, `parallel.shard_optimizer`).

Replicated (the default), every data rank holds both Adam moments whole, all-reduces the
gradients and runs the same update. Sharded, each data rank keeps and updates 1/dp of them:

    gradients   reduce-scattered over "data" (mean; codec `compression.dp`, site
                "dp/scatter"): rank d gets chunk d of each leaf along its `shard_dims`
    update      optax on the chunks (the moments, and the master weights where they are
                kept, are sharded alike), in the step's jit after its shard_map: all
                elementwise on the local chunk but the gradient's global norm (scalars)
    parameters  all-gathered over "data" into the replicated parameters the model runs on
                (codec `compression.dp_params`, site "dp_params")

Every leaf keeps its global shape ("data" is added to one dimension of its sharding), so a
checkpoint holds the replicated optimizer's arrays and restores onto any mesh and any dp.
A leaf is split along its first dimension whose per-device size divides by dp; a leaf with
none stays replicated: its gradient is all-reduced and every rank runs its update.

Compressed gather (SDP4Bit's weight differences): the owner of a chunk sends the FP8 codes
of delta = master - (its chunk of the gathered parameters); every rank, the owner too, adds
the decoded deltas of all chunks to the parameters it holds. The same codes and the same
additions on every rank: the parameters stay identical across data ranks, bit for bit. The
fp32 master keeps the exact value, so what the codec rounded off is part of the next step's
delta (error feedback) and the parameters never lag the master by more than one rounding.
Without a codec the chunks themselves are gathered, the parameters are the master exactly,
and no master is stored: the optimizer state is then the replicated optimizer's.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import collectives, monitor
from taco_jax.plan import SITES
from taco_jax.tp import buckets, layout as layout_lib
from taco_jax.tp.mesh import DATA, PIPE, TENSOR


def errors(shard_optimizer: bool, plan) -> list[str]:
  """What a layout's `parallel.shard_optimizer` and compression plan cannot do together."""
  if plan.compresses("dp_params") and not shard_optimizer:
    return ["compression.dp_params compresses the sharded optimizer's parameter all-gather: "
            "set parallel.shard_optimizer=True, or compression.dp_params=None"]
  return []


def keeps_master(spec) -> bool:
  """Whether the state holds fp32 master weights: where the parameter gather is lossy."""
  return spec.shard_optimizer and spec.plan.codec("dp_params") is not None


def _axes(pspec, i: int) -> tuple:
  e = pspec[i] if i < len(pspec) else None
  return () if e is None else (e,) if isinstance(e, str) else tuple(e)


@functools.lru_cache(maxsize=16)
def _leaves(cfg):
  """(global shapes, PartitionSpecs, treedef) of the parameters, leaf by leaf."""
  shapes, treedef = jax.tree.flatten(layout_lib.param_shapes(cfg))
  return tuple(shapes), tuple(treedef.flatten_up_to(layout_lib.param_specs(cfg))), treedef


def shard_dims(spec) -> list:
  """Per parameter leaf (`jax.tree.leaves` order): the dimension split over "data", the
  first whose per-device size divides by dp, or None (the leaf stays replicated)."""
  sizes = {DATA: spec.dp, PIPE: spec.pp, TENSOR: spec.tp}
  local = lambda x, p, i: x.shape[i] // math.prod(sizes[a] for a in _axes(p, i))
  return [next((i for i in range(x.ndim) if local(x, p, i) % spec.dp == 0), None)
          for x, p in zip(*_leaves(spec.cfg)[:2])]


def state_specs(spec) -> dict:
  """PartitionSpec of each leaf of the sharded state (moments, master, scattered
  gradients): its parameter's, with "data" added (minor) on its `shard_dims` dimension."""
  shapes, specs, treedef = _leaves(spec.cfg)
  out = []
  for x, p, k in zip(shapes, specs, shard_dims(spec)):
    if k is not None:
      entries = [*p] + [None] * (x.ndim - len(p))
      axes = _axes(p, k) + (DATA,)
      entries[k] = axes if len(axes) > 1 else DATA
      p = P(*entries)
    out.append(p)
  return treedef.unflatten(out)


def state_target(spec, params_target, mesh) -> dict:
  """`params_target` (ShapeDtypeStructs) with the sharded state's shardings: the master's
  restore target, and the shardings the moments follow."""
  sh = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(spec),
                    is_leaf=lambda x: isinstance(x, P))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      params_target, sh)


def opt_state(spec, tx_state, master):
  """The optimizer state the step carries: optax's, with the master where it is kept."""
  return {"master": master, "tx": tx_state} if keeps_master(spec) else tx_state


def init(spec, tx) -> Callable:
  """params -> the initial optimizer state of `spec`'s step (jit it with the shardings of
  `train.trainer.opt_state_target`: a master is then the parameters' own chunks)."""
  return lambda params: opt_state(spec, tx.init(params), params)


def bytes_per_device(tree) -> int:
  """Bytes one device holds of `tree` (jax.Arrays or ShapeDtypeStructs with shardings)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def _split(x, k: int, dp: int):
  """[..., n, ...] (n on axis k) -> [dp, n / dp * rest]: row d is chunk d along axis k."""
  s = x.shape
  return jnp.moveaxis(x.reshape(*s[:k], dp, s[k] // dp, *s[k + 1:]), k, 0).reshape(dp, -1)


def _chunk_shape(shape, k: int, dp: int) -> tuple:
  return (*shape[:k], shape[k] // dp, *shape[k + 1:])


def _join(rows, shape, k: int, dp: int):
  """Inverse of `_split`: [dp, n / dp * rest] -> `shape`."""
  return jnp.moveaxis(rows.reshape(dp, *_chunk_shape(shape, k, dp)), 0, k).reshape(shape)


def scatter_mean(spec, leaves: list) -> list:
  """Inside the step's shard_map, after the sums over "tensor" and "pipeline": every
  gradient leaf averaged over "data", each rank keeping its chunk along `shard_dims` (the
  whole leaf where it stays replicated). One reduce-scatter, and one all-reduce for the
  replicated leaves; nothing at dp = 1."""
  dp, dims = spec.dp, shard_dims(spec)
  if dp == 1:
    return list(leaves)
  out = list(leaves)
  rest = [i for i, k in enumerate(dims) if k is None]
  for i, g in zip(rest, buckets.all_reduce([leaves[i] for i in rest], DATA,
                                           spec.plan.codec("dp"), "dp")):
    out[i] = g / dp
  idx = [i for i, k in enumerate(dims) if k is not None]
  if not idx:
    return out
  codec = spec.plan.codec("dp/scatter")
  align = codec.group_size if codec else 1
  rows = buckets.packed_shape([leaves[i].size // dp for i in idx], align).shape[0]
  wire = collectives.decide("reduce_scatter",
                            jax.ShapeDtypeStruct((dp * rows, buckets.BUCKET), jnp.float32),
                            codec, dp, site="dp/scatter")
  if wire is None:  # leaf by leaf: XLA combines them, and nothing is copied into a buffer
    for i in idx:
      x = leaves[i]
      out[i] = (collectives.reduce_scatter(x.astype(jnp.float32), DATA,
                                           scatter_dimension=dims[i],
                                           compression=collectives.Decided(None))
                / dp).astype(x.dtype)
    return out
  parts = [_split(leaves[i], dims[i], dp) for i in idx]
  buf = buckets.pack(parts, align)  # [dp, rows, BUCKET]: rank d's rows are row d
  buf = buf.reshape(-1, buckets.BUCKET)
  monitor.sent(buf, wire, "dp/scatter")
  buf = collectives.reduce_scatter(buf, DATA, scatter_dimension=0,
                                   compression=collectives.Decided(wire))
  for i, g in zip(idx, buckets.unpack(buf, [p.shape[1] for p in parts], align)):
    x = leaves[i]
    out[i] = (g / dp).reshape(_chunk_shape(x.shape, dims[i], dp)).astype(x.dtype)
  return out


def _gather(spec, chunks: list, params: list) -> list:
  """Inside a shard_map: this rank's updated chunks and the parameters before the update
  -> the parameters after it, gathered (see the module docstring)."""
  dp, dims = spec.dp, shard_dims(spec)
  codec = spec.plan.codec("dp_params")
  idx = [i for i, k in enumerate(dims) if k is not None]
  out = list(chunks)  # the replicated leaves: every rank ran their update
  if dp == 1 or not idx:
    return out
  wire = codec and collectives.decide(
      "all_gather", buckets.packed_shape([chunks[i].size for i in idx], codec.group_size),
      codec, dp, site="dp_params")
  if wire is None:  # the chunks themselves, leaf by leaf: no delta, no buffer to copy into
    for i in idx:
      out[i] = collectives.all_gather(chunks[i], DATA, axis=dims[i], tiled=True,
                                      compression=collectives.Decided(None)
                                      ).astype(params[i].dtype)
    return out
  d = jax.lax.axis_index(DATA)
  sent = []
  for i in idx:  # the difference to this rank's chunk of what every rank holds
    c, k = chunks[i], dims[i]
    c = c - jax.lax.dynamic_slice_in_dim(params[i], d * c.shape[k], c.shape[k], axis=k)
    sent.append(c.reshape(-1))
  buf = buckets.pack(sent, wire.group_size)  # [rows, BUCKET]
  monitor.sent(buf, wire, "dp_params")
  buf = collectives.all_gather(buf, DATA, axis=0, tiled=False,
                               compression=collectives.Decided(wire))
  for i, rows in zip(idx, buckets.unpack(buf, [x.size for x in sent], wire.group_size)):
    x = params[i]
    out[i] = (x + _join(rows, x.shape, dims[i], dp)).astype(x.dtype)
  return out


def make_update(spec, mesh, tx: optax.GradientTransformation, capture=None) -> Callable:
  """(params, opt_state, grads) -> (params, opt_state, metrics): the sharded update, for
  gradients as `scatter_mean` leaves them (sharded like `state_specs`). `metrics` holds
  "compression_error/dp_params" with `compression.log_errors`; `capture` (a
  `monitor.Capture`) records the gathered messages."""
  specs, st_specs = layout_lib.param_specs(spec.cfg), state_specs(spec)
  log = (spec.plan.log_errors and capture is None and spec.dp > 1
         and spec.plan.compresses("dp_params"))
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), st_specs,
                           is_leaf=lambda x: isinstance(x, P))

  def local(chunks, params):
    leaves, treedef = jax.tree.flatten(params)
    watcher = monitor.ErrorLog() if log else capture
    with monitor.watching(watcher):
      new = treedef.unflatten(_gather(spec, treedef.flatten_up_to(chunks), leaves))
    if not log:
      return new
    zeros = jnp.zeros((len(SITES), 2), jnp.float32)
    return new, jax.lax.psum(watcher.stats(zeros), (DATA, PIPE, TENSOR))

  gather = jax.shard_map(local, mesh=mesh, in_specs=(st_specs, specs),
                         out_specs=(specs, P()) if log else specs, check_vma=False)

  def update(params, state, grads):
    if keeps_master(spec):
      master, tx_state = state["master"], state["tx"]
    else:  # the parameters are the master: this rank's chunks of them, no copy sent
      master, tx_state = jax.lax.with_sharding_constraint(params, shardings), state
    updates, tx_state = tx.update(grads, tx_state, master)
    master = optax.apply_updates(master, updates)
    params = gather(master, params)
    metrics = {}
    if log:
      params, stats = params
      metrics = monitor.family_metrics(stats, ("dp_params",))
    return params, opt_state(spec, tx_state, master), metrics

  return update
