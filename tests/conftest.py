"""Test set-up: 8 fake CPU devices, before anything touches JAX, and the CPU compiler's
least code-generation effort (the same HLO, unoptimized machine code: the suite's tiny
programs spend most of their time compiling; a third less on the trainer smoke tests).

The flags must be set before the first JAX backend is created, so this module does it at
import time (pytest imports conftest.py before any test module); the subprocesses the tests
start inherit them.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
  if _flag.split("=")[0] not in _flags:
    _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
