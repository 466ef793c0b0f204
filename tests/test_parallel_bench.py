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
  args = types.SimpleNamespace(steps=4, warmup=1, steps_per_turn=1)
  failed = step_interleaved(runs, lambda i: i, args, t_end=float("inf"))
  assert list(failed) == ["big"] and "RESOURCE_EXHAUSTED" in failed["big"]
  assert set(runs) == {"a", "b"}
  assert all(r["losses"] == [0.0, 1.0, 2.0, 3.0] for r in runs.values())


def test_runs_take_turns_of_steps_timed_back_to_back():
  """Each run steps `steps_per_turn` batches in a row (the runs' order rotating each turn),
  on the same batches as the others; a turn of k steps gives k - 1 completion-to-completion
  times and one synced time."""
  import types
  import jax.numpy as jnp
  from benchmarks.train_parallel import step_interleaved

  calls = []

  def stepper(name):
    def step(params, opt_state, batch):
      calls.append((name, batch))
      return params + 1, opt_state, {"loss": jnp.float32(batch)}
    return step

  runs = {name: dict(exe=stepper(name), state=(0, 0), batch=float) for name in "ab"}
  args = types.SimpleNamespace(steps=7, warmup=0, steps_per_turn=3)
  assert step_interleaved(runs, lambda i: 10 * i, args, t_end=float("inf")) == {}
  assert [n for n, _ in calls] == list("aaabbbbbbaaaab")
  assert all(r["losses"] == [10.0 * i for i in range(7)] for r in runs.values())
  assert all(r["state"] == (7, 0) for r in runs.values())
  assert all(len(r["times"]) == 2 + 2 + 1 and len(r["synced"]) == 3 for r in runs.values())


def test_comm_record_lists_each_collective_of_the_step():
  """``comm_record``: the compiled program's collectives summed per axis and dtype, and each
  one listed with its kind, axes and the jax op that made it."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from benchmarks.train_parallel import comm_record
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=jax.devices()[:8])

  def body(x):
    gathered = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
    return gathered[:, :x.shape[1]] + jax.lax.psum(x, "data")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "tensor"),
                            out_specs=P("data", "tensor")))
  x = jax.ShapeDtypeStruct((2, 8), jnp.float32,
                           sharding=NamedSharding(mesh, P("data", "tensor")))
  record = comm_record(f.lower(x).compile().as_text(), mesh)
  ops = {(op["kind"], tuple(op["axes"])): op for op in record["comm_ops"]}
  assert set(ops) == {("all-gather", ("tensor",)), ("all-reduce", ("data",))}
  assert ops[("all-gather", ("tensor",))]["shape"] == [1, 8]
  assert "all_gather" in ops[("all-gather", ("tensor",))]["op"]
  assert "psum" in ops[("all-reduce", ("data",))]["op"]
  assert record["comm_static"] == {"tensor": {"f32": 32}, "data": {"f32": 8}}
