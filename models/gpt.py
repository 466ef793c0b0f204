"""GPT-2 style decoder (`models.decoder` with learned positions, LayerNorm, a GELU MLP).

    tokens_BT -> wte + wpe -> n_layers x Block -> LayerNorm -> tied head (h @ wte.T)
    Block:  h += attn_out(attention(qkv(ln1(h))));  h += mlp_out(gelu(mlp_in(ln2(h))))

The attention derives its head count from the width the QKV projection returns, so a
tensor-parallel factory (heads / tp local heads) runs the same code.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models import gelu_mlp, split_qkv
from taco_jax.models.decoder import Decoder, DecoderBlock, DecoderConfig
from taco_jax.models.layers import layer_norm, normal_init


@dataclasses.dataclass(frozen=True)
class GPTConfig(DecoderConfig):
  """The shared fields (see `DecoderConfig`); `max_seq_len` sizes the position table."""
  block = 'gpt'
  # the MLP's GELU: 'xla' (its own passes) or 'fused' (in the MLP's GEMMs' epilogues,
  # `models.gelu_mlp`: Hopper GPUs, else XLA's, said once)
  mlp_gelu: str = 'xla'
  # the attention's q, k, v: 'xla' (sliced out of the QKV projection's output by a pass of
  # its own) or 'fused' (written apart by the projection's GEMM, `models.split_qkv`: Hopper
  # GPUs, else XLA's, said once)
  qkv_split: str = 'xla'

  def __post_init__(self):
    super().__post_init__()
    for field, choices in (('mlp_gelu', gelu_mlp.MLP_GELUS),
                           ('qkv_split', split_qkv.QKV_SPLITS)):
      if getattr(self, field) not in choices:
        raise ValueError(f'{field}={getattr(self, field)!r} is unknown; use one of {choices}')

  def num_params(self) -> int:
    """Closed-form parameter count of `GPT(self)`."""
    d, f, L = self.d_model, self.d_ff, self.n_layers
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return self.vocab_size * d + self.lookup_params + L * block + 2 * d

  @property
  def lookup_params(self) -> int:
    """The learned position table."""
    return self.max_seq_len * self.d_model


class Block(DecoderBlock):
  """Pre-LN block: multi-head attention, GELU MLP. The QKV output is laid out head-major,
  [n_heads, 3 (q|k|v), head_dim]: a contiguous shard is whole heads."""
  norm = staticmethod(layer_norm)

  def __init__(self, cfg: GPTConfig, **kw):
    super().__init__(cfg, **kw)
    self.mlp_gelu, self.qkv_split = cfg.mlp_gelu, cfg.qkv_split

  def attention(self, x_BTD: jax.Array) -> jax.Array:
    q_BTF, k_BTF, v_BTF = self.project_qkv(x_BTD)
    b, t, f = q_BTF.shape
    n_local = f // self.head_dim  # local heads: whatever the projection produced
    return self.attend(*(a.reshape(b, t, n_local, self.head_dim) for a in (q_BTF, k_BTF, v_BTF)))

  def project_qkv(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v ``[b, t, local heads * head_dim]`` from the QKV projection."""
    if self.qkv_split == 'fused':
      qkv = split_qkv.fused_qkv(self.qkv, x_BTD, self.head_dim)
      if qkv is not None:
        return qkv
    return split_qkv.split_heads(self.qkv(x_BTD), self.head_dim)

  def mlp(self, x_BTD: jax.Array) -> jax.Array:
    if self.mlp_gelu == 'fused':
      y_BTD = gelu_mlp.fused_mlp(self.mlp_in, self.mlp_out, x_BTD)
      if y_BTD is not None:
        return y_BTD
    return self.mlp_out(jax.nn.gelu(self.mlp_in(x_BTD), approximate=True))


class GPT(Decoder):
  """The whole model: `Decoder` with GPT blocks and a learned position table `wpe`."""
  config_class = GPTConfig
  block_class = Block

  def add_positions(self, rngs: nnx.Rngs) -> None:
    self.wpe = nnx.Param(normal_init(0.01)(rngs.params(), (self.cfg.max_seq_len,
                                                           self.cfg.d_model), jnp.float32))

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """Token + learned position embeddings -> residual stream h_BTD (compute dtype)."""
    t = tokens_BT.shape[1]
    return self.wte(tokens_BT) + self.wpe[...][:t].astype(self.cfg.compute_dtype)
