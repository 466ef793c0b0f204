"""Small single-device layers for the GPT model, and the linear-layer factory protocol.

The transformer block never builds its linear layers itself: it asks a `LinearFactory`
for "column" layers (in-projections: QKV, MLP-in) and "row" layers (out-projections:
attention-out, MLP-out). `DenseFactory` returns plain `Linear`s; a tensor-parallel
factory returns Megatron column/row-parallel layers (with their collectives) instead,
and the block code does not change.

Contract a factory must keep (what `Block` relies on):
  * `column(d_in, d_out, ...)` returns a module mapping x[..., d_in] -> y[..., d_out_local],
    where d_out_local = d_out for a dense layer, d_out / tp for a column-parallel one
    (contiguous output shard). The fused QKV projection is laid out head-major
    ([n_heads, 3, head_dim] along the output), so a contiguous shard holds whole heads.
  * `row(d_in, d_out, ...)` returns a module mapping y[..., d_in_local] -> x[..., d_out]
    (the row-parallel one reduces its partial sums over the tensor axis itself).
  * Sizes passed are GLOBAL sizes; the factory decides the local shapes.
  * For `model.mlp_gelu='fused'` (`models.gelu_mlp`), which runs the MLP's two matmuls
    itself: a column layer's `fused_operands(x)` gives its matmul's (input, weight, bias)
    and where the MLP's matmuls run (`gelu_mlp.LocalMatmuls`, or the TP kernels'), or None
    where it cannot give them; a row layer's `fused_takes()` says whether the MLP may run
    its matmul, and `fused_output(y)` finishes its output from that product. The QKV
    projection's column layer gives `model.qkv_split='fused'` (`models.split_qkv`) the same.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models.gelu_mlp import LocalMatmuls


def normal_init(std: float):
  """An initializer drawing N(0, std^2) in the requested dtype."""
  return nnx.initializers.normal(stddev=std)


class Linear(nnx.Module):
  """y = x @ w + b with fp32 parameters (`w_IO`, `b_O`) and matmuls in `dtype`."""

  def __init__(self, d_in: int, d_out: int, *, init_std: float, dtype, rngs: nnx.Rngs,
               use_bias: bool = True):
    self.dtype = dtype
    self.kernel = nnx.Param(normal_init(init_std)(rngs.params(), (d_in, d_out), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if use_bias else None

  def __call__(self, x_BTI: jax.Array) -> jax.Array:
    y_BTO = jnp.einsum('...i,io->...o', x_BTI.astype(self.dtype),
                       self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y_BTO = y_BTO + self.bias[...].astype(self.dtype)
    return y_BTO

  def batch_parts(self, batch: int) -> int:
    """In how many batch slices a block feeds this out-projection (a TP layer's hook)."""
    return 1

  # `models.gelu_mlp.fused_mlp`'s hooks: the layer's local matmul operands and output
  def fused_operands(self, x_BTI: jax.Array):
    """``(x, w, b, matmuls)`` of this in-projection, in the compute dtype (b in fp32)."""
    bias = self.bias[...] if self.bias is not None else jnp.zeros(self.kernel.shape[1:])
    return x_BTI.astype(self.dtype), self.kernel[...].astype(self.dtype), bias, LocalMatmuls()

  def fused_takes(self) -> bool:
    return True

  def fused_output(self, y_BTO: jax.Array) -> jax.Array:
    """This out-projection's output from its matmul's (the bias added)."""
    return y_BTO if self.bias is None else y_BTO + self.bias[...].astype(self.dtype)


class LinearFactory(Protocol):
  """Builds the block's linear layers (see the module docstring for the contract)."""

  def column(self, d_in: int, d_out: int, *, init_std: float, rngs: nnx.Rngs) -> nnx.Module:
    """An in-projection: full d_in in, d_out (or its local shard) out."""
    ...

  def row(self, d_in: int, d_out: int, *, init_std: float, rngs: nnx.Rngs) -> nnx.Module:
    """An out-projection: d_in (or its local shard) in, full d_out out."""
    ...


@dataclasses.dataclass(frozen=True)
class DenseFactory:
  """The single-device factory: both kinds are a plain `Linear` computing in `dtype`."""
  dtype: object = jnp.bfloat16  # compute dtype of the matmuls

  def column(self, d_in: int, d_out: int, *, init_std: float, rngs: nnx.Rngs) -> Linear:
    return Linear(d_in, d_out, init_std=init_std, dtype=self.dtype, rngs=rngs)

  def row(self, d_in: int, d_out: int, *, init_std: float, rngs: nnx.Rngs) -> Linear:
    return Linear(d_in, d_out, init_std=init_std, dtype=self.dtype, rngs=rngs)


class Embedding(nnx.Module):
  """Token table `w_VD` (fp32), used for the input lookup and the tied LM head."""

  def __init__(self, vocab: int, d_model: int, *, init_std: float, dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = nnx.Param(normal_init(init_std)(rngs.params(), (vocab, d_model),
                                                     jnp.float32))

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens_BT, axis=0).astype(self.dtype)

  def attend(self, h_BTD: jax.Array) -> jax.Array:
    """Tied head: logits_BTV = h @ w.T, accumulated and returned in fp32."""
    return jnp.einsum('btd,vd->btv', h_BTD.astype(self.dtype),
                      self.embedding[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)


def layer_norm(d_model: int, *, eps: float, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """Pre-LN norm: fp32 scale/bias, statistics in fp32, output in `dtype`."""
  return nnx.LayerNorm(d_model, epsilon=eps, dtype=dtype, param_dtype=jnp.float32,
                       rngs=rngs)
