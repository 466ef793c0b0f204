"""step.compiler_options: the XLA options a step is compiled with (parallel.interleave,
parallel.xla_overlap, parallel.collectives_in_flight) reach the compile and are accepted
there; XLA_OVERLAP_OPTIONS are what benchmarks set in XLA_FLAGS. Checked on the compile's
own record of its options (XLA's debug_options dump), not by their effect (GPU only)."""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from taco_jax.configs import tiny
from taco_jax.tp import step as step_lib
from taco_jax.train.config import compiler_options

REPO = pathlib.Path(__file__).resolve().parents[1]
# a program of one module, jit__lambda, compiled here and in a process of its own
SCRIPT = ("import jax, jax.numpy as jnp\n"
          "jax.jit(lambda x: jnp.sum(x @ x)).lower(jnp.ones((8, 8))).compile()")


def _lowered():
  return jax.jit(lambda x: jnp.sum(x @ x)).lower(jnp.ones((8, 8)))


def _gpu_options_compiled(dump_dir) -> set[str]:
  """The xla_gpu_* debug options (those not at XLA's defaults) of the one module dumped."""
  (path,) = pathlib.Path(dump_dir).glob("*jit__lambda.debug_options")
  return {line for line in path.read_text().splitlines() if line.startswith("xla_gpu_")}


def test_a_configs_options_reach_the_compile(tmp_path):
  c = tiny.get_micro_config()
  # the defaults: the overlap options every bench_train step was measured with
  assert compiler_options(c) == step_lib.XLA_OVERLAP_OPTIONS
  c.parallel.update(interleave=2, xla_overlap=True, collectives_in_flight=2)
  opts = compiler_options(c)
  assert opts == {**step_lib.INTERLEAVE_XLA_OPTIONS, **step_lib.XLA_OVERLAP_OPTIONS,
                  step_lib.COLLECTIVES_IN_FLIGHT: 2}
  _lowered().compile({**opts, "xla_dump_to": str(tmp_path)})
  assert _gpu_options_compiled(tmp_path) >= {
      "xla_gpu_enable_latency_hiding_scheduler: true",
      "xla_gpu_experimental_parallel_collective_overlap_limit: 2",
      "xla_gpu_dot_merger_threshold_mb: 0"}
  # the limit is the latency-hiding scheduler's: asking for it turns the scheduler on
  assert step_lib.compiler_options(collectives_in_flight=4) == {
      step_lib.LATENCY_HIDING_SCHEDULER: True, step_lib.COLLECTIVES_IN_FLIGHT: 4}
  with pytest.raises(ValueError, match="collectives_in_flight=0 must be an integer >= 1"):
    step_lib.compiler_options(collectives_in_flight=0)


def test_the_kernel_layers_launch_their_kernels_outside_cuda_graphs():
  """tp_overlap="kernel" adds KERNEL_XLA_OPTIONS (CUDA graphs for XLA's fusions and library
  calls only: step.py says why), which the compile accepts, as it does no graph at all (an
  empty list of command types); a bad command type is refused."""
  c = tiny.get_micro_config()
  assert c.parallel.tp_overlap == "none"
  assert not step_lib.KERNEL_XLA_OPTIONS.items() <= compiler_options(c).items()
  c.parallel.tp_overlap = "kernel"
  assert compiler_options(c) == step_lib.XLA_OVERLAP_OPTIONS  # TP=1: no kernels
  c.parallel.tp = 2
  opts = compiler_options(c)
  assert opts == {**step_lib.XLA_OVERLAP_OPTIONS,
                  "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN"}
  _lowered().compile(opts)
  _lowered().compile({**opts, **step_lib.KERNEL_NO_GRAPHS_OPTIONS})
  with pytest.raises(Exception, match="not a valid enum value"):
    _lowered().compile({"xla_gpu_enable_command_buffer": "-CUSTOM_CALL"})


def test_kernel_graphs_change_only_the_kernel_layers_command_buffers():
  c = tiny.get_micro_config()
  c.parallel.update(tp=2, tp_overlap="kernel")
  overlap = step_lib.XLA_OVERLAP_OPTIONS
  assert compiler_options(c, kernel_graphs="fusions") == compiler_options(c)
  assert compiler_options(c, kernel_graphs="none") == {
      **overlap, "xla_gpu_enable_command_buffer": ""}
  assert compiler_options(c, kernel_graphs="all") == overlap
  c.parallel.tp = 1  # no kernel layers
  assert compiler_options(c, kernel_graphs="none") == overlap
  with pytest.raises(ValueError, match=r"kernel_graphs='some' must be one of \('fusions', "
                     r"'none', 'all'\)"):
    step_lib.compiler_options(kernels=True, kernel_graphs="some")


def test_exchange_slices_compile_without_the_dot_merger(monkeypatch):
  """`layers.EXCHANGE_PARTS` > 1 (bench_train's ``_xparts``): XLA's DotMerger off, which
  would join the slices' out-projections; nothing else changes."""
  from taco_jax.tp import layers
  monkeypatch.setattr(layers, "EXCHANGE_PARTS", 4)
  assert step_lib.compiler_options() == step_lib.NO_DOT_MERGER
  monkeypatch.setattr(layers, "EXCHANGE_PARTS", 1)
  assert step_lib.compiler_options(exchange_parts=2) == step_lib.NO_DOT_MERGER
  assert step_lib.compiler_options(2, exchange_parts=2) == step_lib.INTERLEAVE_XLA_OPTIONS
  assert step_lib.compiler_options(exchange_parts=1) == step_lib.compiler_options() == {}
  _lowered().compile(step_lib.NO_DOT_MERGER)  # an option the compiler takes


def test_an_unknown_option_is_refused_by_the_compile():
  with pytest.raises(Exception, match="No such compile option: 'xla_gpu_enable_pipelined_all"):
    _lowered().compile({"xla_gpu_enable_pipelined_all_gather": True})  # an XLA_FLAGS name


def test_xla_overlap_options_are_the_benchmarks_xla_flags(tmp_path):
  from benchmarks.gspmd import XLA_OVERLAP_FLAGS
  flags = " ".join((*XLA_OVERLAP_FLAGS, f"--xla_dump_to={tmp_path / 'flags'}"))
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, check=True,
                 capture_output=True, timeout=120)
  _lowered().compile({**step_lib.XLA_OVERLAP_OPTIONS, "xla_dump_to": str(tmp_path / "options")})
  from_flags = _gpu_options_compiled(tmp_path / "flags")
  assert from_flags == _gpu_options_compiled(tmp_path / "options")
  assert "xla_gpu_enable_latency_hiding_scheduler: true" in from_flags
