"""Profile-guided scheduling of a compiled step (XLA's PGLE, done by hand for AOT compiles).

XLA's GPU latency-hiding scheduler decides which compute runs beside each asynchronous
collective from a cost model; without measurements it guesses how long a collective and a
kernel take. PGLE (profile-guided latency estimation) gives it the measured times instead:
compile, run a few steps under the profiler, hand the per-instruction times back to the
compiler (`compile({"fdo_profile": ...})`), compile again. JAX does this by itself for
`jax.jit` calls under `jax_enable_pgle`, but not for `.lower().compile()` executables, which
the trainer and the benchmarks use to control donation and options; this module is that loop.

`profile_guided_compile`, for benchmarks, profiles steps on a throwaway state. It compiles
the profiled executable with command buffers (CUDA graphs) off on GPU, as JAX's own PGLE
does: the profiler does not see the kernels inside a graph. The second compile sees the same lowered module, so the
instruction names the profile holds are those it schedules. Off GPU the profiler records no
device kernels and the profile is empty: the plain executable is kept.
"""
from __future__ import annotations

import pathlib
import shutil
import tempfile
from typing import Any, Callable

import jax
from jax.experimental import profiler as jax_profiler

PROFILE_RUNS = 2  # profiled steps, after one warm-up step
# what JAX's PGLE adds to the compile it profiles: no command buffers (CUDA graphs), whose
# kernels the profiler would not see one by one
PROFILING_GPU_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


class Trace:
  """One profiler session: `start()`, then `stop()` -> the serialized per-instruction times
  (XLA's ProfiledInstructionsProto; empty off GPU)."""

  def start(self) -> None:
    options = jax.profiler.ProfileOptions()
    options.enable_hlo_proto = True  # as JAX's own PGLE collects: the modules beside the times
    options.python_tracer_level = 0
    self._dir = tempfile.mkdtemp(prefix="taco_pgle_")
    try:
      jax.profiler.start_trace(self._dir, profiler_options=options)
    except BaseException:
      shutil.rmtree(self._dir, ignore_errors=True)
      raise

  def stop(self) -> bytes:
    try:
      jax.profiler.stop_trace()
      run_dirs = sorted(pathlib.Path(self._dir).glob("plugins/profile/*"))
      return jax_profiler.get_profiled_instructions_proto(str(run_dirs[-1])) if run_dirs else b""
    finally:
      shutil.rmtree(self._dir, ignore_errors=True)


def profiled_instructions(run: Callable[[], Any], runs: int) -> bytes:
  """Calls `run` (which must block until its step is done) `runs` times under the profiler;
  returns the serialized per-instruction times (empty off GPU)."""
  if runs < 1:
    raise ValueError(f"PGLE needs at least one profiled run, got {runs}")
  trace = Trace()
  trace.start()
  try:
    for _ in range(runs):
      run()
  except BaseException:
    trace.stop()
    raise
  return trace.stop()


def profiling_options(options: dict, platform: str) -> dict:
  """The options of the executable to profile: `options`, on GPU without command buffers."""
  return {**options, **PROFILING_GPU_OPTIONS} if platform == "gpu" else dict(options)


def profile_guided_compile(lowered, run: Callable[[Any], Any], *, runs: int = PROFILE_RUNS,
                           options: dict | None = None):
  """(executable, profiled) for `lowered`, scheduled with measured instruction times.

  `run(executable)` steps the program once and blocks (it owns the donated state: it must
  store what the step returns). It is called once to warm up, then `runs` times under the
  profiler. `profiled` is False when the profile came back empty (CPU); the executable is
  then the plain compile. `options`: the per-compile XLA options of both compiles.
  """
  options = dict(options or {})
  profiling = profiling_options(options, jax.devices()[0].platform)
  exe = lowered.compile(profiling or None)
  run(exe)
  profile = profiled_instructions(lambda: run(exe), runs)
  if not profile:
    return (exe if profiling == options else lowered.compile(options or None)), False
  return lowered.compile({**options, "fdo_profile": profile}), True
