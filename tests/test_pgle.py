"""taco_jax.train.pgle: the compile -> profile -> compile loop, for benchmarks and as the
trainer's step (its GPU effect is measured by `benchmarks/bench_train.py` *_pgle variants,
not here: off GPU the profile is empty)."""
import jax
import jax.numpy as jnp
import pytest

from taco_jax.train import pgle


def test_off_gpu_the_profile_is_empty_and_the_first_executable_is_kept():
  lowered = jax.jit(lambda x: jnp.sum(x @ x)).lower(jnp.ones((16, 16)))
  outputs = []
  exe, profiled = pgle.profile_guided_compile(
      lowered, lambda e: outputs.append(float(e(jnp.ones((16, 16))))), runs=2)
  assert not profiled
  assert outputs == [16.0 * 16 * 16] * 3  # one warm-up, two profiled runs
  assert float(exe(jnp.full((16, 16), 2.0))) == 4.0 * 16 * 16 * 16


class _Lowered:
  """Records the options of each compile; its executables say which compile made them."""

  def __init__(self, fail_with_profile=False):
    self.compiles, self.fail_with_profile = [], fail_with_profile

  def compile(self, options=None):
    if self.fail_with_profile and "fdo_profile" in (options or {}):
      raise RuntimeError("XLA refused the profile")
    self.compiles.append(options)
    n = len(self.compiles)
    return lambda state, batch: (f"exe{n}", state + batch)

  def as_text(self):
    return "module @jit_step {}"


class _Trace:
  """A profiler session that records its calls and returns (or raises) what it is told."""

  def __init__(self, log, profile=b"times", start_error=None, stop_error=None):
    self.log, self.profile = log, profile
    self.start_error, self.stop_error = start_error, stop_error

  def __call__(self):
    return self

  def start(self):
    self.log.append("start")
    if self.start_error:
      raise self.start_error

  def stop(self):
    self.log.append("stop")
    if self.stop_error:
      raise self.stop_error
    return self.profile


def _run(step, n, log):
  """Steps `n` times from state 0 with batch i = i + 1, as `runner.run_steps` does;
  returns which executable ran each step."""
  state, ran = 0, []
  for i in range(n):
    log.append(f"step{i + 1}")
    tag, state = step(state, i + 1)
    ran.append(tag)
  assert state == n * (n + 1) // 2  # every step's output went into the next: none wasted
  return ran


def test_a_measured_profile_goes_to_the_second_compile_with_the_options(monkeypatch):
  monkeypatch.setattr(pgle, "profiled_instructions", lambda run, runs: run() or b"times")
  lowered, ran = _Lowered(), []
  exe, profiled = pgle.profile_guided_compile(lowered, ran.append,
                                              options={"xla_gpu_dot_merger_threshold_mb": 0})
  assert profiled and len(ran) == 2 and ran[0] is ran[1]  # the first exe: warm-up, profiled
  assert lowered.compiles == [{"xla_gpu_dot_merger_threshold_mb": 0},
                              {"xla_gpu_dot_merger_threshold_mb": 0, "fdo_profile": b"times"}]


