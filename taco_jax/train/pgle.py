"""Profile-guided scheduling of a compiled step (XLA's PGLE, done by hand for AOT compiles).

XLA's GPU latency-hiding scheduler decides which compute runs beside each asynchronous
collective from a cost model; without measurements it guesses how long a collective and a
kernel take. PGLE (profile-guided latency estimation) gives it the measured times instead:
compile, run a few steps under the profiler, hand the per-instruction times back to the
compiler (`compile({"fdo_profile": ...})`), compile again. JAX does this by itself for
`jax.jit` calls under `jax_enable_pgle`, but not for `.lower().compile()` executables, which
the trainer and the benchmarks use to control donation and options; this module is that loop.

Two ways in: `ProfileGuidedStep`, the trainer's step (`parallel.pgle`), profiles the run's
own first steps and caches the profile in the workdir; `profile_guided_compile`, for
benchmarks, profiles steps on a throwaway state. Both compile the profiled executable with
command buffers (CUDA graphs) off on GPU, as JAX's own PGLE does: the profiler does not see
the kernels inside a graph. The second compile sees the same lowered module, so the
instruction names the profile holds are those it schedules. Off GPU the profiler records no
device kernels and the profile is empty: the plain executable is kept.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import tempfile
import time
from typing import Any, Callable

import jax
import jaxlib
import numpy as np
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


def cache_key(lowered, options: dict, mesh) -> dict:
  """What a profile was measured for: the program (a hash of the lowered module), its
  compile options, the devices and the JAX that compiled it."""
  device = mesh.devices.flat[0]
  return json.loads(json.dumps(dict(
      module_sha256=hashlib.sha256(lowered.as_text().encode()).hexdigest(),
      options={k: options[k] for k in sorted(options)},
      mesh={str(k): int(v) for k, v in mesh.shape.items()}, processes=jax.process_count(),
      platform=device.platform, device_kind=device.device_kind, jax=jax.__version__,
      jaxlib=jaxlib.__version__)))


class ProfileCache:
  """A profile and its `cache_key` in a directory (the trainer's: <workdir>/pgle)."""

  def __init__(self, directory):
    self.directory = pathlib.Path(directory)
    self.profile, self.key = self.directory / "profile.pb", self.directory / "key.json"

  def load(self, key: dict) -> tuple[bytes, str]:
    """(the profile stored under `key`, '') or (b'', why there is none)."""
    if not (self.key.is_file() and self.profile.is_file()):
      return b"", ""
    stored = json.loads(self.key.read_text())
    differ = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
    if differ:
      return b"", f"it was measured for another {', '.join(differ)}"
    return self.profile.read_bytes(), ""

  def store(self, key: dict, profile: bytes) -> None:
    self.directory.mkdir(parents=True, exist_ok=True)
    self.key.unlink(missing_ok=True)  # the key last: a half-written pair does not load
    self.profile.write_bytes(profile)
    self.key.write_text(json.dumps(key, indent=1))


def share_from_process_0(profile: bytes) -> bytes:
  """Process 0's `profile` on every process: all must compile the same schedule (collectives
  ordered differently on two processes can deadlock). As it is in a one-process run."""
  if jax.process_count() == 1:
    return profile
  from jax.experimental import multihost_utils
  n = int(multihost_utils.broadcast_one_to_all(np.int32(len(profile))))
  if n == 0:
    return b""
  mine = np.frombuffer(profile, np.uint8) if jax.process_index() == 0 else np.zeros(n, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(mine)).tobytes()


class ProfileGuidedStep:
  """The train step as a callable that compiles itself again from a profile of its first steps.

  Steps 1 .. `warmup` run the plain executable, the next `runs` run it under the profiler:
  they are the run's own steps, with its batches and its state, so nothing is spent on
  throwaway steps and the losses are those of a run without PGLE. After the last profiled
  step `lowered` is compiled again with the measured instruction times, and every later
  step runs that. A profile cached under the same `key` (a resumed run of the same program)
  is compiled in at once, with no profiling.

  Nothing here stops a run: an empty profile (off GPU), a profiler error or a failed second
  compile leaves the plain executable, and says so once. `untimed_s` counts the seconds spent
  on profiling and compiling rather than on steps, for the throughput to leave out.

  Args:
    lowered: the step's `jax.stages.Lowered`.
    options: its per-compile XLA options (`step.compiler_options`).
    steps_left: steps the run will take; fewer than warmup + runs: no profiling.
    first_step: the number of the first step this callable runs (for its messages).
    cache: a `ProfileCache` to load and store the profile, or None (not process 0).
    key: the profile's `cache_key`.
    log: where messages go (None: nowhere, e.g. not process 0).
    platform: the devices' platform ('gpu' profiles without command buffers; None: that
      of jax.devices()).
    trace, share: the profiler session factory and the profile's cross-process sharing
      (`Trace`, `share_from_process_0`; replaceable in tests).
  """

  def __init__(self, lowered, options: dict, *, steps_left: int, first_step: int = 1,
               cache: ProfileCache | None = None, key: dict | None = None,
               runs: int = PROFILE_RUNS, warmup: int = 1, log: Callable | None = print,
               platform: str | None = None, trace: Callable = Trace,
               share: Callable[[bytes], bytes] = share_from_process_0):
    if runs < 1 or warmup < 0:
      raise ValueError(f"PGLE needs runs >= 1 and warmup >= 0, got {runs}, {warmup}")
    self.lowered, self.options, self.cache, self.key = lowered, dict(options), cache, key
    self.runs, self.warmup, self.first_step = runs, warmup, first_step
    self._log, self._trace_factory, self._share = log, trace, share
    self.profiling = profiling_options(self.options, platform or jax.devices()[0].platform)
    self.calls, self.untimed_s, self.profile_compile_s, self.profile_bytes = 0, 0.0, None, 0
    self._trace = self._error = None
    stored, why = cache.load(key) if cache is not None else (b"", "")
    stored = share(stored)
    self.exe = self._compile_with(stored) if stored else None
    if self.exe is not None:
      self.status, self.profile_bytes = "cached", len(stored)
      self._say(f"PGLE: step compiled with the profile cached in "
                f"{cache.directory if cache is not None else 'process 0'}")
      return
    if stored or why:
      self._say(f"PGLE: not using the cached profile: {self._error or why}; profiling again")
      self._error = None
    if steps_left < warmup + runs:
      self.status = "too_short"
      self._say(f"PGLE: {steps_left} steps to go, fewer than the {warmup} + {runs} it needs "
                "to profile; the step runs as compiled without PGLE")
      self.exe = lowered.compile(self.options or None)
    else:
      self.status = "profiling"
      self.exe = lowered.compile(self.profiling or None)

  @property
  def profiling_steps(self) -> tuple[int, int]:
    """(first, last) step numbers that run under the profiler."""
    first = self.first_step + self.warmup
    return first, first + self.runs - 1

  def __call__(self, *args):
    profiling = self.status == "profiling"
    self.calls += 1
    if profiling and self.calls == self.warmup + 1:
      jax.block_until_ready(args)  # the warm-up step done: only the profiled steps in the trace
      self._start()
    out = self.exe(*args)
    if profiling and self.calls == self.warmup + self.runs:
      jax.block_until_ready(out)
      self._finish()
    return out

  def close(self) -> None:
    """Stops a profiler session the run ended in (e.g. interrupted before the last profiled
    step); nothing is compiled or cached."""
    if self._trace is not None:
      try:
        self._trace.stop()
      except Exception:  # noqa: BLE001 (the run is over; its result stands)
        pass
      self._trace = None

  def summary(self) -> dict:
    """What PGLE did in this run, for the trainer's summary.json."""
    profiled = self.status in ("profiled", "no_effect", "failed")
    return dict(status=self.status,
                profiled_steps=list(self.profiling_steps) if profiled else None,
                profile_bytes=self.profile_bytes, compile_s=self.profile_compile_s,
                error=self._error)

  def _say(self, msg: str) -> None:
    if self._log is not None:
      self._log(msg)

  def _start(self) -> None:
    t0 = time.perf_counter()
    a, b = self.profiling_steps
    self._say(f"PGLE: profiling steps {a}..{b}, then compiling the step again with their "
              "instruction times (parallel.pgle)")
    try:
      trace = self._trace_factory()
      trace.start()
      self._trace = trace
    except Exception as e:  # noqa: BLE001 (PGLE is an optimization: the run goes on)
      self._error = f"the profiler failed to start ({_brief(e)})"
    self.untimed_s += time.perf_counter() - t0

  def _finish(self) -> None:
    t0 = time.perf_counter()
    profile = b""
    if self._trace is not None:
      try:
        profile = self._trace.stop()
      except Exception as e:  # noqa: BLE001
        self._error = f"the profiler failed ({_brief(e)})"
      self._trace = None
    profile = self._share(profile)
    exe = self._compile_with(profile) if profile else None
    if exe is not None:
      self.exe, self.status, self.profile_bytes = exe, "profiled", len(profile)
      self.profile_compile_s = time.perf_counter() - t0
      where = ""
      if self.cache is not None:
        try:
          self.cache.store(self.key, profile)
          where = f", cached in {self.cache.directory}"
        except OSError as e:
          where = f", not cached: {_brief(e)}"
      self._say(f"PGLE: step compiled again from the profile ({len(profile):,} bytes{where}) "
                f"in {self.profile_compile_s:.1f}s")
    else:
      self.status = "failed" if self._error else "no_effect"
      why = self._error or ("the profiler recorded no device instruction times here (they "
                            "come from GPU kernels)")
      plain = self.profiling != self.options
      if plain:
        self.exe = self.lowered.compile(self.options or None)
      self._say(f"PGLE has no effect: {why}; the step goes on "
                + ("compiled again as without PGLE" if plain else "as compiled"))
    self.untimed_s += time.perf_counter() - t0

  def _compile_with(self, profile: bytes):
    """`lowered` compiled with `profile`, or None (said) if the compile fails."""
    try:
      return self.lowered.compile({**self.options, "fdo_profile": profile})
    except Exception as e:  # noqa: BLE001
      self._error = f"the compile with the profile failed ({_brief(e)})"
      return None


def _brief(e: Exception) -> str:
  text = f"{type(e).__name__}: {e}"
  return text if len(text) <= 300 else text[:300] + "..."
