"""Test set-up: 8 fake CPU devices, before anything touches JAX, and the CPU compiler's
least code-generation effort (the same HLO, unoptimized machine code: the suite's tiny
programs spend most of their time compiling; a third less on the trainer smoke tests).

The flags must be set before the first JAX backend is created, so this module does it at
import time (pytest imports conftest.py before any test module); the subprocesses the tests
start inherit them.

One persistent compilation cache serves a whole run: both xdist workers and every
subprocess (many tests compile another test's program). On 2 cores it took
test_parallel_step and test_train from 221-231 s to 200-218 s. Each run starts with an
empty one, as CI does.
"""
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
  if _flag.split("=")[0] not in _flags:
    _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


_own_cache: list[str] = []  # a cache folder this process made, to remove at the end


def pytest_configure(config):
  """The run's compilation cache, before anything compiles (collection may): under xdist in
  the run's temporary folder, which both workers share (each is given a folder of it as
  ``--basetemp``) and pytest deletes a few runs later; else a folder of its own."""
  if config.option.basetemp and os.environ.get("PYTEST_XDIST_WORKER"):
    cache = os.path.join(os.path.dirname(os.path.abspath(config.option.basetemp)), "jit_cache")
  else:
    cache = tempfile.mkdtemp(prefix="taco_jax_jit_cache_")
    _own_cache.append(cache)
  settings = {"jax_compilation_cache_dir": cache,
              "jax_persistent_cache_min_compile_time_secs": 0,
              "jax_persistent_cache_min_entry_size_bytes": 0}
  for name, value in settings.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)  # for the tests' subprocesses


def pytest_unconfigure(config):
  for cache in _own_cache:
    shutil.rmtree(cache, ignore_errors=True)
