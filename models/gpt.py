"""GPT-2 style decoder in Flax NNX, written once with injectable linear layers.

    tokens_BT -> embed (wte + wpe) -> n_layers x Block -> ln_f -> tied head (h @ wte.T)
    Block:  h += attn_out(attention(qkv(ln1(h))));  h += mlp_out(gelu(mlp_in(ln2(h))))

Parameters are fp32; matmuls run in `GPTConfig.dtype` (bf16 by default); attention
softmax, LayerNorm statistics, logits and the loss are fp32. The four linear layers of a
block come from a `models.layers.LinearFactory`; the attention derives its head count
from the width the QKV projection returns, so a tensor-parallel factory (heads / tp local
heads) runs the same code. Embedding, head and loss are separate methods for the same
reason (a TP model makes them vocab-parallel).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning

from taco_jax.models.layers import DenseFactory, Embedding, LinearFactory, layer_norm, normal_init

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
ATTENTION = ('auto', 'cudnn', 'xla')  # GPTConfig.attention
# Fields a shared `config.model` section may carry for another block (models.qwen).
SHARED_MODEL_FIELDS = frozenset({'block', 'n_kv_heads', 'rope_theta'})


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256      # token ids are in [0, vocab_size); 256 for the byte tokenizer
  n_layers: int = 4          # number of transformer blocks
  d_model: int = 128         # width of the residual stream
  n_heads: int = 4           # attention heads; d_model must be divisible by it
  d_ff: int = 512            # MLP hidden width (GPT-2: 4 * d_model)
  max_seq_len: int = 128     # learned position embeddings; longest input the model takes
  dtype: str = 'bfloat16'    # compute dtype: float32 | bfloat16 | float16 (params stay fp32)
  ln_eps: float = 1e-5       # LayerNorm epsilon
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

  def num_params(self) -> int:
    """Closed-form parameter count of `GPT(self)`."""
    d, f, L = self.d_model, self.d_ff, self.n_layers
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return self.vocab_size * d + self.lookup_params + L * block + 2 * d

  @property
  def lookup_params(self) -> int:
    """Parameters used by lookup only (the position table): no matmul FLOPs."""
    return self.max_seq_len * self.d_model

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  def attention_backend(self, seq_len: int | None = None) -> str:
    """What `causal_attention` runs for this model ('cudnn' | 'xla'), with sequences of
    `seq_len` (cfg.max_seq_len if None); a ValueError if `attention` asks for what cannot run."""
    t = self.max_seq_len if seq_len is None else seq_len
    kv = getattr(self, 'n_kv_heads', self.n_heads)
    q, k = ((1, t, n, self.head_dim) for n in (self.n_heads, kv))
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

  @classmethod
  def from_dict(cls, d) -> 'GPTConfig':
    """From a mapping (e.g. `config.model`); unknown keys are an error.

    The model section is shared by every block, so the fields of the others (`block`,
    and Qwen's `n_kv_heads`, `rope_theta`) are accepted and ignored; `block` must name this
    class's block (`models.qwen.model_config` picks the class from it).
    """
    d = dict(d.to_dict() if hasattr(d, 'to_dict') else d)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names - SHARED_MODEL_FIELDS)
    if unknown:
      raise ValueError(f'unknown model config field(s) {unknown}; known: '
                       f'{sorted(names | SHARED_MODEL_FIELDS)}')
    block = d.get('block', 'gpt')
    if block != getattr(cls, 'block', 'gpt'):
      raise ValueError(f'model.block={block!r} is not the block of {cls.__name__}; build the '
                       'config with models.qwen.model_config')
    return cls(**{k: v for k, v in d.items() if k in names})


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
  """'cudnn' or 'xla' for `requested` ('auto' | 'cudnn' | 'xla', `GPTConfig.attention`):
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


# Logical axes of attention's inputs. A no-op unless the caller sets flax axis rules under a
# mesh (the GSPMD baseline does: cuDNN's partitioner refuses a sequence-sharded input, which
# the partitioner would otherwise propagate from a sequence-parallel residual stream).
HEAD_AXES = ('batch', 'length', 'heads', 'head_dim')


def causal_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                     implementation: str = 'auto') -> jax.Array:
  """Causal softmax attention over however many heads N the inputs carry (K KV heads, K
  dividing N), through `attention_implementation(implementation, ...)`: cuDNN flash
  attention, or XLA's (fp32 softmax)."""
  impl = attention_implementation(implementation, q_BTNH, k_BTKH, v_BTKH)
  q_BTNH, k_BTKH, v_BTKH = (partitioning.with_sharding_constraint(a, HEAD_AXES)
                            for a in (q_BTNH, k_BTKH, v_BTKH))
  return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                      implementation=impl)


