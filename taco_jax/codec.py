"""The TACO FP8 codec: configuration, ``compress``, ``decompress``, ``decompress_sum``.

Groups of ``group_size`` contiguous elements run along the last axis. A last dimension that
is not a multiple of the group size is zero-padded up to one (codes carry the padded
length; ``decompress`` cuts the padding off again), so any shape works mid-training. An
empty array (no rows, or an empty last dimension: an empty shard) encodes to empty codes
and scales and decodes to an empty array, without running a kernel.
``None`` means "no compression" everywhere a ``CompressionConfig`` is accepted.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from taco_jax import pallas_kernels
from taco_jax import _measured

Format = Literal["e4m3", "e5m2"]
Implementation = Literal["auto", "pallas", "xla"]


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
  """How one collective compresses what it sends. Hashable, so usable as a static arg.

  Per group of `group_size` contiguous values along the last axis: an RMS pre-scale, an
  optional Walsh-Hadamard transform, an absmax post-scale, a cast to FP8 (docs/codec.md).

  Attributes:
    format: FP8 format of the codes: "e4m3" (max 448, 3 mantissa bits; the default) or
      "e5m2" (max 57344, 2 mantissa bits: twice the rounding error, more range).
    group_size: values per group along the last axis (power of two, 32..512). Each group
      sends two fp32 scales, so the wire costs 8 + 64 / group_size bits per value (8.5 at
      128); a last dimension that is not a multiple of it is zero-padded to whole groups.
    hadamard: transform each group before quantizing (TACO's choice). Off by default: it
      spreads a group's error evenly, so small values get large relative errors.
    dual_scale: the RMS pre-scale alpha = 1 / sqrt(mean(x^2) + lam) before the transform
      (False: alpha = 1). It changes the codes only for groups so small that the post-
      scale's lower clip binds, where it keeps their precision.
    lam: added to mean(x^2) under the pre-scale's square root, so an all-zero group is safe.
    implementation: "auto" (the Pallas kernels on GPU, the jnp reference elsewhere),
      "pallas" or "xla" (the jnp reference, which XLA fuses into its neighbours).
    min_bytes: messages smaller than this (bytes per device) are sent uncompressed.
    link: compress only the message sizes measured to pay on this kind of link:
      "nvlink", "p2p_disabled" (traffic through host memory), "auto" (on GPU
      "p2p_disabled" when NCCL_P2P_DISABLE=1, else "nvlink"; off GPU every message), or
      None (every message from min_bytes on). See `taco_jax.policy.pays_for`.
  """

  format: Format = "e4m3"  # FP8 format of the codes: e4m3 (max 448) or e5m2 (max 57344).
  group_size: int = 128  # Elements per group along the last axis; power of two, 32..512.
  # Walsh-Hadamard-transform each group before quantizing. Off by default: it spreads each
  # group's error evenly over its elements, and training measured worse with it (GPT 12 x 768,
  # 86M parameters, TP=4, 2000 steps: val loss +3.1% with, +0.16% without over six seeds;
  # benchmarks/results/accuracy_*).
  hadamard: bool = False
  dual_scale: bool = True  # RMS pre-scale alpha before the transform (else alpha = 1).
  lam: float = 1e-6  # Added to mean(x^2) before the RMS pre-scale's square root.
  implementation: Implementation = "auto"  # auto: Pallas on GPU, the jnp reference elsewhere.
  min_bytes: int = 0  # Collectives send messages smaller than this (per device) uncompressed.
  # Compress only the sizes measured to pay on this link (`policy.pays_for`): "nvlink",
  # "p2p_disabled", None (no measured sizes: min_bytes alone), or "auto"
  # (`policy.resolved_link`).
  link: str | None = "auto"

  def __post_init__(self):
    if self.format not in pallas_kernels.FP8_DTYPES:
      raise ValueError(f"format must be one of {sorted(pallas_kernels.FP8_DTYPES)}, "
                       f"got {self.format!r}")
    g = self.group_size
    if not isinstance(g, int) or g < 32 or g > 512 or g & (g - 1):
      raise ValueError(f"group_size must be a power of two in [32, 512], got {g!r}")
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError("implementation must be 'auto', 'pallas' or 'xla', "
                       f"got {self.implementation!r}")
    if not self.lam >= 0:
      raise ValueError(f"lam must be >= 0, got {self.lam!r}")
    if self.min_bytes < 0:
      raise ValueError(f"min_bytes must be >= 0, got {self.min_bytes!r}")
    if self.link not in (None, "auto", *_measured.MIN_BYTES):
      raise ValueError(f"link must be None, 'auto' or one of {sorted(_measured.MIN_BYTES)} "
                       f"(links benchmarked in benchmarks/results), got {self.link!r}")

  @property
  def fp8_dtype(self):
    return pallas_kernels.FP8_DTYPES[self.format]

  @property
  def bits_per_element(self) -> float:
    """Wire cost: 8 bits of code plus two fp32 scales per group."""
    return self.wire_bits(self.group_size)

  def wire_bits(self, width: int) -> float:
    """Wire bits per element of a message whose last dimension is ``width``: the codes of
    the width padded to whole groups plus two fp32 scales per group (``bits_per_element``
    when ``width`` is a multiple of the group size; more when a group overhangs it)."""
    groups = -(-width // self.group_size)
    return groups * (8 * self.group_size + 64) / width

  def resolved_implementation(self, sum_of: int = 0) -> str:
    """"auto": Pallas on GPU, the jnp reference elsewhere; except decode-and-sum of
    ``sum_of`` >= 4 chunks without the Hadamard transform, where XLA's fusion of the
    reference measured faster than the kernel on an H200 (0.82-0.85x at N = 4 and 8,
    64 MiB-1 GiB; benchmarks/results/codec_*)."""
    if self.implementation != "auto":
      return self.implementation
    if jax.default_backend() != "gpu" or (sum_of >= 4 and not self.hadamard):
      return "xla"
    return "pallas"

  def kernel_kwargs(self, sum_of: int = 0) -> dict:
    """``implementation``/``interpret`` for the dispatchers: the Pallas kernels run through
    Triton on GPU and in interpret mode (slow, for tests) on any other backend."""
    impl = self.resolved_implementation(sum_of)
    return dict(implementation=impl,
                interpret=impl == "pallas" and jax.default_backend() != "gpu")


def _static():
  return dataclasses.field(metadata=dict(static=True))


# The settings that decoding depends on; dual_scale and lam only shape the scales, which
# travel with the codes.
_DECODE_FIELDS = ("format", "group_size", "hadamard")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Compressed:
  """FP8 codes and their per-group scales, and how they were encoded; a pytree, so it can
  cross collectives (what it records is static metadata).

  ``codes``: x's shape with the last dim padded to a multiple of the group size.
  ``alpha``/``scale``: fp32, x's leading shape + (padded last dim / group size,).
  ``size``: x's true last dimension.
  ``format``, ``group_size``, ``hadamard``, ``dual_scale``, ``lam``: the encoding's
  ``CompressionConfig`` fields. ``decompress`` refuses a config that decodes differently
  (another format, group size or transform): that would give plausible garbage.
  """

  codes: jax.Array
  alpha: jax.Array
  scale: jax.Array
  size: int = _static()
  format: Format = _static()
  group_size: int = _static()
  hadamard: bool = _static()
  dual_scale: bool = _static()
  lam: float = _static()


def _check_encoding(c: Compressed, cfg: CompressionConfig, what: str) -> None:
  """``c`` decodes with ``cfg`` (same format, group size and transform), and its arrays
  have the shapes of groups of its group size."""
  bad = [f for f in _DECODE_FIELDS if getattr(c, f) != getattr(cfg, f)]
  if bad:
    enc, dec = (", ".join(f"{f}={getattr(o, f)!r}" for f in bad) for o in (c, cfg))
    raise ValueError(f"{what}: the codes were encoded with {enc}, but the config given "
                     f"decodes with {dec}; decode with the settings they were encoded with")
  *lead, padded = c.codes.shape
  g = c.group_size
  groups = (*lead, padded // g)
  if (padded % g or c.alpha.shape != groups or c.scale.shape != groups
      or not padded - g < c.size <= padded
      or c.codes.dtype != pallas_kernels.FP8_DTYPES[c.format]):
    raise ValueError(
        f"{what}: codes {c.codes.dtype}{list(c.codes.shape)}, alpha {list(c.alpha.shape)} and "
        f"scale {list(c.scale.shape)} of size {c.size} are not {c.format} codes of groups of "
        f"{g} (codes [..., size padded to groups], alpha and scale [..., groups])")


def _check_input(x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"compress expects a floating-point array, got dtype {x.dtype}")
  if x.ndim < 1:
    raise ValueError("compress expects an array with at least one dimension")


def _pad_groups(x, cfg: CompressionConfig):
  """x with its last dimension zero-padded to whole groups, as [rows, padded] and its
  leading shape."""
  _check_input(x)
  g = cfg.group_size
  size = x.shape[-1]
  padded = -(-size // g) * g
  if padded != size:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - size)])
  return x.reshape(math.prod(x.shape[:-1]), padded), x.shape[:-1]


def _empty(shape, dtype, like):
  """An empty array of ``shape`` and ``dtype`` made from the empty array ``like``, so that
  inside a ``check_vma=True`` shard_map it varies over the same mesh axes."""
  return like.astype(dtype).reshape(shape)


def _encode(x_RD, cfg: CompressionConfig, packed: bool = False):
  """``pallas_kernels.encode`` of ``[rows, padded]``; with no rows or no groups (an empty
  shard) nothing is encoded: empty outputs of the right shapes, as the kernels need at
  least one group and one row."""
  if x_RD.size:
    return pallas_kernels.encode(
        x_RD, group_size=cfg.group_size, fmt=cfg.format, hadamard=cfg.hadamard,
        dual_scale=cfg.dual_scale, lam=cfg.lam, packed=packed, **cfg.kernel_kwargs())
  rows, d = x_RD.shape
  if packed:
    return _empty((rows, pallas_kernels.wire.width(d, cfg.group_size)), jnp.uint8, x_RD)
  k = d // cfg.group_size
  return (_empty((rows, d), cfg.fp8_dtype, x_RD), _empty((rows, k), jnp.float32, x_RD),
          _empty((rows, k), jnp.float32, x_RD))


def _decode(kernel, first, *inputs, d: int, dtype, **kwargs):
  """``kernel(first, *inputs, **kwargs)``, one of the ``pallas_kernels`` decoders, whose
  output is ``[rows, d]`` (rows: ``first``'s next-to-last dim); empty (an empty shard)
  without running it."""
  rows = first.shape[-2]
  if rows and d:
    return kernel(first, *inputs, out_dtype=dtype, **kwargs)
  return _empty((rows, d), dtype, first)


def _check_stacked(shape, what: str) -> None:
  """``what`` sums N >= 1 messages stacked on axis 0 of an array of ``shape``."""
  if len(shape) < 2 or shape[0] == 0:
    raise ValueError(f"{what} expects N >= 1 messages stacked on axis 0 (shape [N, ..., "
                     f"last dim]), got shape {tuple(shape)}")


def compress(x, cfg: CompressionConfig) -> Compressed:
  """Encodes ``x`` (any leading dims, groups along the last axis) to FP8 + scales."""
  x_RD, lead = _pad_groups(x, cfg)
  codes, alpha, scale = _encode(x_RD, cfg)
  padded = x_RD.shape[-1]
  k = padded // cfg.group_size
  return Compressed(codes.reshape(*lead, padded), alpha.reshape(*lead, k),
                    scale.reshape(*lead, k), x.shape[-1], cfg.format, cfg.group_size,
                    cfg.hadamard, cfg.dual_scale, cfg.lam)


def decompress(c: Compressed, cfg: CompressionConfig, dtype=jnp.bfloat16):
  """Inverse of ``compress``: returns an array of x's shape in ``dtype``. ``cfg`` must
  decode as the codes were encoded (``Compressed`` records how); it picks the
  implementation."""
  _check_encoding(c, cfg, "decompress")
  *lead, padded = c.codes.shape
  rows, k = math.prod(lead), padded // cfg.group_size
  out = _decode(pallas_kernels.decode, c.codes.reshape(rows, padded), c.alpha.reshape(rows, k),
                c.scale.reshape(rows, k), d=padded, dtype=dtype, group_size=cfg.group_size,
                hadamard=cfg.hadamard, **cfg.kernel_kwargs())
  return out.reshape(*lead, padded)[..., :c.size]


def decompress_sum(c: Compressed, cfg: CompressionConfig, dtype=jnp.bfloat16):
  """Decodes N chunks stacked on axis 0 of ``c`` and sums them in fp32, in one pass."""
  _check_stacked(c.codes.shape, "decompress_sum")
  _check_encoding(c, cfg, "decompress_sum")
  n, *lead, padded = c.codes.shape
  rows, k = math.prod(lead), padded // cfg.group_size
  out = _decode(pallas_kernels.decode_sum, c.codes.reshape(n, rows, padded),
                c.alpha.reshape(n, rows, k), c.scale.reshape(n, rows, k), d=padded,
                dtype=dtype, group_size=cfg.group_size, hadamard=cfg.hadamard,
                **cfg.kernel_kwargs(sum_of=n))
  return out.reshape(*lead, padded)[..., :c.size]


# --- the wire format: codes and scales in one uint8 buffer (pallas_kernels.wire) -------


def to_wire(x, cfg: CompressionConfig):
  """``compress`` straight to wire rows: uint8 ``[..., P + 8 P / G]`` for x ``[..., D]``
  (P: D padded to whole groups), the codes then the scales of each row in one buffer, so a
  collective moves a message in one transfer. The encode kernel writes it directly."""
  x_RD, lead = _pad_groups(x, cfg)
  w = _encode(x_RD, cfg, packed=True)
  return w.reshape(*lead, w.shape[-1])


def from_wire(w, cfg: CompressionConfig, size: int, dtype=jnp.bfloat16):
  """Inverse of ``to_wire`` for a message whose true last dimension is ``size``."""
  *lead, width = w.shape
  d = pallas_kernels.wire.message_width(width, cfg.group_size)
  out = _decode(pallas_kernels.decode_wire, w.reshape(math.prod(lead), width), d=d,
                dtype=dtype, group_size=cfg.group_size, fmt=cfg.format, hadamard=cfg.hadamard,
                **cfg.kernel_kwargs())
  return out.reshape(*lead, d)[..., :size]


def sum_from_wire(w, cfg: CompressionConfig, size: int, dtype=jnp.bfloat16):
  """``decompress_sum`` of N messages' wire rows stacked on axis 0, in one pass."""
  _check_stacked(w.shape, "sum_from_wire")
  n, *lead, width = w.shape
  d = pallas_kernels.wire.message_width(width, cfg.group_size)
  out = _decode(pallas_kernels.decode_sum_wire, w.reshape(n, math.prod(lead), width), d=d,
                dtype=dtype, group_size=cfg.group_size, fmt=cfg.format, hadamard=cfg.hadamard,
                **cfg.kernel_kwargs(sum_of=n))
  return out.reshape(*lead, d)[..., :size]
