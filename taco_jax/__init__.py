"""taco-jax: FP8 (TACO) compression of tensor-parallel communication, in JAX.

Layers, bottom up: `pallas_kernels` (the codec's GPU kernels) -> `codec` -> `policy` (when
compression pays) -> `collectives` -> `plan` (which codec each collective site uses) ->
`mappings` (Megatron's regions) and `monitor` -> `tp` (mesh, TP layers, pipeline, the step)
-> `train` (the trainer) -> `apps` (calibrate, sample, plot). `models` is the single-device
reference the parallel code is tested against; `configs` holds the experiment configs.
"""
import pathlib as _pathlib
import sys as _sys

from taco_jax import _moved

# `models/`, `pallas_kernels/` and `configs/` sit beside this package in a checkout and are
# installed inside it (pyproject's package-dir): make them `taco_jax.<name>` in a checkout too.
_checkout = _pathlib.Path(__file__).resolve().parent.parent
if (_checkout / 'pyproject.toml').is_file() and (_checkout / 'pallas_kernels').is_dir():
  __path__.append(str(_checkout))
if not any(isinstance(f, _moved.MovedModuleFinder) for f in _sys.meta_path):
  _sys.meta_path.append(_moved.MovedModuleFinder())

from taco_jax.codec import (Compressed, CompressionConfig, compress, decompress,  # noqa: E402
                            decompress_sum)

__all__ = ["Compressed", "CompressionConfig", "compress", "decompress", "decompress_sum"]
