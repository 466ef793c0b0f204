"""Model/optimizer construction and the pure train/eval step functions.

The state is functional: `params` (an nnx.State of the model's parameters) and
`opt_state` (optax), with a `graphdef` to rebuild the model inside a step. The step
functions are not jitted here: the single-device loop wraps them in `jax.jit` with
donation; a parallel trainer can wrap the same functions in `shard_map` first.
"""
from __future__ import annotations

from typing import Callable

import jax
import optax
from flax import nnx

from taco_jax.models.decoder import loss_fn
from taco_jax.models.gpt import GPT, GPTConfig
from taco_jax.models.layers import LinearFactory


def build_model(cfg: GPTConfig, seed: int, linear: LinearFactory | None = None) -> GPT:
  """`GPT(cfg)` with parameters drawn from `seed`; `linear` as in models.layers."""
  return GPT(cfg, rngs=nnx.Rngs(params=seed), linear=linear)


def init_state(model: nnx.Module, tx: optax.GradientTransformation):
  """(graphdef, params, opt_state) of a freshly built model."""
  graphdef, params = nnx.split(model)
  return graphdef, params, tx.init(params)


def abstract_state(cfg: GPTConfig, tx: optax.GradientTransformation,
                   linear: LinearFactory | None = None):
  """(graphdef, params, opt_state) as ShapeDtypeStructs: a restore target, nothing allocated."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, 0, linear)))
  return graphdef, params, jax.eval_shape(tx.init, params)


def make_train_step(graphdef, tx: optax.GradientTransformation,
                    loss: Callable = loss_fn) -> Callable:
  """(params, opt_state, tokens_BT) -> (params, opt_state, metrics); `loss(model, tokens)`."""

  def train_step(params, opt_state, tokens_BT):
    def loss_of(p):
      return loss(nnx.merge(graphdef, p), tokens_BT)

    (value, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {**aux, 'loss': value, 'grad_norm': optax.tree.norm(grads)}

  return train_step


def make_eval_step(graphdef, loss: Callable = loss_fn) -> Callable:
  """(params, tokens_BT) -> mean loss of the batch."""

  def eval_step(params, tokens_BT):
    return loss(nnx.merge(graphdef, params), tokens_BT)[0]

  return eval_step
