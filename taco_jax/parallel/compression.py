"""Config `compression` section -> one CompressionConfig (or None) per collective family.

    compression.enabled       one switch; False gives exactly the uncompressed program
    compression.tp_forward    TP activations: all-gather / reduce-scatter of the residual stream
    compression.tp_backward   their transposes in the backward pass (gradients of activations)
    compression.pp            pipeline ppermute of activations (forward and backward)
    compression.dp            data-parallel gradient all-reduce
    compression.log_errors    also report the relative error of what each family sent as
                              step metrics "compression_error/<family>" (taco_jax.quality);
                              off (absent or False) compiles to exactly the plain program

Each family section is a codec section (format, group_size, hadamard, dual_scale, min_bytes,
optionally enabled/implementation/lam) or None / enabled=False for "off". A config that has
no family sections at all (configs.common) compresses TP forward and backward with the
codec's defaults when enabled, and leaves pp and dp uncompressed.
"""
from __future__ import annotations

import dataclasses

from taco_jax.codec import CompressionConfig

FAMILIES = ("tp_forward", "tp_backward", "pp", "dp")
_CODEC_FIELDS = {f.name for f in dataclasses.fields(CompressionConfig)}


@dataclasses.dataclass(frozen=True)
class CompressionPlan:
  """Which codec each collective family uses; None = that family sends plain values."""
  tp_forward: CompressionConfig | None = None   # forward all-gather / reduce-scatter (TP+SP)
  tp_backward: CompressionConfig | None = None  # their transposes in the backward pass
  pp: CompressionConfig | None = None           # pipeline ppermute, both directions
  dp: CompressionConfig | None = None           # data-parallel gradient all-reduce
  log_errors: bool = False  # step metrics: relative error of what each family sent

  @property
  def any(self) -> bool:
    return any(getattr(self, f) is not None for f in FAMILIES)


def _codec(section, where: str) -> CompressionConfig | None:
  if section is None:
    return None
  d = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  if not d.pop("enabled", True):
    return None
  unknown = sorted(set(d) - _CODEC_FIELDS)
  if unknown:
    raise ValueError(f"compression.{where}: unknown field(s) {unknown}; "
                     f"known: {sorted(_CODEC_FIELDS | {'enabled'})}")
  try:
    return CompressionConfig(**d)
  except (TypeError, ValueError) as e:
    raise ValueError(f"compression.{where}: {e}") from e


def plan_from_config(section) -> CompressionPlan:
  """The plan for a `compression` config section (None or enabled=False: all off)."""
  if section is None or not section.get("enabled", False):
    return CompressionPlan()
  log = section.get("log_errors", False)
  if not isinstance(log, bool):
    raise ValueError(f"compression.log_errors must be True or False, got {log!r}")
  if not any(f in section for f in FAMILIES):
    return CompressionPlan(tp_forward=CompressionConfig(), tp_backward=CompressionConfig(),
                           log_errors=log)
  return CompressionPlan(**{f: _codec(section.get(f, None), f) for f in FAMILIES},
                         log_errors=log)
