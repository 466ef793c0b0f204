"""The trainer's link policy: which messages of ``link="auto"`` codecs are sent compressed,
from times measured at start-up on this mesh (`taco_jax.link_probe`), cached in
<workdir>/link_policy.json, or from the measured tables (`taco_jax._measured`) where the
probe does not run.

`resolve` probes when `compression.link_probe` is on, the step has such messages over more
than one device and the backend is a GPU (on fake CPU devices the times mean nothing). It
never fails the run: a probe that raises leaves the tables, and says why. The cache is
reused while its key (device kind and count, mesh, NCCL link settings, the messages)
matches. In a multi-process run process 0 decides: it reads the cache, and its times are
the ones every process uses, so that all build the same step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import jax
import numpy as np

from taco_jax import link_probe
from taco_jax.plan import FAMILIES, CompressionPlan
from taco_jax.tp.mesh import FAMILY_AXES

FILE = "link_policy.json"
ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")  # settings that change the link NCCL takes


@dataclasses.dataclass(frozen=True)
class Resolved:
  """What `resolve` decided: summary.json's ``link_policy``, the plan to build the step
  from, and the lines to print."""
  summary: dict
  plan: CompressionPlan
  lines: list
  probe_s: float = 0.0  # seconds spent probing (0: cached or not probed)


def skip_reason(config, msgs, backend: str | None = None) -> str | None:
  """Why not to probe (None: probe)."""
  backend = backend or jax.default_backend()
  if not config.compression.enabled:
    return "compression.enabled=False"
  if not msgs:
    return "no message of a link='auto' codec crosses more than one device"
  if not config.compression.get("link_probe", True):
    return "compression.link_probe=False"
  if backend != "gpu":
    return f"not on GPU ({backend}): times of its collectives would not predict a GPU's"
  return None


def cache_key(mesh, msgs) -> dict:
  """What the cached times hold for: this machine, mesh, link settings and messages."""
  key = dict(device_kind=jax.devices()[0].device_kind, devices=jax.device_count(),
             mesh=dict(mesh.shape), env={k: os.environ.get(k) for k in ENV},
             messages=[m.to_json() for m in msgs])
  return json.loads(json.dumps(key))  # as read back


def load(path: pathlib.Path, key: dict, notes: list):
  """The cached times [[plain_s, compressed_s] per message] for `key`, or None (absent,
  another key, or unreadable: that said in `notes`)."""
  if not path.exists():
    return None
  try:
    stored = json.loads(path.read_text())
    times = np.asarray(stored["times"], np.float64)
    if stored["key"] != key:
      notes.append(f"{path} holds times of another machine, mesh or step: probing again")
      return None
    if times.shape != (len(key["messages"]), 2):
      raise ValueError(f"times of shape {times.shape}")
    return times
  except (ValueError, KeyError, TypeError) as e:
    notes.append(f"ignoring {path}, not a link policy file ({type(e).__name__}: {e})")
    return None


def save(path: pathlib.Path, key: dict, times: np.ndarray, pol) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(dict(key=key, times=times.tolist(), policy=pol.families),
                            indent=1))
  tmp.replace(path)


def _from_lead(a: np.ndarray) -> np.ndarray:
  """Process 0's `a` on every process (itself in a one-process run)."""
  if jax.process_count() == 1:
    return a
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.broadcast_one_to_all(a))


def resolve(config, spec, mesh, decisions, workdir) -> Resolved:
  """The link policy of a step traced with `spec.plan` (its `recording_decisions`).
  The TP families are probed only with ``parallel.tp_overlap="none"`` (the ring and the
  kernels send otherwise than the collectives the probe times)."""
  families = FAMILIES if spec.tp_overlap == "none" else ("pp", "dp", "dp_params")
  msgs = link_probe.messages(decisions, FAMILY_AXES, families)
  sends = [f for f in FAMILIES if spec.plan.compresses(f) and mesh.shape[FAMILY_AXES[f]] > 1]
  why = skip_reason(config, msgs)
  if why and not msgs and spec.tp_overlap != "none":
    why += f" (parallel.tp_overlap={spec.tp_overlap!r}: the TP families are not probed)"
  if why:
    return _tables(why, spec.plan, [] if msgs or sends else None)
  path, key, notes = pathlib.Path(workdir) / FILE, cache_key(mesh, msgs), []
  lead = jax.process_index() == 0
  cached = load(path, key, notes) if lead else None
  hit = bool(_from_lead(np.asarray(cached is not None)))
  t0 = time.perf_counter()
  try:
    if hit:
      times = cached if cached is not None else np.zeros((len(msgs), 2))
    else:
      timed = link_probe.probe(mesh, msgs)
      times = np.asarray([[t.plain_s, t.compressed_s] for t in timed], np.float64)
    times = _from_lead(times)
  except Exception as e:  # noqa: BLE001: the run goes on with the tables
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return _tables(f"the probe failed ({type(e).__name__}: {first})", spec.plan, notes)
  probe_s = 0.0 if hit else time.perf_counter() - t0
  pol = link_probe.choose([link_probe.Timing(m, *t) for m, t in zip(msgs, times)])
  where = f"cached in {path}" if hit else f"probed in {probe_s:.1f}s"
  if lead and not hit:
    try:
      save(path, key, times, pol)
      where += f", saved to {path}"
    except OSError as e:
      notes.append(f"could not cache the link policy in {path}: {e}")
  unprobed = [f for f in sends if f not in pol.families]
  lines = notes + [f"link policy measured on this mesh ({where}):"] + [
      f"  {line}" for line in pol.lines()] + (
      [f"  {', '.join(unprobed)}: measured tables (not probed)"] if unprobed else [])
  summary = dict(source="cache" if hit else "probe", families=pol.families,
                 tables_for=unprobed, probe_s=probe_s)
  return Resolved(summary, link_probe.apply(spec.plan, pol), lines, probe_s)


def _tables(why: str, plan, notes: list | None) -> Resolved:
  """The tables decide (`policy.pays_for`), for `why`; said after `notes` (None: not said,
  nothing is sent compressed)."""
  said = [f"link policy: compression.*.link decides (the measured tables), not probed: {why}"]
  return Resolved(dict(source="tables", why=why), plan, [] if notes is None else notes + said)
