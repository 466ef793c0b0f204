"""Config `compression` section -> one CompressionConfig (or None) per collective family.

    compression.enabled       one switch; False gives exactly the uncompressed program
    compression.tp_forward    TP activations: all-gather / reduce-scatter of the residual stream
    compression.tp_backward   their transposes in the backward pass (gradients of activations)
    compression.pp            pipeline ppermute of activations (forward and backward)
    compression.dp            data-parallel gradients: the all-reduce, or with
                              parallel.shard_optimizer the reduce-scatter
    compression.dp_params     parallel.shard_optimizer's parameter all-gather, sent as the
                              differences to the previous step's gathered weights
    compression.sites         per-collective overrides (none: empty): `sites.<site>` (a
                              `site_key` of a `SITES` name, e.g. gather_from_sp_fwd)
                              is a codec section (or enabled=False) that replaces its
                              family's codec for that one collective; `taco_jax.apps.calibrate`
                              writes them where a collective's own best setting differs
    compression.log_errors    also report the relative error of what each family sent as
                              step metrics "compression_error/<family>" (taco_jax.monitor);
                              off (False) compiles to exactly the plain program

Each family section is a codec section (format, group_size, hadamard, dual_scale, min_bytes,
optionally enabled/implementation/lam) or None / enabled=False for "off". Every key is in
`configs.common.base_config`: TP forward and backward with the codec's defaults, pp, dp and
dp_params off, no overrides.
"""
from __future__ import annotations

import dataclasses

from taco_jax.codec import CompressionConfig
from taco_jax.policy import NEVER

FAMILIES = ("tp_forward", "tp_backward", "pp", "dp", "dp_params")

# site -> (family, collective): each region of `taco_jax.mappings` per direction, the
# pipeline shift, the data-parallel gradient all-reduce (or, sharding the optimizer,
# reduce-scatter) and the sharded optimizer's parameter all-gather. "/fwd": the region's input as
# its forward collective sends it; "/bwd": the cotangent of its output as the backward
# (transposed) collective sends it.
_SITES = {
    "gather_from_sp/fwd": ("tp_forward", "all_gather"),            # the sequence shard
    "gather_from_sp/bwd": ("tp_backward", "reduce_scatter"),       # its gradient
    "reduce_scatter_to_sp/fwd": ("tp_forward", "reduce_scatter"),  # partial sums
    "reduce_scatter_to_sp/bwd": ("tp_backward", "all_gather"),     # their gradient
    "reduce_from_tp/fwd": ("tp_forward", "all_reduce"),            # TP without SP
    "copy_to_tp/bwd": ("tp_backward", "all_reduce"),
    "pp/fwd": ("pp", "ppermute"),                                  # pipeline activations
    "pp/bwd": ("pp", "ppermute"),                                  # ... and their gradients
    "dp": ("dp", "all_reduce"),                                    # gradient all-reduce
    "dp/scatter": ("dp", "reduce_scatter"),                        # ... or reduce-scatter
    "dp_params": ("dp_params", "all_gather"),                      # weight differences
}
SITES = {s: fam for s, (fam, _) in _SITES.items()}  # site -> family
COLLECTIVES = {s: coll for s, (_, coll) in _SITES.items()}  # site -> collective
_CODEC_FIELDS = {f.name for f in dataclasses.fields(CompressionConfig)}


def site_key(site: str) -> str:
  """The config key of a `SITES` name: "gather_from_sp/fwd" -> "gather_from_sp_fwd"."""
  return site.replace("/", "_")


_SITE_OF_KEY = {site_key(s): s for s in SITES}