def test_the_step_profiles_its_own_steps_swaps_and_caches_then_a_resume_uses_the_cache(
    tmp_path):
  opts, log, said = {"xla_gpu_dot_merger_threshold_mb": 0}, [], []
  cache, lowered = pgle.ProfileCache(tmp_path / "pgle"), _Lowered()
  key = dict(module_sha256="abc", options=opts)
  step = pgle.ProfileGuidedStep(lowered, opts, steps_left=6, first_step=1, cache=cache,
                                key=key, log=said.append, platform="gpu", trace=_Trace(log))
  assert _run(step, 6, log) == ["exe1"] * 3 + ["exe2"] * 3
  # step 1 warms up; steps 2 and 3 run under the profiler; step 4 on runs the second compile
  assert log == ["step1", "step2", "start", "step3", "stop", "step4", "step5", "step6"]
  assert lowered.compiles == [{**opts, "xla_gpu_enable_command_buffer": ""},  # as JAX's PGLE
                              {**opts, "fdo_profile": b"times"}]
  assert step.summary() == dict(status="profiled", profiled_steps=[2, 3], profile_bytes=5,
                                compile_s=step.profile_compile_s, error=None)
  assert step.untimed_s >= step.profile_compile_s > 0
  assert said[0].startswith("PGLE: profiling steps 2..3") and "compiled again" in said[1]
  assert cache.profile.read_bytes() == b"times"

  resumed, log2, said2 = _Lowered(), [], []  # same program, a later run in the same workdir
  step = pgle.ProfileGuidedStep(resumed, opts, steps_left=3, first_step=7, cache=cache,
                                key=key, log=said2.append, platform="gpu", trace=_Trace(log2))
  assert _run(step, 3, log2) == ["exe1"] * 3 and "start" not in log2
  assert resumed.compiles == [{**opts, "fdo_profile": b"times"}]
  assert step.status == "cached" and said2 == [f"PGLE: step compiled with the profile cached "
                                               f"in {cache.directory}"]

  other, said3 = _Lowered(), []  # another program: profiles again
  step = pgle.ProfileGuidedStep(other, opts, steps_left=3, cache=cache,
                                key=dict(key, module_sha256="def"), log=said3.append,
                                platform="cpu", trace=_Trace([], profile=b"new"))
  assert _run(step, 3, []) == ["exe1"] * 3 and step.status == "profiled"
  assert "measured for another module_sha256" in said3[0]
  assert other.compiles[0] == opts  # off GPU: command buffers as they are


@pytest.mark.parametrize("platform, trace, status, why", [
    ("cpu", dict(profile=b""), "no_effect", "recorded no device instruction times"),
    ("gpu", dict(profile=b""), "no_effect", "recorded no device instruction times"),
    ("gpu", dict(start_error=RuntimeError("already tracing")), "failed",
     "the profiler failed to start (RuntimeError: already tracing)"),
    ("cpu", dict(stop_error=OSError("disk full")), "failed", "the profiler failed (OSError"),
])
def test_no_profile_leaves_the_plain_step_and_says_so_once(tmp_path, platform, trace, status,
                                                            why):
  opts, said = {"xla_gpu_dot_merger_threshold_mb": 0}, []
  lowered = _Lowered()
  step = pgle.ProfileGuidedStep(lowered, opts, steps_left=8, cache=pgle.ProfileCache(tmp_path),
                                key={}, log=said.append, platform=platform,
                                trace=_Trace([], **trace))
  ran = _run(step, 8, [])
  assert step.status == status and len(said) == 2 and why in said[1]
  if platform == "gpu":  # the profiled compile had no command buffers: compiled again plain
    assert ran == ["exe1"] * 3 + ["exe2"] * 5 and lowered.compiles[1] == opts
  else:
    assert ran == ["exe1"] * 8 and lowered.compiles == [opts]
  assert not (tmp_path / "profile.pb").exists()


def test_a_profile_that_does_not_compile_and_a_run_too_short_to_profile():
  said = []
  step = pgle.ProfileGuidedStep(_Lowered(fail_with_profile=True), {}, steps_left=4,
                                log=said.append, platform="cpu", trace=_Trace([]))
  assert _run(step, 4, []) == ["exe1"] * 4 and step.status == "failed"
  assert "the compile with the profile failed (RuntimeError: XLA refused" in said[1]
  log, said = [], []
  step = pgle.ProfileGuidedStep(_Lowered(), {}, steps_left=2, log=said.append,
                                platform="cpu", trace=_Trace(log))
  assert _run(step, 2, log) == ["exe1"] * 2 and "start" not in log
  assert step.status == "too_short" and "2 steps to go, fewer than the 1 + 2" in said[0]


def test_close_stops_a_trace_the_run_ended_in():
  log = []
  step = pgle.ProfileGuidedStep(_Lowered(), {}, steps_left=10, log=None, platform="cpu",
                                trace=_Trace(log))
  _run(step, 2, log)  # interrupted after the first profiled step
  step.close()
  assert log[-2:] == ["start", "stop"] and step.status == "profiling"


def test_on_gpu_the_profiled_compile_has_no_command_buffers():
  opts = {"xla_gpu_dot_merger_threshold_mb": 0}
  assert pgle.profiling_options(opts, "gpu") == {**opts, "xla_gpu_enable_command_buffer": ""}
  assert pgle.profiling_options(opts, "cpu") == opts


def test_needs_a_profiled_run():
  with pytest.raises(ValueError, match="at least one"):
    pgle.profiled_instructions(lambda: None, 0)
