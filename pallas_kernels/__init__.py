"""Fused FP8 (TACO) codec kernels, each beside the pure-jnp reference that specifies it.

Layout: every function takes 2-D inputs ``[rows, groups * group_size]`` (the codec in
``taco_jax.codec`` flattens leading dimensions and pads the last one); groups of
``group_size`` contiguous elements run along the last axis.
"""
from taco_jax.pallas_kernels import wire
from taco_jax.pallas_kernels.common import FP8_DTYPES, FP8_MAX, hadamard_matrix
from taco_jax.pallas_kernels.decode import (decode, decode_reference, decode_sum,
                                            decode_sum_reference, decode_sum_wire, decode_wire)
from taco_jax.pallas_kernels.encode import encode, encode_reference

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "hadamard_matrix",
    "encode",
    "encode_reference",
    "decode",
    "decode_reference",
    "decode_sum",
    "decode_sum_reference",
    "decode_wire",
    "decode_sum_wire",
    "wire",
]
