"""taco_jax.train.pgle: the compile -> profile -> compile loop (its GPU effect is measured
by `benchmarks/bench_train.py` *_pgle variants, not here: off GPU the profile is empty)."""
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

  def __init__(self):
    self.compiles = []

  def compile(self, options=None):
    self.compiles.append(options)
    n = len(self.compiles)
    return lambda state, batch: (f"exe{n}", state + batch)


def test_a_measured_profile_goes_to_the_second_compile_with_the_options(monkeypatch):
  monkeypatch.setattr(pgle, "profiled_instructions", lambda run, runs: run() or b"times")
  lowered, ran = _Lowered(), []
  exe, profiled = pgle.profile_guided_compile(lowered, ran.append,
                                              options={"xla_gpu_dot_merger_threshold_mb": 0})
  assert profiled and len(ran) == 2 and ran[0] is ran[1]  # the first exe: warm-up, profiled
  assert lowered.compiles == [{"xla_gpu_dot_merger_threshold_mb": 0},
                              {"xla_gpu_dot_merger_threshold_mb": 0, "fdo_profile": b"times"}]


def test_on_gpu_the_profiled_compile_has_no_command_buffers():
  opts = {"xla_gpu_dot_merger_threshold_mb": 0}
  assert pgle.profiling_options(opts, "gpu") == {**opts, "xla_gpu_enable_command_buffer": ""}
  assert pgle.profiling_options(opts, "cpu") == opts


def test_needs_a_profiled_run():
  with pytest.raises(ValueError, match="at least one"):
    pgle.profiled_instructions(lambda: None, 0)
