"""Qwen-style decoder (`models.decoder` with rotary positions, RMSNorm, GQA, a SwiGLU MLP).

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

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models.decoder import Decoder, DecoderBlock, DecoderConfig
from taco_jax.models.layers import LinearFactory


@dataclasses.dataclass(frozen=True)
class QwenConfig(DecoderConfig):
  """The shared fields (see `DecoderConfig`) and grouped-query attention's and rotary
  embeddings' own."""
  block = 'qwen'
  n_kv_heads: int = 2        # KV heads of grouped-query attention; must divide n_heads
  rope_theta: float = 10000.0  # rotary embedding base

  def __post_init__(self):
    super().__post_init__()
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads="
                       f"{self.n_kv_heads}")

  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads

  def num_params(self) -> int:
    """Closed-form parameter count of `Qwen(self)` (GQA + SwiGLU blocks, biases kept)."""
    d, f, L, hd = self.d_model, self.d_ff, self.n_layers, self.head_dim
    qkv = (self.n_heads + 2 * self.n_kv_heads) * hd
    block = 2 * d + (d * qkv + qkv) + (self.n_heads * hd * d + d) + (d * 2 * f + 2 * f) + (
        f * d + d)
    return self.vocab_size * d + L * block + d


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


class QwenBlock(DecoderBlock):
  """Pre-RMSNorm block: grouped-query attention with rotary positions, SwiGLU MLP."""
  norm = staticmethod(rms_norm)
  mlp_in_per_hidden = 2  # gate and up

  def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, linear: LinearFactory | None = None):
    super().__init__(cfg, rngs=rngs, linear=linear)
    self.group, self.theta = cfg.n_heads // cfg.n_kv_heads, cfg.rope_theta

  def attention(self, x_BTD: jax.Array) -> jax.Array:
    qkv_BTF = self.qkv(x_BTD)
    b, t, f = qkv_BTF.shape
    g, hd = self.group, self.head_dim
    k_local = f // ((g + 2) * hd)  # local KV heads: whatever the projection produced
    qkv = qkv_BTF.reshape(b, t, k_local, g + 2, hd)
    q_BTNH = rope(qkv[:, :, :, :g].reshape(b, t, k_local * g, hd), self.theta)
    k_BTKH = rope(qkv[:, :, :, g], self.theta)
    return self.attend(q_BTNH, k_BTKH, qkv[:, :, :, g + 1])

  def mlp(self, x_BTD: jax.Array) -> jax.Array:
    gu = self.mlp_in(x_BTD)
    gu = gu.reshape(*gu.shape[:-1], gu.shape[-1] // 2, 2)
    return self.mlp_out(jax.nn.silu(gu[..., 0]) * gu[..., 1])


class Qwen(Decoder):
  """The whole Qwen-style model: `Decoder` with Qwen blocks (positions are rotary)."""
  config_class = QwenConfig
  block_class = QwenBlock
