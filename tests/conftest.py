"""Test set-up: 8 fake CPU devices, before anything touches JAX.

The flag must be set before the first JAX backend is created, so this module does it at
import time (pytest imports conftest.py before any test module).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