class Block(nnx.Module):
  """Pre-LN transformer block; its linear layers come from `linear` (a LinearFactory)."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, linear: LinearFactory | None = None):
    linear = linear or DenseFactory(cfg.compute_dtype)
    dt, d, out_std = cfg.compute_dtype, cfg.d_model, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.head_dim, self.attention_impl = cfg.head_dim, cfg.attention
    self.ln1 = layer_norm(d, eps=cfg.ln_eps, dtype=dt, rngs=rngs)
    # Output laid out head-major, [n_heads, 3 (q|k|v), head_dim]: a contiguous shard = whole heads.
    self.qkv = linear.column(d, 3 * d, init_std=cfg.init_std, rngs=rngs)
    self.attn_out = linear.row(d, d, init_std=out_std, rngs=rngs)
    self.ln2 = layer_norm(d, eps=cfg.ln_eps, dtype=dt, rngs=rngs)
    self.mlp_in = linear.column(d, cfg.d_ff, init_std=cfg.init_std, rngs=rngs)
    self.mlp_out = linear.row(cfg.d_ff, d, init_std=out_std, rngs=rngs)

  def attention(self, x_BTD: jax.Array) -> jax.Array:
    qkv_BTF = self.qkv(x_BTD)
    b, t, f = qkv_BTF.shape
    n_local = f // (3 * self.head_dim)  # local heads: whatever the projection produced
    qkv = qkv_BTF.reshape(b, t, n_local, 3, self.head_dim)
    o_BTNH = causal_attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2],
                              self.attention_impl)
    return self.attn_out(o_BTNH.reshape(b, t, n_local * self.head_dim))

  def mlp(self, x_BTD: jax.Array) -> jax.Array:
    return self.mlp_out(jax.nn.gelu(self.mlp_in(x_BTD), approximate=True))

  def __call__(self, h_BTD: jax.Array) -> jax.Array:
    h_BTD = h_BTD + self.attention(self.ln1(h_BTD)).astype(h_BTD.dtype)
    return h_BTD + self.mlp(self.ln2(h_BTD)).astype(h_BTD.dtype)


class GPT(nnx.Module):
  """The whole model. `linear` is passed to every block (see models.layers)."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, linear: LinearFactory | None = None):
    self.cfg = cfg
    dt = cfg.compute_dtype
    self.wte = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=dt, rngs=rngs)
    self.wpe = nnx.Param(normal_init(0.01)(rngs.params(), (cfg.max_seq_len, cfg.d_model),
                                           jnp.float32))
    self.blocks = nnx.List([Block(cfg, rngs=rngs, linear=linear) for _ in range(cfg.n_layers)])
    self.ln_f = layer_norm(cfg.d_model, eps=cfg.ln_eps, dtype=dt, rngs=rngs)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """Token + learned position embeddings -> residual stream h_BTD (compute dtype)."""
    t = tokens_BT.shape[1]
    return self.wte(tokens_BT) + self.wpe[...][:t].astype(self.cfg.compute_dtype)

  def trunk(self, h_BTD: jax.Array) -> jax.Array:
    """All blocks and the final LayerNorm: residual stream in, normalized hidden out."""
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


def loss_fn(model: GPT, tokens_BT: jax.Array) -> tuple[jax.Array, dict]:
  """Mean next-token cross-entropy (fp32) of a [B, T+1] token batch, and aux metrics."""
  inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
  losses_BT = model.token_losses(model.trunk(model.embed(inputs_BT)), targets_BT)
  loss = jnp.mean(losses_BT)
  return loss, {'loss': loss}


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (nnx.Param leaves) in `model`."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def num_params(cfg: GPTConfig) -> int:
  """Closed-form parameter count of the model `cfg` describes (no model built)."""
  return cfg.num_params()


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
  """Training FLOPs per token (fwd + bwd): 6 N + 12 L d T (PaLM appendix B).

  N counts the matmul parameters (all but the position table, which is a lookup; the tied
  token table counts once, for the head). T is the sequence length (cfg.max_seq_len if None).
  """
  t = cfg.max_seq_len if seq_len is None else seq_len
  n = cfg.num_params() - cfg.lookup_params
  return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * t
