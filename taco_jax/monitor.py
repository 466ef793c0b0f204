"""Watching what the compressed collectives send: error metrics and tensor capture.

Two monitors, active only while a step is being traced (`watching(monitor)`); with none
active every hook below returns its input untouched, so the normal program is unchanged:

* `ErrorLog` (config `compression.log_errors`): each compressed message x also goes
  through encode -> u8 wire -> decode on its sender (one extra decode; the encode is the
  same one XLA may share with the collective), and the relative L2 error
  ||x_hat - x|| / ||x|| of x, for every site, comes out of the step as a metric.
* `Capture` (`python -m taco_jax.apps.calibrate`): the messages themselves are copied to the host
  (`jax.debug.callback`) per site, for measuring codec settings on real tensors.

How values leave a backward pass without threading them through the model: the sites'
errors flow out as the *gradient* of a zero "probe" argument. A forward message x is
wrapped in an identity whose custom VJP adds x's error to the probe's cotangent; a
backward message (the cotangent of a region's output) in one whose VJP adds the
cotangent's error. Scans over layers and ticks, remat and custom_vjp regions sum those
cotangents like any other, so d(loss)/d(probe)[site] = (sum of relative errors, number of
non-zero messages) of that site on this device. Capture taps the forward message in the
backward pass too (as a residual), so remat's recomputation does not record it twice.

Sites (`taco_jax.plan.SITES`): each region of `taco_jax.mappings`, per direction, plus the
pipeline shift and the data-parallel gradient all-reduce; each belongs to one compression
family. The callers that know a site (the TP layers, the pipeline, the step's DP
all-reduce) call the hooks with the codec each message is sent with, the decision they
also pass to the collective (`collectives.decide`, once per message); the regions
themselves are pure.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import collectives
from taco_jax.codec import CompressionConfig
from taco_jax.plan import SITES

_ROW = {s: i for i, s in enumerate(SITES)}


def relative_error(x, cfg: CompressionConfig):
  """[||x_hat - x|| / ||x|| (0 for x == 0), 1 if x != 0 else 0] in fp32, for x as sent."""
  xf = x.astype(jnp.float32)
  e2 = jnp.sum(jnp.square(collectives.roundtrip(x, cfg) - xf))
  x2 = jnp.sum(jnp.square(xf))
  nonzero = x2 > 0
  return jnp.stack([jnp.where(nonzero, jnp.sqrt(e2 / jnp.where(nonzero, x2, 1.0)), 0.0),
                    nonzero.astype(jnp.float32)])


def _at_row(site: str, stats):
  return jnp.zeros((len(SITES), 2), jnp.float32).at[_ROW[site]].set(stats)


# --- monitors ------------------------------------------------------------------------------


class ErrorLog:
  """Per-site error sums of one traced step (see the module docstring)."""

  def __init__(self):
    self.probe = None  # the zero [len(SITES), 2] argument being differentiated
    self.direct = []   # stats recorded outside the gradient (the DP all-reduce)

  def stats(self, probe_ct):
    """[len(SITES), 2]: (sum of relative errors, messages) per site, this device."""
    return functools.reduce(jnp.add, self.direct, probe_ct)


class Capture:
  """Host-side store of the messages sent at each site (thread-safe: one callback per
  device). Keeps at most `rows_per_call` evenly spaced rows (groups run along the last
  axis, so rows are independent) of each message, and skips all-zero messages."""

  def __init__(self, rows_per_call: int = 1024):
    self.rows_per_call = rows_per_call
    self.tensors: dict[str, list[np.ndarray]] = {}
    self.shapes: dict[str, set] = {}  # the full per-device shapes seen at each site
    self._lock = threading.Lock()

  def add(self, site: str, x) -> None:
    x = np.asarray(x)
    if not np.any(x):
      return
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > self.rows_per_call:
      rows = rows[np.linspace(0, rows.shape[0] - 1, self.rows_per_call).astype(int)]
    with self._lock:
      self.tensors.setdefault(site, []).append(rows.copy())
      self.shapes.setdefault(site, set()).add(x.shape)

  def rows(self, site: str) -> np.ndarray:
    """Every captured row of `site`, stacked: [rows, last dim]."""
    return np.concatenate(self.tensors[site])


_ACTIVE: list = []  # the monitor of the step being traced (a stack, innermost last)


@contextlib.contextmanager
def watching(monitor):
  """Within: the hooks below report to `monitor` (None: nothing changes)."""
  _ACTIVE.append(monitor)
  try:
    yield monitor
  finally:
    _ACTIVE.pop()


def _monitor():
  return _ACTIVE[-1] if _ACTIVE else None


def value_and_grad(f, params, monitor):
  """`jax.value_and_grad(f)(params)` with `monitor` watching; for an `ErrorLog`, the
  per-site stats of the step's sites that sit under the gradient (see `ErrorLog.stats`)
  come back as a third value (None otherwise)."""
  if not isinstance(monitor, ErrorLog):
    with watching(monitor):
      return (*jax.value_and_grad(f)(params), None)

  def g(p, probe):
    monitor.probe = probe
    with watching(monitor):
      return f(p)

  probe = jnp.zeros((len(SITES), 2), jnp.float32)
  loss, (grads, probe_ct) = jax.value_and_grad(g, argnums=(0, 1))(params, probe)
  monitor.probe = None
  return loss, grads, probe_ct


# --- hooks at the sites --------------------------------------------------------------------


def region(f, x, *, fwd: CompressionConfig | None, bwd: CompressionConfig | None,
           fwd_site: str, bwd_site: str):
  """`f(x)` for a region that sends x forward with codec `fwd` and its output's cotangent
  backward with codec `bwd`, as the caller decided them (`collectives.decide`; None: sent
  plain, not watched); the active monitor sees the compressed ones. No monitor: f(x)."""
  m = _monitor()
  if m is None:
    return f(x)
  if fwd is not None:
    x = (_log_value(x, m.probe, fwd_site, fwd) if isinstance(m, ErrorLog)
         else _capture(x, m, fwd_site, False))
  y = f(x)
  if bwd is not None:
    y = (_log_cotangent(y, m.probe, bwd_site, bwd) if isinstance(m, ErrorLog)
         else _capture(y, m, bwd_site, True))
  return y


def sent(x, codec: CompressionConfig | None, site: str) -> None:
  """Reports x, sent with `codec` (as decided: `collectives.decide`; None: plain, not
  reported) by a forward-only collective at the trace level of the `watching` block itself
  (not under a gradient, scan or remat inside it)."""
  m = _monitor()
  if m is None or codec is None:
    return
  if isinstance(m, ErrorLog):
    m.direct.append(_at_row(site, relative_error(x, codec)))
  else:
    jax.debug.callback(functools.partial(m.add, site), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _log_value(x, probe, site, cfg):
  return x


def _log_value_fwd(x, probe, site, cfg):
  return x, relative_error(x, cfg)


def _log_value_bwd(site, cfg, stats, ct):
  return ct, _at_row(site, stats)


_log_value.defvjp(_log_value_fwd, _log_value_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _log_cotangent(y, probe, site, cfg):
  return y


def _log_cotangent_fwd(y, probe, site, cfg):
  return y, None


def _log_cotangent_bwd(site, cfg, _, ct):
  return ct, _at_row(site, relative_error(ct, cfg))


_log_cotangent.defvjp(_log_cotangent_fwd, _log_cotangent_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _capture(x, capture, site, cotangent: bool):
  """Identity; its backward pass records x (cotangent=False: the forward message, once,
  even under remat) or the incoming cotangent (True: the backward message)."""
  return x


def _capture_fwd(x, capture, site, cotangent):
  return x, None if cotangent else x


def _capture_bwd(capture, site, cotangent, saved, ct):
  jax.debug.callback(functools.partial(capture.add, site), ct if cotangent else saved)
  return (ct,)


_capture.defvjp(_capture_fwd, _capture_bwd)


# --- metrics ---------------------------------------------------------------------------------


def family_metrics(stats, families) -> dict:
  """{"compression_error/<family>": mean relative error over the family's non-zero
  messages} from summed per-site stats [len(SITES), 2], for each of `families`."""
  out = {}
  for fam in families:
    rows = [_ROW[s] for s, f in SITES.items() if f == fam]
    total, count = jnp.sum(stats[jnp.array(rows)], axis=0)
    out[f"compression_error/{fam}"] = total / jnp.maximum(count, 1.0)
  return out
