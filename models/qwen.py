"""Qwen-style decoder, written like `models.gpt` with injectable linear layers.

    tokens_BT -> wte -> n_layers x QwenBlock -> RMSNorm -> tied head (h @ wte.T)
    QwenBlock: h += o(attention(rope(qkv(rms1(h)))));  h += down(silu(gate) * up)(rms2(h))

Differences from the GPT block: RMSNorm instead of LayerNorm, SwiGLU MLP, rotary position
embeddings (no learned position table), grouped-query attention (`n_kv_heads` KV heads
shared by n_heads / n_kv_heads query heads each). Linear layers keep their biases (the
`LinearFactory` contract has no bias switch; Qwen2 itself has biases on QKV only).

Layouts that keep tensor-parallel shards whole (a contiguous 1/tp of the output):
  * QKV output is KV-group-major: [n_kv_heads, n_heads / n_kv_heads + 2, head_dim]
    (the group's query heads, then its K, then its V); tp must divide n_kv_heads.
  * MLP-in output is [d_ff, 2] (gate, up interleaved), so a shard holds matching pairs.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models.gpt import GPT, GPTConfig, causal_attention
from taco_jax.models.layers import DenseFactory, Embedding, LinearFactory


@dataclasses.dataclass(frozen=True)
class QwenConfig(GPTConfig):
  block: str = "qwen"        # model family tag (configs select it with model.block = "qwen")
  n_kv_heads: int = 2        # KV heads of grouped-query attention; must divide n_heads
  rope_theta: float = 10000.0  # rotary embedding base

  lookup_params = 0           # no position table (rotary embeddings)

  def num_params(self) -> int:
    """Closed-form parameter count of `Qwen(self)` (GQA + SwiGLU blocks, biases kept)."""
    d, f, L, hd = self.d_model, self.d_ff, self.n_layers, self.head_dim
    qkv = (self.n_heads + 2 * self.n_kv_heads) * hd
    block = 2 * d + (d * qkv + qkv) + (self.n_heads * hd * d + d) + (d * 2 * f + 2 * f) + (
        f * d + d)
    return self.vocab_size * d + L * block + d

  def __post_init__(self):
    super().__post_init__()
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads="
                       f"{self.n_kv_heads}")


def rms_norm(d_model: int, *, eps: float, dtype, rngs: nnx.Rngs) -> nnx.RMSNorm:
  """RMSNorm with an fp32 scale, statistics in fp32, output in `dtype`."""
  return nnx.RMSNorm(d_model, epsilon=eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def rope(x_BTNH: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half form) at positions 0..T-1, computed in fp32."""
  t, h = x_BTNH.shape[1], x_BTNH.shape[-1]
  inv = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  ang_TH = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
  cos, sin = jnp.cos(ang_TH)[None, :, None, :], jnp.sin(ang_TH)[None, :, None, :]
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


class QwenBlock(nnx.Module):
  """Pre-RMSNorm GQA + SwiGLU block; its linear layers come from `linear`."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, linear: LinearFactory | None = None):
    linear = linear or DenseFactory(cfg.compute_dtype)
    dt, d, hd = cfg.compute_dtype, cfg.d_model, cfg.head_dim
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.head_dim, self.group, self.theta = hd, cfg.n_heads // cfg.n_kv_heads, cfg.rope_theta
    self.attention_impl = cfg.attention
    self.ln1 = rms_norm(d, eps=cfg.ln_eps, dtype=dt, rngs=rngs)
    self.qkv = linear.column(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, init_std=cfg.init_std,
                             rngs=rngs)
    self.attn_out = linear.row(cfg.n_heads * hd, d, init_std=out_std, rngs=rngs)
    self.ln2 = rms_norm(d, eps=cfg.ln_eps, dtype=dt, rngs=rngs)
    self.mlp_in = linear.column(d, 2 * cfg.d_ff, init_std=cfg.init_std, rngs=rngs)
    self.mlp_out = linear.row(cfg.d_ff, d, init_std=out_std, rngs=rngs)

  def attention(self, x_BTD: jax.Array) -> jax.Array:
    qkv_BTF = self.qkv(x_BTD)
    b, t, f = qkv_BTF.shape
    g, hd = self.group, self.head_dim
    k_local = f // ((g + 2) * hd)  # local KV heads: whatever the projection produced
    qkv = qkv_BTF.reshape(b, t, k_local, g + 2, hd)
    q_BTNH = rope(qkv[:, :, :, :g].reshape(b, t, k_local * g, hd), self.theta)
    k_BTKH = rope(qkv[:, :, :, g], self.theta)
    o_BTNH = causal_attention(q_BTNH, k_BTKH, qkv[:, :, :, g + 1], self.attention_impl)
    return self.attn_out(o_BTNH.reshape(b, t, k_local * g * hd))

  def mlp(self, x_BTD: jax.Array) -> jax.Array:
    gu = self.mlp_in(x_BTD)
    gu = gu.reshape(*gu.shape[:-1], gu.shape[-1] // 2, 2)
    return self.mlp_out(jax.nn.silu(gu[..., 0]) * gu[..., 1])

  def __call__(self, h_BTD: jax.Array) -> jax.Array:
    h_BTD = h_BTD + self.attention(self.ln1(h_BTD)).astype(h_BTD.dtype)
    return h_BTD + self.mlp(self.ln2(h_BTD)).astype(h_BTD.dtype)


class Qwen(GPT):
  """The whole Qwen-style model; same methods as `GPT` (embed, trunk, head, token_losses)."""

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, linear: LinearFactory | None = None):
    self.cfg = cfg
    dt = cfg.compute_dtype
    self.wte = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=dt, rngs=rngs)
    self.blocks = nnx.List([QwenBlock(cfg, rngs=rngs, linear=linear)
                            for _ in range(cfg.n_layers)])
    self.ln_f = rms_norm(cfg.d_model, eps=cfg.ln_eps, dtype=dt, rngs=rngs)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    return self.wte(tokens_BT)


CONFIGS = {"gpt": GPTConfig, "qwen": QwenConfig}  # model.block -> its config class


def model_config(section) -> GPTConfig | QwenConfig:
  """`config.model` (a mapping) -> GPTConfig (model.block "gpt", the default) or QwenConfig
  (block "qwen"). Fields of neither class are an error that lists the known ones."""
  d = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  block = d.get("block", "gpt")
  if block not in CONFIGS:
    raise ValueError(f"model.block={block!r} is unknown; use one of {sorted(CONFIGS)}")
  return CONFIGS[block].from_dict(d)
