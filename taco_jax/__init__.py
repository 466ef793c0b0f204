"""taco-jax: FP8 (TACO) compression of tensor-parallel communication, in JAX."""
from taco_jax.codec import Compressed, CompressionConfig, compress, decompress, decompress_sum

__all__ = ["Compressed", "CompressionConfig", "compress", "decompress", "decompress_sum"]
