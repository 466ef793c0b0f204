"""The single-device reference training step: `models` under a plain `jax.jit`.

What the former single-device trainer ran. The tests hold the trainer's loss curve against
it, and `benchmarks/bench_trainer_cpu.py` times the trainer against it.
"""
from __future__ import annotations

from typing import Callable

import jax
import optax
from flax import nnx

from taco_jax.models import model_class, model_config
from taco_jax.models.decoder import loss_fn


def init_state(model_section, seed: int, tx: optax.GradientTransformation):
  """(graphdef, params, opt_state) of the single-device model of a config's model section."""
  cfg = model_config(model_section)
  graphdef, params = nnx.split(model_class(cfg)(cfg, rngs=nnx.Rngs(params=seed)))
  return graphdef, params, tx.init(params)


def train_step(graphdef, tx: optax.GradientTransformation) -> Callable:
  """(params, opt_state, tokens_BT1) -> (params, opt_state, {'loss', 'grad_norm'})."""

  def step(params, opt_state, tokens_BT1):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(nnx.merge(graphdef, p), tokens_BT1)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            {'loss': loss, 'grad_norm': optax.tree.norm(grads)})

  return step
