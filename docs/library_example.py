"""The README's library example, complete (tests/test_readme.py runs it).

Run: JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu python docs/library_example.py
"""
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from taco_jax import CompressionConfig, compress, decompress, mappings

cfg = CompressionConfig()  # e4m3, groups of 128 along the last axis, dual scale, no Hadamard

# The codec alone: fp8 codes + two fp32 scales per group of 128 values of the LAST axis.
# A last dimension that is a multiple of group_size keeps the wire at 8.5 bits per value;
# any other is zero-padded to whole groups (correct, but the padding travels too).
x = jax.random.normal(jax.random.key(0), (4, 256))
x_hat = decompress(compress(x, cfg), cfg, jnp.float32)
print("codec relative error:", float(jnp.linalg.norm(x_hat - x) / jnp.linalg.norm(x)))

# A sequence-parallel MLP over all devices. The mesh needs Auto axes: jax.make_mesh makes
# Explicit ones by default, which jax.shard_map does not take here.
n = jax.device_count()
mesh = jax.make_mesh((n,), ("tensor",), axis_types=(AxisType.Auto,))
B, T, D, F = 2, 8 * n, 256, 128 * n  # activations are [B, T, D]; T is split over "tensor"


def mlp(x_BSD, w_in_DF, w_out_FD):  # per device: a sequence shard, 1/n of the MLP
  # forward: all-gather the sequence (axis=1); backward: reduce-scatter; both compressed
  x_BTD = mappings.gather_from_sp(x_BSD, "tensor", axis=1, fwd_compression=cfg,
                                  bwd_compression=cfg)
  h_BTF = jax.nn.gelu(x_BTD @ w_in_DF)  # column-parallel: this device's F / n columns
  y_BTD = h_BTF @ w_out_FD  # row-parallel: a partial sum over this device's rows
  # forward: reduce-scatter the partial sums along the sequence; backward: all-gather
  return mappings.reduce_scatter_to_sp(y_BTD, "tensor", axis=1, fwd_compression=cfg,
                                       bwd_compression=cfg)


layer = jax.jit(jax.shard_map(mlp, mesh=mesh, in_specs=(P(None, "tensor"), P(None, "tensor"),
                                                        P("tensor", None)),
                              out_specs=P(None, "tensor")))
k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
x_BTD = jax.random.normal(k1, (B, T, D))
w_in_DF = jax.random.normal(k2, (D, F)) / D**0.5
w_out_FD = jax.random.normal(k3, (F, D)) / F**0.5

y = layer(x_BTD, w_in_DF, w_out_FD)
y_ref = jax.nn.gelu(x_BTD @ w_in_DF) @ w_out_FD  # the same MLP on one device, no compression
layer_error = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
print(f"MLP on {n} devices, compressed both ways: relative error {layer_error:.4f}")

grads = jax.grad(lambda w1, w2: jnp.sum(layer(x_BTD, w1, w2) ** 2), argnums=(0, 1))(
    w_in_DF, w_out_FD)  # the backward pass's collectives are compressed too
print("gradient norms:", [float(jnp.linalg.norm(g)) for g in grads])
