"""The GSPMD baseline: what a JAX user would otherwise write for tensor parallelism.

The trainer's stacked forward (`taco_jax.tp.step.stacked_loss`) at tp = 1, where its
layers communicate nothing and compute the single-device model's math, with the parameters
stacked on a leading layer axis as in `taco_jax.tp.layout`, under plain `jax.jit` on a
("data", "tensor") mesh, with Megatron-style NamedSharding annotations and nothing manual:
parameters enter with
`in_shardings` (QKV / MLP-in column-parallel on "tensor", out-projections row-parallel,
vocab-parallel embedding; the same PartitionSpecs as `model.param_specs` without the
pipeline axis) and the residual stream between blocks is pinned with
`jax.lax.with_sharding_constraint`: batch on "data", and with `activation="sp"` the
sequence on "tensor" (Megatron sequence parallelism: XLA then inserts all-gather /
reduce-scatter around each block, as our step does), with "replicated" the full sequence
on every tensor rank (Megatron's all-reduce). Attention's inputs are pinned to whole heads
per tensor rank (flax logical axis rules for `models.attention.HEAD_AXES`), as Megatron lays
them out and as cuDNN flash attention requires. The XLA partitioner picks every collective.

`XLA_OVERLAP_FLAGS` are the XLA GPU flags that let XLA overlap those collectives with
compute (latency-hiding scheduler, pipelined collectives in the layer loop); set them in
XLA_FLAGS before JAX starts (benchmarks/bench_train.py does).
"""
from __future__ import annotations

from typing import Callable

import jax
import optax
from flax import nnx
from flax.linen import partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax.tp import layout as layout_lib
from taco_jax.tp import mesh as mesh_lib
from taco_jax.tp import step as step_lib
from taco_jax.tp.mesh import DATA, PIPE, TENSOR

AXES = (DATA, TENSOR)
# models.attention.HEAD_AXES -> mesh axes: attention's batch on "data", its heads on "tensor".
LOGICAL_RULES = (("batch", DATA), ("heads", TENSOR))

XLA_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)


def make_mesh(dp: int, tp: int, devices=None) -> jax.sharding.Mesh:
  """("data", "tensor") mesh, "tensor" innermost (devices ordered by (process, id))."""
  return mesh_lib.host_ordered_mesh(dict(dp=dp, tp=tp), AXES, devices)


def param_specs(cfg) -> dict:
  """`model.param_specs` without the pipeline axis (the stacked layer axis unsharded)."""
  drop = lambda s: P(*(None if a == PIPE else a for a in s))
  return jax.tree.map(drop, layout_lib.param_specs(cfg), is_leaf=lambda x: isinstance(x, P))


def shardings(cfg, mesh) -> dict:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg),
                      is_leaf=lambda x: isinstance(x, P))


def init_params(cfg, mesh, seed: int = 0) -> dict:
  """Parameters of `model.single_device_model(cfg, seed)` in the stacked layout, sharded."""
  def init():
    m = layout_lib.single_device_model(cfg, seed)
    return layout_lib.to_parallel(nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  return jax.jit(init, out_shardings=shardings(cfg, mesh))()


def batch_sharding(mesh):
  return NamedSharding(mesh, P(DATA, None))


def loss_fn(cfg, mesh, activation: str = "sp") -> Callable:
  """(params, tokens_BT1) -> mean next-token loss (fp32), the single-device model's math:
  the trainer's stacked forward at tp = 1 (`step.stacked_loss`, which communicates nothing
  itself), the residual stream pinned after the embedding and after every block."""
  if activation not in ("sp", "replicated"):
    raise ValueError(f"activation must be 'sp' or 'replicated', got {activation!r}")
  spec = step_lib.ParallelSpec(cfg, dp=1, pp=1, tp=1)  # one program; XLA partitions it
  h_spec = NamedSharding(mesh, P(DATA, TENSOR if activation == "sp" else None, None))
  pin = lambda h: jax.lax.with_sharding_constraint(h, h_spec)

  def loss(params, tokens_BT1):
    with partitioning.axis_rules(LOGICAL_RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return step_lib.stacked_loss(spec, params, tokens_BT1, constrain=pin)

  return loss


def loss_and_grads_fn(cfg, mesh, activation: str = "sp") -> Callable:
  return jax.value_and_grad(loss_fn(cfg, mesh, activation))


def make_train_step(cfg, mesh, tx: optax.GradientTransformation, *,
                    activation: str = "sp") -> Callable:
  """(params, opt_state, tokens_BT1) -> (params, opt_state, metrics), like
  `step.make_train_step`; jit it with the param / batch shardings and donation."""
  loss_and_grads = loss_and_grads_fn(cfg, mesh, activation)

  def train_step(params, opt_state, tokens_BT1):
    loss, grads = loss_and_grads(params, tokens_BT1)
    grads = jax.lax.with_sharding_constraint(grads, shardings(cfg, mesh))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  return train_step
