"""The README's promises: its library example is docs/library_example.py and runs; its CPU
commands (Quickstart, then the codec flow) run in order in a fresh directory, with small
models and step counts, and do what it says: steps trained, files written, messages shown."""
import json
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

# What makes each run small; appended to the README's own arguments.
SMALL_DATA = ["--config.data.seq_len=16", "--config.data.batch_size=8",
              "--config.data.max_corpus_bytes=2000000", "--config.model.max_seq_len=16",
              "--config.model.d_model=32", "--config.model.n_heads=2", "--config.model.d_ff=64",
              "--config.train.eval_batches=1", "--config.train.log_every=2"]
SMALL = {"tiny": ["--config.model.n_layers=1", "--config.train.steps=4",
                  "--config.train.eval_every=2"],  # warm-up (50 steps) is clamped, with a note
         "parallel_tiny": ["--config.model.n_layers=2", "--config.train.steps=4",
                           "--config.train.eval_every=2"]}


def readme_block(heading: str) -> list[str]:
  """The commands of the first ```bash block under `heading` (continuations joined,
  comments dropped, the venv activation skipped)."""
  section = README[README.index(heading):]
  block = section[section.index("```bash") + 7:]
  block = block[:block.index("```")].replace("\\\n", " ")
  lines = [line.split("  #")[0].strip() for line in block.splitlines()]
  return [line for line in lines if line.startswith("python ")]


def test_library_example_is_the_readme_snippet_and_runs():
  source = (REPO / "docs" / "library_example.py").read_text()
  assert f"```python\n{source}```" in README
  out = runpy.run_path(str(REPO / "docs" / "library_example.py"))  # 8 fake CPU devices here
  assert out["n"] == 8 and 0 < out["layer_error"] < 0.06  # fp8 both ways, fp32 reference
  assert all(np.isfinite(np.asarray(g)).all() for g in out["grads"])


def _run(cmd: str, cwd, env) -> subprocess.CompletedProcess:
  args = shlex.split(cmd.replace("/tmp/run", str(cwd / "run")))
  module = args[2]
  config = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), "")
  if module in ("taco_jax.train", "taco_jax.apps.calibrate") and "--help" not in args:
    size = "tiny" if config.endswith("/tiny.py") else "parallel_tiny"
    if "calibrated" not in config:  # a calibrated config keeps the overrides it was made with
      args += SMALL_DATA + SMALL[size]
  if module == "taco_jax.apps.calibrate":
    args.append("--group_sizes=32,64")  # half the grid
  if module == "taco_jax.apps.sample":
    args.append("--max_new_tokens=8")
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, *args[1:]], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=300)
  print(f"{time.perf_counter() - t0:5.1f} s  {cmd}")
  ok = (0, 1) if "--help" in args else (0,)  # absl's --help exits with 1
  assert proc.returncode in ok, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
  return proc


def _summary(proc) -> dict:
  return json.loads(proc.stdout[proc.stdout.rindex("\n{") + 1:])


