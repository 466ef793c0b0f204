"""The parallel model's parameter layout, and single-device <-> parallel conversion.

Parameters are one pure dict of fp32 global arrays (each with a NamedSharding):

    wte      [V, D]        P("tensor", None)   vocab-parallel embedding, tied LM head
    wpe      [T_max, D]    P()                 learned positions (GPT block only)
    ln_f     {...}         P()                 final norm
    blocks   {...: [L, ..]} P("pipeline", ...)  the single-device block's params stacked on a
                                               leading layer axis; column-parallel outputs and
                                               row-parallel inputs also on "tensor"

The QKV (head-major / KV-group-major) and MLP-in layouts of the single-device model make a
contiguous 1/tp of each column-parallel output a whole set of heads, so the global arrays
are exactly the single-device ones, stacked: conversion is stacking, not reshuffling, and
a checkpoint restores onto any mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import models
from taco_jax.models import model_config  # noqa: F401 (re-exported)
from taco_jax.tp.layers import (ColumnParallelLinear, RowParallelLinear, TPContext,
                                      TensorParallelFactory)
from taco_jax.tp.mesh import PIPE, TENSOR


def single_device_model(cfg, seed: int = 0) -> models.decoder.Decoder:
  """The single-device model (GPT or Qwen) with dense linears, params from `seed`."""
  return models.model_class(cfg)(cfg, rngs=nnx.Rngs(params=seed))


def block_template(cfg, ctx: TPContext):
  """(graphdef, abstract local state) of one block built with tensor-parallel linears."""
  make = lambda: models.block_class(cfg)(cfg, rngs=nnx.Rngs(0),
                                         linear=TensorParallelFactory(ctx))
  return nnx.split(nnx.eval_shape(make))


def norm_template(cfg):
  """(graphdef, abstract state) of the final norm."""
  m = nnx.eval_shape(lambda: single_device_model(cfg))
  return nnx.split(m.ln_f)


def _block_specs(cfg) -> dict:
  """PartitionSpec of every stacked block parameter (leading axis on "pipeline")."""
  gd, state = block_template(cfg, TPContext(tp=1))
  model = nnx.merge(gd, state)
  specs = jax.tree.map(lambda _: P(PIPE), nnx.to_pure_dict(state))
  for path, mod in nnx.iter_modules(model):
    if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
      node = specs
      for k in path:
        node = node[k]
      for name, s in mod.SPECS.items():
        node[name] = P(PIPE, *s)
  return specs


def param_specs(cfg) -> dict:
  """PartitionSpec of every parameter of the parallel layout (see the module docstring)."""
  specs = {"wte": P(TENSOR, None), "ln_f": jax.tree.map(
      lambda _: P(), nnx.to_pure_dict(norm_template(cfg)[1])), "blocks": _block_specs(cfg)}
  if models.kind(cfg) == "gpt":
    specs["wpe"] = P()
  return specs


def to_parallel(pure: dict) -> dict:
  """Single-device param pure dict (nnx.state(model, nnx.Param)) -> parallel layout."""
  blocks = [pure["blocks"][i] for i in sorted(pure["blocks"])]
  out = {"wte": pure["wte"]["embedding"], "ln_f": pure["ln_f"],
         "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
  if "wpe" in pure:
    out["wpe"] = pure["wpe"]
  return out


def from_parallel(params: dict) -> dict:
  """Inverse of `to_parallel` (a pure dict to `nnx.update` a single-device model with)."""
  n = jax.tree.leaves(params["blocks"])[0].shape[0]
  out = {"wte": {"embedding": params["wte"]}, "ln_f": params["ln_f"],
         "blocks": {i: jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(n)}}
  if "wpe" in params:
    out["wpe"] = params["wpe"]
  return out


def shardings(cfg, mesh) -> dict:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg),
                      is_leaf=lambda x: isinstance(x, P))


def init_params(cfg, mesh, seed: int = 0) -> dict:
  """Parameters of `single_device_model(cfg, seed)`, created directly in the parallel layout
  (one jitted initialization, nothing gathered on one device).

  The same bits on every mesh; equal to `single_device_model(cfg, seed)`'s to rounding: that
  one initializes op by op, and XLA rounds the jitted initializer's scalings differently
  for some parameters (by at most 1 ulp, tests/test_parallel_step.py)."""
  def init():
    m = single_device_model(cfg, seed)
    return to_parallel(nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  return jax.jit(init, out_shardings=shardings(cfg, mesh))()


def shard_params(cfg, params: dict, mesh) -> dict:
  """Places parallel-layout params (e.g. `to_parallel` of a single-device model) on `mesh`."""
  return jax.device_put(params, shardings(cfg, mesh))


def param_shapes(cfg) -> dict:
  """ShapeDtypeStructs of the global parameters (no mesh, nothing allocated)."""
  return jax.eval_shape(lambda: to_parallel(
      nnx.to_pure_dict(nnx.state(single_device_model(cfg), nnx.Param))))


def abstract_params(cfg, mesh) -> dict:
  """ShapeDtypeStructs with shardings: a restore target on `mesh`, nothing allocated."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      param_shapes(cfg), shardings(cfg, mesh))


def decay_mask(params: dict) -> dict:
  """AdamW weight-decay mask: matrices and embeddings, not biases / norms (even stacked)."""
  def is_matrix(path, x):
    stacked = path[0].key == "blocks"
    return x.ndim - stacked >= 2
  return jax.tree_util.tree_map_with_path(is_matrix, params)
