"""AdamW with linear warmup + cosine decay and global-norm clipping, from `config.optim`."""
from __future__ import annotations

import jax
import optax


def lr_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
  """0 -> lr over warmup_steps (at most total_steps: a short run warms up for all of it),
  then cosine to lr * min_lr_ratio at total_steps."""
  o = optim_cfg
  warmup = min(o.warmup_steps, total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)


def make_optimizer(optim_cfg, total_steps: int, decay_mask=None) -> optax.GradientTransformation:
  """Clip (if grad_clip > 0), then AdamW.

  `decay_mask` (a pytree of bools like the params, or a callable params -> such a pytree)
  says which leaves get weight decay; the default decays every leaf with ndim >= 2, i.e. not
  biases and norms of an unstacked model (a model with stacked layers passes its own).
  """
  o = optim_cfg
  if decay_mask is None:
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  adamw = optax.adamw(lr_schedule(o, total_steps), b1=o.b1, b2=o.b2, eps=o.eps,
                      weight_decay=o.weight_decay, mask=decay_mask)
  if o.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw)
  return adamw