@dataclasses.dataclass(frozen=True)
class CompressionPlan:
  """Which codec each collective family uses (None: plain values), and per-collective
  overrides (`sites`)."""
  tp_forward: CompressionConfig | None = None   # forward all-gather / reduce-scatter (TP+SP)
  tp_backward: CompressionConfig | None = None  # their transposes in the backward pass
  pp: CompressionConfig | None = None           # pipeline ppermute, both directions
  dp: CompressionConfig | None = None           # data-parallel gradient reduction
  dp_params: CompressionConfig | None = None    # sharded optimizer: weight-difference gather
  log_errors: bool = False  # step metrics: relative error of what each family sent
  # (site, codec or None) pairs: one collective's codec instead of its family's
  sites: tuple[tuple[str, CompressionConfig | None], ...] = ()

  def __post_init__(self):
    unknown = sorted(s for s, _ in self.sites if s not in SITES)
    if unknown:
      raise ValueError(f"CompressionPlan.sites: unknown site(s) {unknown}; known: "
                       f"{list(SITES)}")

  def codec(self, site: str) -> CompressionConfig | None:
    """The codec of one collective (`SITES` name): its override, else its family's."""
    for s, cfg in self.sites:
      if s == site:
        return cfg
    return getattr(self, SITES[site])

  def compresses(self, family: str) -> bool:
    """Whether any collective of `family` is compressed."""
    return any(self.codec(s) is not None for s, f in SITES.items() if f == family)

  @property
  def any(self) -> bool:
    return any(self.compresses(f) for f in FAMILIES)


def codec_label(cfg: CompressionConfig | None) -> str:
  """'e4m3 G=64', plus what differs from the defaults that matters to a reader; 'off'."""
  if cfg is None:
    return "off"
  out = [cfg.format, f"G={cfg.group_size}"] + (["Hadamard"] if cfg.hadamard else [])
  if not cfg.dual_scale:
    out.append("no pre-scale")
  if cfg.link != "auto":
    out.append(f"link={cfg.link}")
  if cfg.min_bytes:
    out.append("never" if cfg.min_bytes >= NEVER else f"from {cfg.min_bytes} B")
  return " ".join(out)


def describe_plan(plan: CompressionPlan) -> str:
  """One short line: 'tp_forward, tp_backward, pp: e4m3 G=64; dp: off' (+ overrides)."""
  if not plan.any:
    return "off"
  by_label: dict[str, list[str]] = {}
  for f in FAMILIES:
    by_label.setdefault(codec_label(getattr(plan, f)), []).append(f)
  out = "; ".join(f"{', '.join(fams)}: {label}" for label, fams in by_label.items())
  if plan.sites:
    out += f"; {len(plan.sites)} collective(s) with their own codec (compression.sites)"
  return out + ("; errors logged" if plan.log_errors else "")


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


_SECTION_KEYS = ("enabled", *FAMILIES, "sites", "log_errors")  # of a `compression` section


def plan_from_config(section) -> CompressionPlan:
  """The plan for a `compression` config section with every key of `_SECTION_KEYS`, as
  `configs.common.base_config` has them (None or enabled=False: all off)."""
  if section is None:
    return CompressionPlan()
  missing = [k for k in _SECTION_KEYS if k not in section]
  if missing:
    raise ValueError(f"compression: no {', '.join(missing)}; start from "
                     "configs.common.base_config, which has every key")
  if not section["enabled"]:
    return CompressionPlan()
  log = section["log_errors"]
  if not isinstance(log, bool):
    raise ValueError(f"compression.log_errors must be True or False, got {log!r}")
  return CompressionPlan(**{f: _codec(section[f], f) for f in FAMILIES}, log_errors=log,
                         sites=_site_overrides(section["sites"]))


def _site_overrides(section) -> tuple:
  if not section:
    return ()
  d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
  unknown = sorted(set(d) - set(_SITE_OF_KEY))
  if unknown:
    raise ValueError(f"compression.sites: unknown site(s) {unknown}; known: "
                     f"{sorted(_SITE_OF_KEY)}")
  return tuple((_SITE_OF_KEY[k], _codec(v, f"sites.{k}")) for k, v in sorted(d.items()))
