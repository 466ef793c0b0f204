"""Whether compression pays on this machine, measured: `probe` times each message a step
sends, plain and compressed, on the real mesh; `choose` turns the times into a
`LinkPolicy` (per family and collective, the size from which compression is sent);
`apply` writes it into a `CompressionPlan`.

``link="auto"`` codecs otherwise take the sizes measured on the benchmark machines
(`taco_jax._measured`, through `taco_jax.policy`); the probe measures the link, the
collective's implementation and the message sizes of this run. The trainer runs it at
start-up and caches it (`taco_jax.train.link_policy`).

Every decision still goes through `collectives.decide` -> `policy.pays_for`: `apply` gives
each probed site a codec with ``link=None`` and ``min_bytes`` the probed threshold
(`policy.NEVER` where compression never won). The site keeps a codec, so what the step
stores (the sharded optimizer's master weights) does not depend on the probe.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import collectives, policy
from taco_jax.codec import CompressionConfig
from taco_jax.plan import COLLECTIVES, FAMILIES, SITES, CompressionPlan


@dataclasses.dataclass(frozen=True)
class Message:
  """One message a step sends with a ``link="auto"`` codec: what `probe` times."""
  family: str              # `taco_jax.plan.FAMILIES`
  collective: str          # all_gather | reduce_scatter | all_reduce | ppermute
  axis: str                # the mesh axis it crosses
  axis_size: int
  shape: tuple             # the local input (per device)
  dtype: str
  codec: CompressionConfig
  count: int = 1           # call sites in the traced step that send it

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

  def key(self) -> tuple:
    """What is timed: messages of two families with the same key are timed once."""
    return self.collective, self.axis, self.shape, self.dtype, self.codec

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds per call of one message's collective, plain and compressed (medians)."""
  message: Message
  plain_s: float
  compressed_s: float


def messages(decisions, axes: dict, families=FAMILIES) -> list[Message]:
  """The messages to probe among `collectives.recording_decisions`' records: those a site
  of `families` asked a ``link="auto"`` codec for over more than one device, outside the
  fused kernels, each once with the number of its call sites. ``axes``: family -> the
  mesh axis its collectives cross."""
  count: dict[Message, int] = {}
  for d in decisions:
    family = SITES.get(d.site)
    if (family in families and d.codec is not None and d.codec.link == "auto"
        and (d.axis_size or 0) > 1 and not d.kernel):
      m = Message(family, d.collective, axes[family], d.axis_size, d.shape, d.dtype, d.codec)
      count[m] = count.get(m, 0) + 1
  return [dataclasses.replace(m, count=n) for m, n in count.items()]


def probe(mesh, msgs: list[Message], reps: int = 5) -> list[Timing]:
  """Times every distinct message of `msgs` (`Message.key`) on `mesh`, plain and compressed:
  each a jitted shard_map over the whole mesh whose collective crosses the message's axis
  (the other axes' groups send at the same time, as in the step); the median of `reps`
  calls after a warm-up, plain and compressed alternating. Runs on any backend (on fake
  CPU devices the times mean nothing: the trainer probes only on GPU)."""
  times: dict[tuple, tuple[float, float]] = {}
  for m in msgs:
    if m.key() not in times:
      times[m.key()] = _time(mesh, m, reps)
  return [Timing(m, *times[m.key()]) for m in msgs]


def _send(m: Message, codec: CompressionConfig | None):
  """x -> m's collective of x over m's axis, sent with `codec` (None: plain) as it is. As
  the step does: gathered or scattered along the sequence (dim 1) of a [B, T, D] activation
  (the TP regions), else along the leading dimension (the data-parallel buckets)."""
  how = collectives.Decided(codec)
  d = 1 if len(m.shape) == 3 else 0
  if m.collective == "all_gather":
    return lambda x: collectives.all_gather(x, m.axis, axis=d, compression=how)
  if m.collective == "reduce_scatter":
    return lambda x: collectives.reduce_scatter(x, m.axis, scatter_dimension=d,
                                                compression=how)
  if m.collective == "all_reduce":
    return lambda x: collectives.all_reduce(x, m.axis, compression=how)
  if m.collective == "ppermute":  # the pipeline's shift to the next stage
    perm = [(i, i + 1) for i in range(m.axis_size - 1)]
    return lambda x: collectives.ppermute(x, m.axis, perm, compression=how)
  raise ValueError(f"link_probe: unknown collective {m.collective!r}")


def _time(mesh, m: Message, reps: int) -> tuple[float, float]:
  spec = P(tuple(mesh.axis_names))  # every device holds one message
  shape = (mesh.size * m.shape[0], *m.shape[1:])
  x = jax.jit(lambda k: jax.random.normal(k, shape, jnp.dtype(m.dtype)),
              out_shardings=NamedSharding(mesh, spec))(jax.random.key(0))
  fns = [jax.jit(jax.shard_map(_send(m, c), mesh=mesh, in_specs=spec, out_specs=spec))
         for c in (None, m.codec)]
  for f in fns:  # compile, then one warm call
    f(x).block_until_ready()
    f(x).block_until_ready()
  out: tuple[list, list] = ([], [])
  for _ in range(reps):
    for f, ts in zip(fns, out):
      t0 = time.perf_counter()
      f(x).block_until_ready()
      ts.append(time.perf_counter() - t0)
  return statistics.median(out[0]), statistics.median(out[1])


