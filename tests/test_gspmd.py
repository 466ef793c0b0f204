"""The GSPMD baseline step (benchmarks.gspmd) against the single-device model, and
smoke runs of the benchmarks that use it (bench_train, profile_step)."""
import gzip

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from taco_jax.models.decoder import loss_fn
from taco_jax import testing
from taco_jax.tp import layout as layout_lib
from benchmarks import gspmd
from taco_jax.testing import hlo

CFG = layout_lib.model_config(dict(vocab_size=256, n_layers=2, d_model=64, n_heads=8,
                                  d_ff=128, max_seq_len=32, dtype="float32"))
BATCH, SEQ = 8, 32
F32_TOL = 64 * testing.unit_roundoff(jnp.float32)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _tokens():
  return jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CFG.vocab_size)


def _leaves(tree):
  return [(jax.tree_util.keystr(p), np.asarray(x, np.float64))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.fixture(scope="module")
def reference():
  model = layout_lib.single_device_model(CFG, seed=0)
  (loss, _), grads = jax.value_and_grad(lambda m: loss_fn(m, _tokens()), has_aux=True)(model)
  par = lambda s: layout_lib.to_parallel(nnx.to_pure_dict(nnx.state(s, nnx.Param)))
  return float(loss), jax.device_get(par(grads))


@pytest.fixture(scope="module", params=[(2, 4, "sp"), (1, 8, "replicated")],
                ids=lambda p: "dp%d-tp%d-%s" % p)
def run(request):
  dp, tp, act = request.param
  mesh = gspmd.make_mesh(dp, tp)
  params = gspmd.init_params(CFG, mesh, seed=0)
  tokens = jax.device_put(_tokens(), gspmd.batch_sharding(mesh))
  exe = jax.jit(gspmd.loss_and_grads_fn(CFG, mesh, act)).lower(params, tokens).compile(
      compiler_options=FAST_COMPILE)
  loss, grads = exe(params, tokens)
  return dict(mesh=mesh, params=params, tokens=tokens, loss=float(loss),
              grads=jax.device_get(grads), colls=hlo.collectives(exe.as_text(), mesh),
              tp=tp, dp=dp)


def test_params_are_the_single_device_ones(run):
  model = layout_lib.single_device_model(CFG, seed=0)
  ref = layout_lib.to_parallel(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  for (p, a), (_, b) in zip(_leaves(run["params"]), _leaves(ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=p)  # jit vs eager init
  assert run["params"]["blocks"]["mlp_in"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
      None, None, "tensor")


def test_loss_and_grads_match_single_device(run, reference):
  ref_loss, ref_grads = reference
  np.testing.assert_allclose(run["loss"], ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(run["grads"]), _leaves(ref_grads), strict=True):
    err = np.max(np.abs(g - r))
    assert err <= F32_TOL * np.max(np.abs(r)), (path, err, np.max(np.abs(r)))


def test_hlo_is_sharded(run):
  """The partitioner inserted collectives over "tensor" (and over "data" for dp > 1)."""
  axes = {a for c in run["colls"] for a in c.axes}
  assert "tensor" in axes, [c.line for c in run["colls"]]
  assert ("data" in axes) == (run["dp"] > 1)


def test_attention_inputs_are_split_by_heads(run):
  """q, k and v are pinned to whole heads per tensor rank (cuDNN's partitioner refuses a
  sequence-sharded input, which the sequence-parallel residual stream would propagate)."""
  text = jax.jit(gspmd.loss_fn(CFG, run["mesh"])).lower(run["params"], run["tokens"]).as_text()
  shape = "tensor<%dx%dx%dx%d" % (BATCH, SEQ, CFG.n_heads, CFG.d_model // CFG.n_heads)
  pinned = [l for l in text.splitlines() if "sharding_constraint" in l and shape in l]
  assert len(pinned) == 3, pinned  # q, k, v of the scanned layer body
  assert all('[{"data"}, {}, {"tensor"}, {}]' in l for l in pinned), pinned


def test_train_step_runs_and_keeps_shardings(run):
  tx = optax.adamw(1e-3)
  sh = gspmd.shardings(CFG, run["mesh"])
  opt = jax.jit(tx.init)(run["params"])
  step = jax.jit(gspmd.make_train_step(CFG, run["mesh"], tx), out_shardings=(sh, None, None))
  step = step.lower(run["params"], opt, run["tokens"]).compile(compiler_options=FAST_COMPILE)
  params, _, met = step(run["params"], opt, run["tokens"])
  np.testing.assert_allclose(float(met["loss"]), run["loss"], rtol=F32_TOL)
  assert params["wte"].sharding.spec == sh["wte"].spec


@pytest.mark.slow
def test_bench_train_smoke(tmp_path):
  """benchmarks/bench_train.py --smoke in a fresh process (~45 s on 2 CPU cores)."""
  import json
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  subprocess.run([sys.executable, str(root / "benchmarks/bench_train.py"), "--smoke",
                  "--out-dir", str(tmp_path)], check=True, cwd=root)
  (path,) = tmp_path.glob("bench_train_smoke_8cpu_*.json")
  rep = json.loads(path.read_text())
  by = {(r["layout"], r["variant"]): r for r in rep["results"]}
  for lay in ("2,1,4", "2,2,2"):
    assert "tensor" not in by[lay, "ideal"]["comm_bytes_static"]
    assert "u8" in by[lay, "on"]["comm_bytes_static"]["tensor"]
    assert "tensor" in by[lay, "gspmd"]["comm_bytes_static"]
    assert abs(by[lay, "gspmd"]["loss_curve"][0] - by[lay, "off"]["loss_curve"][0]) < 1e-4
  assert {s["layout"] for s in rep["summary"]} == {"2,1,4", "2,2,2"}
  m = rep["config"]["microbatches"]
  assert by["2,2,2", "off"]["bubble_fraction"] == pytest.approx(1 / (m + 1))  # GPipe, pp = 2
  assert by["2,1,4", "off"]["bubble_fraction"] is None


def test_bench_train_modified_variants_smoke(tmp_path):
  """bench_train --smoke with _il2 / _save / _dots / _noremat / _cif2 / _pgle variants (~40 s
  on 2 CPU cores): they build, start from the same parameters, record what they are and their
  memory (more kept, more temporaries), and the run records its attention (XLA on CPU)."""
  import json

  from benchmarks import bench_train
  path = bench_train.main(["--smoke", "--layouts", "2,1,4", "--variants",
                           "off,off_save_cif2_pgle,on_il2_save_dots,off_noremat", "--dump-hlo",
                           "on_il2_save_dots", "--out-dir", str(tmp_path)])
  rep = json.loads(path.read_text())
  by = {r["variant"]: r for r in rep["results"]}
  assert by["off_save_cif2_pgle"]["save_tp_outputs"] and not by["off"]["save_tp_outputs"]
  assert by["on_il2_save_dots"]["save_dots"] and not by["off_save_cif2_pgle"]["save_dots"]
  assert [by[v]["remat"] for v in ("off", "off_noremat")] == [True, False]
  temp = {v: r["memory_temp_bytes"] for v, r in by.items()}
  assert temp["off"] < temp["off_save_cif2_pgle"] < temp["off_noremat"], temp
  assert by["off_save_cif2_pgle"]["pgle_profiled"] is False  # CPU: the profile is empty
  assert by["on_il2_save_dots"]["xla_options"]  # interleaved: DotMerger / combiners off
  assert by["off_save_cif2_pgle"]["xla_options"] == {  # 2 collectives in flight
      "xla_gpu_enable_latency_hiding_scheduler": True,
      "xla_gpu_experimental_parallel_collective_overlap_limit": 2}
  for v in ("off_save_cif2_pgle", "off_noremat"):
    assert by[v]["loss_curve"][0] == pytest.approx(by["off"]["loss_curve"][0], rel=1e-6)
  assert by["off"]["kernel_fallbacks"] is None  # not a kernel-layer variant
  (s,) = rep["summary"]
  assert "speedup_save_cif2_pgle_off" in s and s["best_on"] == "on_il2_save_dots"
  assert rep["attention"]["backend"] == "xla"
  assert rep["attention"]["numerics"]["cudnn"] == "unavailable"
  assert rep["device_peak_bytes"] is None  # CPU
  (hlo_gz,) = tmp_path.glob("hlo_*.txt.gz")  # --dump-hlo: that variant's only
  assert hlo_gz.name == "hlo_smoke_214_on_il2_save_dots.txt.gz"
  assert b"all-to-all" in gzip.decompress(hlo_gz.read_bytes())


def test_profile_step_smoke(tmp_path):
  """benchmarks/profile_step.py --smoke, one variant (~10 s): the trace is summarized per
  device, and the HLO and trace files are written where asked."""
  import json

  from benchmarks import profile_step
  profile_step.main(["--smoke", "--variants", "off", "--out-dir", str(tmp_path)])
  (path,) = tmp_path.glob("profile_step_smoke_*.json")
  rep = json.loads(path.read_text())
  assert set(rep["variants"]) == {"off"} and rep["traced_steps"] >= 1
  assert rep["clocks"] == {"off": None}  # CPU: no GPU clocks to sample
  assert (tmp_path / "hlo_smoke_off.txt.gz").exists()
  assert (tmp_path / "trace_smoke_off.json.gz").exists()


def test_build_within_gives_up_a_build_that_does_not_return(monkeypatch):
  """`bench_train.build_within`: the build's result or its error, or BuildHung after the
  timeout (the hung build left on its daemon thread)."""
  import threading

  from benchmarks import bench_train
  release = threading.Event()

  def build(what):
    if what == "hang":
      release.wait(60)
    if what == "fail":
      raise MemoryError("out of memory")
    return what
  monkeypatch.setattr(bench_train, "build", build)
  try:
    assert bench_train.build_within(5, "ok") == "ok"
    assert bench_train.build_within(0, "ok") == "ok"  # 0: in this thread, waited for
    with pytest.raises(MemoryError, match="out of memory"):
      bench_train.build_within(5, "fail")
    with pytest.raises(bench_train.BuildHung, match="did not finish in 0 s"):
      bench_train.build_within(0.2, "hang")
  finally:
    release.set()


def test_bench_train_times_the_built_variants_after_a_hung_build(tmp_path, monkeypatch):
  """A variant whose build hung is recorded as such, no later variant is built, and the
  ones built before it are timed; a kernel-layer variant records whether its kernels ran
  (on CPU: XLA's collectives, and why)."""
  import json

  from benchmarks import bench_train
  real = bench_train.build_within

  def build_within(seconds, variant, *args):
    if variant.name == "on":
      raise bench_train.BuildHung("the build did not finish in 1 s")
    return real(seconds, variant, *args)
  monkeypatch.setattr(bench_train, "build_within", build_within)
  path = bench_train.main(["--smoke", "--layouts", "2,1,4", "--variants", "off_cm,on,ideal",
                           "--out-dir", str(tmp_path)])
  rep = json.loads(path.read_text())
  (built,) = rep["results"]
  assert built["variant"] == "off_cm" and built["step_ms"] > 0
  (why,) = built["kernel_fallbacks"]
  assert why.startswith("no GPU")
  errors = {f["variant"]: f["error"] for f in rep["failed"]}
  assert errors == {"on": "BuildHung: the build did not finish in 1 s",
                    "ideal": "skipped: the build of on hung"}
