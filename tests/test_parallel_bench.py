"""Smoke run of benchmarks/train_parallel.py (slow: ~40 s; the trainer tests cover the step)."""
import json

import pytest


@pytest.mark.slow
def test_train_parallel_smoke(tmp_path):
  from benchmarks import train_parallel
  path = train_parallel.main(["--smoke", "--layouts", "2,2,2", "--steps", "3",
                              "--out-dir", str(tmp_path)])
  report = json.loads(path.read_text())
  rows = {r["compression"]: r for r in report["results"]}
  assert set(rows) == {"off", "on"} and all(r["steps"] == 3 for r in rows.values())
  assert "u8" in rows["on"]["comm_bytes_static"]["tensor"]
  assert "u8" not in rows["off"]["comm_bytes_static"]["tensor"]


def test_a_variant_that_fails_on_the_device_leaves_the_others_running():
  import types
  import jax
  import jax.numpy as jnp
  from benchmarks.train_parallel import step_interleaved

  def ok(params, opt_state, batch):
    return params, opt_state, {"loss": jnp.float32(batch)}

  def out_of_memory(params, opt_state, batch):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")

  runs = {name: dict(exe=exe, state=(0, 0), batch=float) for name, exe in
          (("a", ok), ("big", out_of_memory), ("b", ok))}
  args = types.SimpleNamespace(steps=4, warmup=1)
  failed = step_interleaved(runs, lambda i: i, args, t_end=float("inf"))
  assert list(failed) == ["big"] and "RESOURCE_EXHAUSTED" in failed["big"]
  assert set(runs) == {"a", "b"}
  assert all(r["losses"] == [0.0, 1.0, 2.0, 3.0] for r in runs.values())
