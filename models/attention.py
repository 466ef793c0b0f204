"""Causal softmax attention for every decoder block, and the choice of its implementation.

`model.attention` asks for 'cudnn' (cuDNN flash attention: GPU, bf16/fp16), 'xla' (XLA's,
which materializes the [T, T] scores, fp32 softmax), or 'auto': cuDNN where it takes the
shapes, else XLA (CPU, fp32). The attention takes however many heads its inputs carry, so a
tensor-parallel block (local heads) calls the same function.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import partitioning
from jax.ad_checkpoint import checkpoint_name

ATTENTION = ('auto', 'cudnn', 'xla')  # model.attention


@functools.cache
def _cudnn_refusal(shapes: tuple, dtype) -> str | None:
  """Why cuDNN flash attention does not take causal attention of q, k, v of these shapes
  and dtype on this backend, or None if it does (its own checks, run on abstract values)."""
  if jax.default_backend() != 'gpu':
    return f'no GPU (backend {jax.default_backend()!r})'
  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  try:
    jax.eval_shape(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                     implementation='cudnn'), *args)
  except (NotImplementedError, ValueError, RuntimeError, TypeError) as e:
    return f'{type(e).__name__}: {e}'
  return None


def attention_implementation(requested: str, q_BTNH, k_BTKH, v_BTKH) -> str:
  """'cudnn' or 'xla' for `requested` ('auto' | 'cudnn' | 'xla', `model.attention`):
  'auto' takes cuDNN where it accepts the inputs (shapes and dtype; any object with
  .shape/.dtype); 'cudnn' where it does not is a ValueError saying why."""
  if requested not in ATTENTION:
    raise ValueError(f'attention={requested!r} is unknown; use one of {ATTENTION}')
  if requested == 'xla':
    return 'xla'
  refusal = _cudnn_refusal(tuple(tuple(a.shape) for a in (q_BTNH, k_BTKH, v_BTKH)),
                           jnp.dtype(q_BTNH.dtype))
  if refusal and requested == 'cudnn':
    raise ValueError(f'model.attention=cudnn: cuDNN flash attention refuses q {q_BTNH.shape} '
                     f'{jnp.dtype(q_BTNH.dtype)}: {refusal}; use attention=auto or xla')
  return 'xla' if refusal else 'cudnn'


# The checkpoint name of the attention's inputs q, k, v (after any rotary embedding), and the
# jax primitive of cuDNN flash attention's forward pass, whose outputs (o and the softmax
# statistics) are its backward pass's residuals; jax 0.11.2's name, checked by the tests.
ATTENTION_INPUTS = 'taco_attention_inputs'
CUDNN_FORWARD = 'dot_product_attention_fwd_wrapper'


def save_attention_policy():
  """A `jax.checkpoint` policy keeping what the attention's backward pass reads: its
  inputs q, k, v (so the recomputation does not slice them out of the QKV output again) and,
  with cuDNN, the forward's output and softmax statistics (so the forward does not run
  again). XLA's attention keeps only its inputs: its residual would be the [T, T] scores."""
  inputs = jax.checkpoint_policies.save_only_these_names(ATTENTION_INPUTS)

  def policy(prim, *avals, **params):
    return prim.name == CUDNN_FORWARD or inputs(prim, *avals, **params)
  return policy


# Logical axes of attention's inputs. A no-op unless the caller sets flax axis rules under a
# mesh (the GSPMD baseline does: cuDNN's partitioner refuses a sequence-sharded input, which
# the partitioner would otherwise propagate from a sequence-parallel residual stream).
HEAD_AXES = ('batch', 'length', 'heads', 'head_dim')


def causal_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                     implementation: str = 'auto') -> jax.Array:
  """Causal softmax attention over however many heads N the inputs carry (K KV heads, K
  dividing N), through `attention_implementation(implementation, ...)`: cuDNN flash
  attention, or XLA's (fp32 softmax). The inputs carry the checkpoint name
  `ATTENTION_INPUTS` (`save_attention_policy`)."""
  impl = attention_implementation(implementation, q_BTNH, k_BTKH, v_BTKH)
  q_BTNH, k_BTKH, v_BTKH = (
      checkpoint_name(partitioning.with_sharding_constraint(a, HEAD_AXES), ATTENTION_INPUTS)
      for a in (q_BTNH, k_BTKH, v_BTKH))
  return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                      implementation=impl)
