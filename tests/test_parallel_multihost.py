"""Two CPU processes on localhost (4 devices each) run the parallel trainer as one 2x2x2
mesh through `jax.distributed.initialize()` (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID); "tensor" stays inside a process. The first step's loss must equal the
single-device model's; a PGLE profile measured on process 0 reaches both. Run as a script,
this file is the worker."""
import json
import os
import pathlib
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(cache_dir):
  from taco_jax.configs import parallel_tiny
  c = parallel_tiny.get_config()
  c.model.update(n_layers=2, d_model=64, n_heads=8, d_ff=128, max_seq_len=32)
  c.data.update(seq_len=32, batch_size=8, max_corpus_bytes=2_000_000, cache_dir=cache_dir)
  c.optim.update(warmup_steps=1)
  c.train.update(steps=1, log_every=1, eval_every=0, eval_batches=1, checkpoint_every=0)
  c.compression.enabled = False
  return c


def test_two_processes_train_as_one_mesh(tmp_path):
  import jax
  import numpy as np
  from taco_jax.models.decoder import loss_fn
  from taco_jax import data
  from taco_jax.tp import layout as layout_lib
  from taco_jax.train.metrics import read_jsonl

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
             PYTHONPATH=str(REPO), XLA_FLAGS="--xla_backend_optimization_level=0")
  procs = [subprocess.Popen([sys.executable, __file__, str(tmp_path)], cwd=REPO,
                            env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=240)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  results = [json.loads(out.split("RESULT ")[-1]) for out in outs]
  assert [r["process"] for r in results] == [0, 1]
  assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in results)
  assert results[0]["val_loss"] == results[1]["val_loss"]
  assert results[0]["tensor_groups_local"] and results[1]["tensor_groups_local"]
  assert [r["pgle_profile"] for r in results] == ["measured on process 0"] * 2  # shared

  c = _config(str(tmp_path / "cache"))
  corpus = data.load_corpus("", cache_dir=c.data.cache_dir,
                            max_corpus_bytes=c.data.max_corpus_bytes)
  tokens = data.batch_at(corpus.train, 0, seed=c.seed, batch_size=8, seq_len=32)
  model = layout_lib.single_device_model(layout_lib.model_config(c.model), c.seed)
  ref = float(loss_fn(model, jax.numpy.asarray(tokens))[0])
  first = read_jsonl(tmp_path / "metrics.jsonl")[0]
  np.testing.assert_allclose(first["loss"], ref, rtol=1e-5)


def _worker(workdir):
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from taco_jax.tp.mesh import make_mesh
  from taco_jax.train import pgle
  from taco_jax.train.trainer import train
  c = _config(str(pathlib.Path(workdir) / "cache"))
  s = train(c, workdir)
  # every process compiles with process 0's profile (the trainer's parallel.pgle)
  profile = pgle.share_from_process_0(b"measured on process 0" if jax.process_index() == 0
                                      else b"")
  mesh = make_mesh(c.parallel.dp, c.parallel.pp, c.parallel.tp)
  local = {d.id for d in jax.local_devices()}
  groups = mesh.devices.reshape(-1, c.parallel.tp)  # tensor groups: the innermost axis
  print("RESULT " + json.dumps(dict(
      process=jax.process_index(), devices=jax.device_count(),
      local_devices=jax.local_device_count(), val_loss=s["val_loss"],
      pgle_profile=profile.decode(),
      tensor_groups_local=all({d.id for d in g} <= local or not {d.id for d in g} & local
                              for g in groups))), flush=True)


if __name__ == "__main__":
  _worker(sys.argv[1])
