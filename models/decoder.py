"""The decoder every model is: its config base, its block base and the model base.

    tokens_BT -> embed -> n_layers x block -> final norm -> tied head (h @ wte.T)
    block:  h += attn_out(attention(qkv(norm1(h))));  h += mlp_out(mlp(mlp_in(norm2(h))))

A model (`models.gpt`, `models.qwen`) names its block class, the block its norm and its
attention and MLP math, and the model its position parts; the layers, their creation order
(which fixes what a seed draws) and the loss are written once here. Parameters are fp32;
matmuls run in the config's `dtype` (bf16 by default); attention softmax, norm statistics,
logits and the loss are fp32. The four linear layers of a block come from a
`models.layers.LinearFactory`, so a tensor-parallel factory runs the same block code.
Embedding, head and loss are separate methods for the same reason (a TP model makes them
vocab-parallel).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models.attention import ATTENTION, attention_implementation, causal_attention
from taco_jax.models.layers import DenseFactory, Embedding, LinearFactory

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """The fields and checks every model shares; a model's config adds its own fields and
  its parameter count, and names its block (`block`, what `config.model.block` selects)."""
  block: ClassVar[str]
  vocab_size: int = 256      # token ids are in [0, vocab_size); 256 for the byte tokenizer
  n_layers: int = 4          # number of transformer blocks
  d_model: int = 128         # width of the residual stream
  n_heads: int = 4           # attention heads; d_model must be divisible by it
  d_ff: int = 512            # MLP hidden width (GPT-2: 4 * d_model)
  max_seq_len: int = 128     # longest input the model takes
  dtype: str = 'bfloat16'    # compute dtype: float32 | bfloat16 | float16 (params stay fp32)
  ln_eps: float = 1e-5       # norm epsilon
  init_std: float = 0.02     # N(0, std) init; out-projections use std / sqrt(2 n_layers)
  remat: bool = False        # rematerialize each block in the backward pass (saves memory)
  # softmax attention: 'cudnn' (cuDNN flash attention, GPU, bf16/fp16), 'xla' (materializes
  # the [T, T] scores), or 'auto': cuDNN where it takes the shapes, else XLA (CPU, fp32)
  attention: str = 'auto'

  def __post_init__(self):
    if self.attention not in ATTENTION:
      raise ValueError(f'attention={self.attention!r} is unknown; use one of {ATTENTION}')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def kv_heads(self) -> int:
    """Key/value heads of the attention (n_heads unless the model groups queries)."""
    return self.n_heads

  @property
  def lookup_params(self) -> int:
    """Parameters used by lookup only (a position table): no matmul FLOPs."""
    return 0

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  def num_params(self) -> int:
    """Closed-form parameter count of the model this config describes."""
    raise NotImplementedError(f'{type(self).__name__} does not count its parameters')

  def attention_backend(self, seq_len: int | None = None) -> str:
    """What `causal_attention` runs for this model ('cudnn' | 'xla'), with sequences of
    `seq_len` (cfg.max_seq_len if None); a ValueError if `attention` asks for what cannot run."""
    t = self.max_seq_len if seq_len is None else seq_len
    q, k = ((1, t, n, self.head_dim) for n in (self.n_heads, self.kv_heads))
    shapes = [jax.ShapeDtypeStruct(s, self.compute_dtype) for s in (q, k, k)]
    return attention_implementation(self.attention, *shapes)

  def errors(self, seq_len: int | None = None) -> list[str]:
    """Every invalid field, named as in a config's model section, with what to change; with
    `seq_len`, also whether the model takes sequences that long. What
    `taco_jax.train.config.validate_config` reports for the model section and what
    `taco_jax.tp.step.ParallelSpec` checks (a config is not validated when built, so
    that a config file's mistakes are all listed at once)."""
    sizes = ('vocab_size', 'n_layers', 'd_model', 'n_heads', 'd_ff', 'max_seq_len')
    errs = [f'model.{n}={getattr(self, n)!r} must be a positive integer' for n in sizes
            if not (isinstance(getattr(self, n), int) and getattr(self, n) > 0)]
    if errs:
      return errs
    if self.d_model % self.n_heads:
      errs.append(f'model.d_model={self.d_model} is not divisible by model.n_heads='
                  f'{self.n_heads}; pick d_model a multiple of n_heads')
    if self.dtype not in DTYPES:
      errs.append(f'model.dtype={self.dtype!r} is unknown; use one of {sorted(DTYPES)}')
    if seq_len is not None and seq_len > self.max_seq_len:
      errs.append(f'data.seq_len={seq_len} exceeds model.max_seq_len={self.max_seq_len}; '
                  'lower data.seq_len or raise model.max_seq_len')
    return errs


class DecoderBlock(nnx.Module):
  """Pre-norm transformer block. A subclass names its `norm` (a constructor like
  `models.layers.layer_norm`), how many MLP-in outputs feed one hidden unit
  (`mlp_in_per_hidden`: 2 for a gated MLP), and its `attention` and `mlp` math."""
  norm: ClassVar[Callable[..., nnx.Module]]
  mlp_in_per_hidden: ClassVar[int] = 1

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs,
               linear: LinearFactory | None = None):
    linear = linear or DenseFactory(cfg.compute_dtype)
    dt, d, hd = cfg.compute_dtype, cfg.d_model, cfg.head_dim
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.head_dim, self.attention_impl = hd, cfg.attention
    self.ln1 = self.norm(d, eps=cfg.ln_eps, dtype=dt, rngs=rngs)
    self.qkv = linear.column(d, (cfg.n_heads + 2 * cfg.kv_heads) * hd, init_std=cfg.init_std,
                             rngs=rngs)
    self.attn_out = linear.row(cfg.n_heads * hd, d, init_std=out_std, rngs=rngs)
    self.ln2 = self.norm(d, eps=cfg.ln_eps, dtype=dt, rngs=rngs)
    self.mlp_in = linear.column(d, self.mlp_in_per_hidden * cfg.d_ff, init_std=cfg.init_std,
                                rngs=rngs)
    self.mlp_out = linear.row(cfg.d_ff, d, init_std=out_std, rngs=rngs)

  def attend(self, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """Causal attention of the heads q, k, v carry, then the out-projection: in as many
    slices of the batch as the out-projection asks (`batch_parts`: a TP layer that exchanges
    its input, whose exchange of one slice may then run beside the next one's attention),
    each slice's attention apart."""
    b, t = q_BTNH.shape[:2]
    parts = self.attn_out.batch_parts(b)
    if parts == 1:
      o_BTNH = causal_attention(q_BTNH, k_BTKH, v_BTKH, self.attention_impl)
      return self.attn_out(o_BTNH.reshape(b, t, -1))
    os = [causal_attention(*qkv, self.attention_impl).reshape(b // parts, t, -1)
          for qkv in zip(*(jnp.split(a, parts) for a in (q_BTNH, k_BTKH, v_BTKH)))]
    return self.attn_out.in_parts(os)

  def __call__(self, h_BTD: jax.Array) -> jax.Array:
    h_BTD = h_BTD + self.attention(self.ln1(h_BTD)).astype(h_BTD.dtype)
    return h_BTD + self.mlp(self.ln2(h_BTD)).astype(h_BTD.dtype)


class Decoder(nnx.Module):
  """The whole model. A subclass names its config and block classes and may add position
  parameters (`add_positions`, which `embed` uses); `linear` is passed to every block (see
  models.layers)."""
  config_class: ClassVar[type[DecoderConfig]]
  block_class: ClassVar[type[DecoderBlock]]

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs,
               linear: LinearFactory | None = None):
    self.cfg = cfg
    dt = cfg.compute_dtype
    self.wte = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=dt, rngs=rngs)
    self.add_positions(rngs)
    self.blocks = nnx.List([self.block_class(cfg, rngs=rngs, linear=linear)
                            for _ in range(cfg.n_layers)])
    self.ln_f = self.block_class.norm(cfg.d_model, eps=cfg.ln_eps, dtype=dt, rngs=rngs)

  def add_positions(self, rngs: nnx.Rngs) -> None:
    """Creates the position parameters, drawn after the token table and before the blocks;
    none here (positions enter inside attention)."""

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """Tokens -> residual stream h_BTD (compute dtype)."""
    return self.wte(tokens_BT)

  def trunk(self, h_BTD: jax.Array) -> jax.Array:
    """All blocks and the final norm: residual stream in, normalized hidden out."""
    for block in self.blocks:
      h_BTD = nnx.remat(lambda b, h: b(h))(block, h_BTD) if self.cfg.remat else block(h_BTD)
    return self.ln_f(h_BTD)

  def head(self, h_BTD: jax.Array) -> jax.Array:
    """Tied LM head: logits_BTV (fp32) = h @ wte.T."""
    return self.wte.attend(h_BTD)

  def token_losses(self, h_BTD: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-token cross-entropy (fp32) of the head's logits against `targets_BT`."""
    logits_BTV = self.head(h_BTD)
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    tgt_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logz_BT - tgt_BT

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    return self.head(self.trunk(self.embed(tokens_BT)))


def loss_fn(model: Decoder, tokens_BT: jax.Array) -> tuple[jax.Array, dict]:
  """Mean next-token cross-entropy (fp32) of a [B, T+1] token batch, and aux metrics."""
  inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
  losses_BT = model.token_losses(model.trunk(model.embed(inputs_BT)), targets_BT)
  loss = jnp.mean(losses_BT)
  return loss, {'loss': loss}


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (nnx.Param leaves) in `model`."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def num_params(cfg: DecoderConfig) -> int:
  """Closed-form parameter count of the model `cfg` describes (no model built)."""
  return cfg.num_params()


def flops_per_token(cfg: DecoderConfig, seq_len: int | None = None) -> float:
  """Training FLOPs per token (fwd + bwd): 6 N + 12 L d T (PaLM appendix B).

  N counts the matmul parameters (all but lookup tables such as a position table; the tied
  token table counts once, for the head). T is the sequence length (cfg.max_seq_len if None).
  """
  t = cfg.max_seq_len if seq_len is None else seq_len
  n = cfg.num_params() - cfg.lookup_params
  return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * t
