"""Shared benchmark helpers: device-side timing, ceilings, environment, JSON results, tables.

Timing (``time_fn``): the function is called ``inner`` times inside ONE jitted
``lax.fori_loop`` (one dispatch per sample, so host and launch overheads are amortized and
the device runs back to back); a sample is the host wall-clock of that call, around
``jax.block_until_ready``, divided by ``inner``. ``inner`` is chosen so that one sample
lasts >= ``min_sample_s`` (default 5 ms). The loop carries its inputs through an
``optimization_barrier`` tied to the previous output, so XLA can neither hoist the call
out of the loop nor skip it. Reported: the median (and min/max) over ``samples`` samples
after warm-up (compilation excluded).
"""
from __future__ import annotations

import dataclasses
import datetime
import gzip
import json
import os
import platform
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float
  min_s: float
  max_s: float
  samples: int
  inner: int  # calls per sample (one jitted loop)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _looped(fn: Callable, inner: int, compiler_options: dict | None = None) -> Callable:
  def run(*args):
    out0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))

    def body(_, carry):
      args, out = jax.lax.optimization_barrier(carry)
      return args, fn(*args)

    return jax.lax.fori_loop(0, inner, body, (args, out0))[1]

  # XLA's while-loop double buffering (one of gspmd.XLA_OVERLAP_FLAGS) unrolls the loop in
  # two; once the barriers are lowered away, the copies of `fn` on the same carried inputs
  # are merged, and a sample counts half its calls (measured: a bf16 matmul at 2x the
  # H200's peak). The timing loop is compiled without it, whatever XLA_FLAGS say.
  return jax.jit(run, compiler_options={
      **(compiler_options or {}), "xla_gpu_enable_while_loop_double_buffering": False})


def peak_tflops(device_kind: str) -> float | None:
  """Dense bf16 tensor-core peak (TFLOP/s, no sparsity) of `device_kind`, the MFU
  denominator (the trainer's table, `taco_jax.train.metrics.PEAK_BF16_FLOPS`); None if
  unlisted."""
  from taco_jax.train.metrics import peak_flops
  peak = peak_flops(device_kind)
  return None if peak is None else peak / 1e12


def mfu(tokens_per_s: float, flops_per_token: float, devices: int, device_kind: str):
  """Model FLOP/s utilization against the device's spec peak; None for an unlisted device."""
  peak = peak_tflops(device_kind)
  return None if peak is None else tokens_per_s * flops_per_token / (devices * peak * 1e12)


def time_fn(fn: Callable, *args, samples: int = 20, warmup: int = 2,
            min_sample_s: float = 5e-3, max_inner: int = 1000,
            compiler_options: dict | None = None) -> Timing:
  """Device time of one ``fn(*args)`` call (see the module docstring for the method);
  ``compiler_options``: XLA options to compile it with (``jax.jit``'s)."""
  inner = 1
  while True:
    loop = _looped(fn, inner, compiler_options)
    jax.block_until_ready(loop(*args))  # compile + warm
    t0 = time.perf_counter()
    jax.block_until_ready(loop(*args))
    dt = time.perf_counter() - t0
    if dt >= min_sample_s or inner >= max_inner:
      break
    inner = min(max_inner, max(2 * inner, int(inner * 1.5 * min_sample_s / max(dt, 1e-6))))
  for _ in range(warmup):
    jax.block_until_ready(loop(*args))
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(*args))
    times.append((time.perf_counter() - t0) / inner)
  return Timing(statistics.median(times), min(times), max(times), samples, inner)


def copy_bandwidth(nbytes: int, **timing_kw) -> dict:
  """Device copy ceiling: a jitted elementwise ``x + 1`` on a bf16 buffer of ``nbytes``
  (reads and writes ``nbytes`` each; ``x + 0`` would be simplified away)."""
  x = jnp.ones((max(nbytes // 2 // 1024, 1), 1024), jnp.bfloat16)
  t = time_fn(lambda v: v + jnp.bfloat16(1), x, **timing_kw)
  moved = 2 * x.size * 2
  return dict(bytes=moved, time=t.as_dict(), gbps=moved / t.median_s / 1e9)


def matmul_rate(n: int, **timing_kw) -> dict:
  """bf16 ``n x n @ n x n`` (fp32 accumulation) rate in TFLOP/s."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  t = time_fn(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32).astype(u.dtype),
              a, b, **timing_kw)
  return dict(n=n, time=t.as_dict(), tflops=2 * n**3 / t.median_s / 1e12)


def compiled_memory(exe) -> dict:
  """Per device, a compiled program's peak memory and its temporaries (activations and
  workspace), from XLA's buffer assignment; None where the backend does not say."""
  try:
    m = exe.memory_analysis()
  except Exception:  # noqa: BLE001 (not every backend implements it)
    m = None
  return dict(memory_peak_bytes=getattr(m, "peak_memory_in_bytes", None),
              memory_temp_bytes=getattr(m, "temp_size_in_bytes", None))


def environment() -> dict:
  dev = jax.devices()[0]
  return dict(
      device_kind=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
      jax_version=jax.__version__, jaxlib_version=getattr(jax.lib, "__version__", None)
      or _jaxlib_version(), python=platform.python_version(), host=platform.node(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      xla_flags=os.environ.get("XLA_FLAGS", ""))


RUN_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "XLA_FLAGS",
           "JAX_COMPILATION_CACHE_DIR")


def run_env() -> dict:
  """The environment variables that change what a multi-GPU run measures (the links NCCL
  may use, XLA's flags) or its compile times (a persistent compilation cache)."""
  return {k: os.environ.get(k) for k in RUN_ENV}


def _jaxlib_version():
  try:
    import jaxlib
    return jaxlib.__version__
  except Exception:  # pragma: no cover
    return None


def device_slug() -> str:
  dev = jax.devices()[0]
  return re.sub(r"[^a-z0-9]+", "-", f"{dev.device_kind}".lower()).strip("-") or dev.platform


def write_hlo(exe, path) -> None:
  """Writes a compiled executable's (scheduled, optimized) HLO text, gzipped, to `path`."""
  with open(path, "wb") as f:
    f.write(gzip.compress(exe.as_text().encode()))


def write_results(name: str, payload: dict, out_dir: str | None = None) -> str:
  """Writes ``{env, **payload}`` to ``<out_dir>/<name>_<device>_<date>.json``; returns path."""
  out_dir = out_dir or os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(out_dir, exist_ok=True)
  date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = os.path.join(out_dir, f"{name}_{device_slug()}_{date}.json")
  with open(path, "w") as f:
    json.dump(dict(environment=environment(), **payload), f, indent=1, default=_jsonable)
  return path


def _jsonable(v: Any):
  if isinstance(v, (np.floating, np.integer)):
    return v.item()
  if isinstance(v, np.ndarray):
    return v.tolist()
  if dataclasses.is_dataclass(v):
    return dataclasses.asdict(v)
  return str(v)


def table(rows: list[dict], columns: list[str], floatfmt: str = "{:.3g}") -> str:
  """A plain-text table of ``rows`` (dicts) with the given columns."""
  cells = [[c for c in columns]]
  for r in rows:
    cells.append([floatfmt.format(r[c]) if isinstance(r.get(c), float) else str(r.get(c, ""))
                  for c in columns])
  widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
  lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)