def _scalars(workdir) -> dict:
  """{tag: [(step, value)]} read back by TensorBoard's own reader."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(workdir / "tb"))
  acc.Reload()
  return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_readme_cpu_commands_in_order(tmp_path, tmp_path_factory):
  quickstart = readme_block("## Quickstart on CPU")
  codec_flow = readme_block("## Watching and choosing the codec")
  assert len(quickstart) == 6 and len(codec_flow) == 4, (quickstart, codec_flow)
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
         "TACO_JAX_CACHE": str(tmp_path_factory.mktemp("corpus"))}
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # compile fast; --cpu_devices, not
  #                                                          the test's 8 devices
  tiny, tiny_run, sample, par, plot, helped = [_run(c, tmp_path, env) for c in quickstart]
  errors, plot2, calib, calibrated = [_run(c, tmp_path, env) for c in codec_flow]
  again = _run(quickstart[0], tmp_path, env)

  # Quickstart: the tiny GPT on one device, then again in --workdir
  for proc, workdir in ((tiny, tmp_path / "workdir" / "tiny"), (tiny_run, tmp_path / "run")):
    assert re.search(rf"^tiny: [\d,]+ params on 1 cpu device, mesh data=1 x pipeline=1 x "
                     rf"tensor=1; workdir .*{workdir.name}$",
                     proc.stdout, re.M), proc.stdout
    assert "note: optim.warmup_steps=50 > train.steps=4: the warm-up is clamped" in proc.stderr
    assert "step 2: val_loss" in proc.stdout + proc.stderr
    s = _summary(proc)
    assert s["status"] == "completed" and s["step"] == 4 and s["mfu"] is None  # CPU: no MFU
    assert json.loads((workdir / "summary.json").read_text())["step"] == 4
    recs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in recs if "tokens_per_s" in r] == [2, 4]  # once per window
    assert not any("mfu" in r for r in recs)
    tb = _scalars(workdir)
    assert [st for st, _ in tb["loss"]] == [1, 2, 3, 4] and len(tb["val_loss"]) == 2
    assert "mfu" not in tb and tb["lr"][-1][1] > 0
    assert (workdir / "checkpoints" / "4").is_dir()
  assert not list(tmp_path.glob("workdir/tiny/*.npy"))  # the corpus is cached once per user
  assert re.match(r"# step 4\n", sample.stderr) and sample.stdout.startswith("def main(")
  # the parallel config on 8 fake CPU devices: the same output as the single-device trainer
  assert re.search(r"^parallel_tiny: [\d,]+ params on 8 cpu devices, mesh data=2 x "
                   r"pipeline=2 x tensor=2; workdir \S+$", par.stdout, re.M), par.stdout
  assert "compression tp_forward, tp_backward, pp: e4m3 G=64; dp, dp_params: off" in par.stdout
  assert "step 2: val_loss" in par.stdout + par.stderr and "parallel_tiny: 100%" in par.stderr
  assert _summary(par)["step"] == 4
  assert (tmp_path / "workdir" / "tiny" / "loss.png").stat().st_size > 10_000
  assert "wrote" in plot.stdout
  for flag in ("--config", "--workdir", "--cpu_devices"):
    assert flag in helped.stdout

  # The codec flow: its own workdirs; the calibrated config under its own name
  err_dir = tmp_path / "workdir" / "parallel_tiny_errors"
  assert "errors logged" in errors.stdout and _summary(errors)["step"] == 4
  recs = [json.loads(line) for line in (err_dir / "metrics.jsonl").read_text().splitlines()]
  errs = [r["compression_error/tp_forward"] for r in recs if "loss" in r]
  assert len(errs) == 4 and all(0 < e < 0.2 for e in errs)
  assert "compression_error/tp_forward" in _scalars(err_dir)
  assert (err_dir / "loss.png").exists() and "wrote" in plot2.stdout
  assert "untrained" not in calib.stderr  # it read the trained run
  assert "wrote calibrated_tiny.py" in calib.stdout
  assert not list((REPO / "configs").glob("calibrated_tiny*"))
  written = (tmp_path / "calibrated_tiny.py").read_text()
  assert "c.name = 'calibrated_tiny'" in written and "trained run" in written
  s = _summary(calibrated)
  assert s["workdir"] == "workdir/calibrated_tiny" and s["step"] == 4 and s["start_step"] == 0
  assert "already at step" not in calibrated.stdout
  # the first command again: nothing left to train, and it says so
  assert "workdir/tiny is already at step 4 (train.steps=4): nothing to train" in again.stdout
  assert _summary(again)["status"] == "already_done"


def test_a_mistyped_config_key_is_one_line(tmp_path, tmp_path_factory):
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
         "TACO_JAX_CACHE": str(tmp_path_factory.mktemp("corpus"))}
  env.pop("XLA_FLAGS", None)
  typo = subprocess.run([sys.executable, "-m", "taco_jax.train", "--config=configs/tiny.py",
                         "--config.trian.steps=5"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
  assert typo.returncode == 2
  assert typo.stderr.strip() == ("error: bad --config override: no field 'trian'. Did you "
                                 'mean "train" instead of "trian"?')
