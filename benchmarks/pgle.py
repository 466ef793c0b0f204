"""Profile-guided scheduling of a compiled step (XLA's PGLE, done by hand for AOT compiles).

XLA's GPU latency-hiding scheduler decides which compute runs beside each asynchronous
collective from a cost model; without measurements it guesses how long a collective and a
kernel take. PGLE (profile-guided latency estimation) gives it the measured times instead:
compile, run a few steps under the profiler, hand the per-instruction times back to the
compiler (`compile({"fdo_profile": ...})`), compile again. JAX does this by itself for
`jax.jit` calls under `jax_enable_pgle`, but not for `.lower().compile()` executables, which
our benchmarks use to control donation and options; this module is that loop (measured
without effect on our step: docs/parallel.md).

The second compile sees the same lowered module, so the instruction names the profile holds
are those it schedules. Off GPU the profiler records no device kernels and the profile is
empty: `profile_guided_compile` then returns the first executable unchanged.
"""
from __future__ import annotations

import pathlib
import tempfile
from typing import Any, Callable

import jax
from jax.experimental import profiler as jax_profiler


def profiled_instructions(run: Callable[[], Any], runs: int) -> bytes:
  """Calls `run` (which must block until its step is done) `runs` times under the profiler;
  returns the serialized per-instruction times (empty off GPU)."""
  if runs < 1:
    raise ValueError(f"PGLE needs at least one profiled run, got {runs}")
  options = jax.profiler.ProfileOptions()
  options.enable_hlo_proto = True  # as JAX's own PGLE collects: the modules beside the times
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory(prefix="taco_pgle_") as log_dir:
    jax.profiler.start_trace(log_dir, profiler_options=options)
    try:
      for _ in range(runs):
        run()
    finally:
      jax.profiler.stop_trace()
    run_dirs = sorted(pathlib.Path(log_dir).glob("plugins/profile/*"))
    if not run_dirs:
      return b""
    return jax_profiler.get_profiled_instructions_proto(str(run_dirs[-1]))


def profile_guided_compile(lowered, run: Callable[[Any], Any], *, runs: int = 2,
                           options: dict | None = None):
  """(executable, profiled) for `lowered`, scheduled with measured instruction times.

  `run(executable)` steps the program once and blocks (it owns the donated state: it must
  store what the step returns). It is called once to warm up, then `runs` times under the
  profiler. `profiled` is False when the profile came back empty (CPU); the executable is
  then the plain compile. `options`: the per-compile XLA options of both compiles.
  """
  options = dict(options or {})
  exe = lowered.compile(options or None)
  run(exe)
  profile = profiled_instructions(lambda: run(exe), runs)
  if not profile:
    return exe, False
  return lowered.compile({**options, "fdo_profile": profile}), True