@dataclasses.dataclass(frozen=True)
class LinkPolicy:
  """What `choose` decided, per probed family: the summed times of its messages (each
  times its call sites) sent plain, compressed and as chosen; per collective the smallest
  size (bytes per device) from which it is sent compressed (None: never); the decision in
  words. Plain data, as written to summary.json."""
  families: dict  # family -> {plain_ms, compressed_ms, chosen_ms, min_bytes, decision}

  def threshold(self, family: str, collective: str):
    """(probed, min bytes or None) of one family's collective."""
    row = self.families.get(family, {}).get("min_bytes", {})
    return collective in row, row.get(collective)

  def lines(self) -> list[str]:
    """'tp_forward: plain 1.200 ms, compressed 0.700 ms -> compress', one per family."""
    return [f"{f}: plain {r['plain_ms']:.3f} ms, compressed {r['compressed_ms']:.3f} ms -> "
            f"{r['decision']}" for f, r in self.families.items()]


def _threshold(ts: list[Timing]) -> int | None:
  """The smallest probed size from which compressed was faster at every larger probed size
  (the sense of `_measured.MIN_BYTES`), messages of one size summed; None if the largest
  lost."""
  by_size: dict[int, list[float]] = {}
  for t in ts:
    row = by_size.setdefault(t.message.nbytes, [0.0, 0.0])
    row[0] += t.message.count * t.plain_s
    row[1] += t.message.count * t.compressed_s
  out = None
  for size in sorted(by_size, reverse=True):
    plain, compressed = by_size[size]
    if not compressed < plain:
      break
    out = size
  return out


def _size(n: int) -> str:
  for unit, k in (("MiB", 20), ("KiB", 10)):
    if n >= 1 << k:
      return f"{n / (1 << k):.3g} {unit}"
  return f"{n} B"


def choose(timings: list[Timing]) -> LinkPolicy:
  """Per family and collective, the size from which the compressed collective was faster at
  every larger probed size (`_threshold`): its messages from there on are compressed, the
  smaller ones (all of them where the largest lost) go plain. A pure function of the times;
  families without timings are not in the policy (they keep the tables)."""
  families = {}
  for family in FAMILIES:
    ts = [t for t in timings if t.message.family == family]
    if not ts:
      continue
    colls = sorted({t.message.collective for t in ts})
    mins = {c: _threshold([t for t in ts if t.message.collective == c]) for c in colls}
    sent = lambda t: (mins[t.message.collective] is not None
                      and t.message.nbytes >= mins[t.message.collective])
    words = {}
    for c in colls:
      smallest = min(t.message.nbytes for t in ts if t.message.collective == c)
      words[c] = ("plain" if mins[c] is None else "compress" if mins[c] <= smallest
                  else f"compress from {_size(mins[c])}")
    ms = lambda f: 1e3 * sum(t.message.count * f(t) for t in ts)
    families[family] = dict(
        plain_ms=ms(lambda t: t.plain_s), compressed_ms=ms(lambda t: t.compressed_s),
        chosen_ms=ms(lambda t: t.compressed_s if sent(t) else t.plain_s), min_bytes=mins,
        decision=(next(iter(words.values())) if len(set(words.values())) == 1
                  else ", ".join(f"{c} {w}" for c, w in words.items())))
  return LinkPolicy(families)


def apply(plan: CompressionPlan, pol: LinkPolicy) -> CompressionPlan:
  """`plan` with each probed site (a ``link="auto"`` codec whose family and collective
  `pol` has) sending what `pol` chose: its codec with ``link=None`` and ``min_bytes`` the
  probed threshold (at least the configured one; `policy.NEVER` for never), as a per-site
  override. Other sites keep their codecs."""
  sites = dict(plan.sites)
  for site, family in SITES.items():
    codec = plan.codec(site)
    probed, t = pol.threshold(family, COLLECTIVES[site])
    if codec is not None and codec.link == "auto" and probed:
      sites[site] = dataclasses.replace(
          codec, link=None, min_bytes=policy.NEVER if t is None else max(codec.min_bytes, t))
  return dataclasses.replace(plan, sites=tuple(sorted(sites.items())))


def changes(decisions, plan: CompressionPlan) -> bool:
  """Whether a step traced with `plan` would send any of the recorded messages (sites of
  `collectives.recording_decisions`) otherwise than recorded."""
  return any(policy.pays_for(c, d.collective, d.nbytes, d.axis_size, kernel=d.kernel,
                            work=d.work)
             != d.compressed for d in decisions
             if d.site in SITES and (c := plan.codec(d.site)) is not None)
