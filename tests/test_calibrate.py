"""`taco_jax.apps.calibrate`: capture at every compressed site, measure a grid, choose by the
stated rule, write a config with the choices (test_readme trains a written config)."""
import importlib.util
import json

import jax
import numpy as np
import pytest

from taco_jax.configs import parallel_tiny
from taco_jax import collectives, monitor
from taco_jax.apps import calibrate
from taco_jax.codec import CompressionConfig
from taco_jax.plan import FAMILIES, SITES, plan_from_config

FAST_COMPILE = {"xla_backend_optimization_level": 0}
B, T, D = 8, 32, 64  # global batch, sequence, width; mesh 2x2x2, 2 micro-batches


def _config(tmp_path):
  corpus = tmp_path / "corpus.txt"
  rng = np.random.default_rng(0)
  words = "the quick brown fox jumps over a lazy dog while tensors cross the wire".split()
  corpus.write_text(" ".join(rng.choice(words, 20000)))
  c = parallel_tiny.get_config()
  c.model.update(n_layers=2, d_model=D, n_heads=8, d_ff=128, max_seq_len=T)
  c.data.update(seq_len=T, batch_size=B, path=str(corpus))
  c.train.update(steps=2, log_every=1, eval_every=0, eval_batches=1, checkpoint_every=0,
                 progress_bar=False)
  c.optim.update(warmup_steps=1)
  c.compression.dp.enabled = True  # every family
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("calibrate")
  config = _config(tmp)
  settings = calibrate.grid(group_sizes=(32, 64))
  rep = calibrate.calibrate(config, steps=2, out=tmp / "calibrated_tiny.py", settings=settings,
                            config_path="configs/parallel_tiny.py",
                            compiler_options=FAST_COMPILE)
  return tmp, config, rep


def test_captures_every_site_with_its_shape(run):
  _, _, rep = run
  b, s = B // 2 // 2, T // 2  # per data rank and micro-batch; sequence shard
  want = {
      "gather_from_sp/fwd": [[b, s, D]],                   # block in-projections, head
      "gather_from_sp/bwd": [[b, T, D]],
      "reduce_scatter_to_sp/fwd": [[b, T, D], [2 * b, T, D]],  # blocks; embedding (whole batch)
      "reduce_scatter_to_sp/bwd": [[b, s, D], [2 * b, s, D]],
      "pp/fwd": [[b, s, D]], "pp/bwd": [[b, s, D]],
  }
  for site, shapes in want.items():
    assert rep["shapes"][site] == shapes, site
  (dp_shape,) = rep["shapes"]["dp"]
  assert dp_shape[1] == 2048  # the fused gradient buffer [rows, buckets.BUCKET]
  assert set(rep["shapes"]) == set(want) | {"dp"}
  assert {SITES[s] for s in rep["shapes"]} == set(FAMILIES) - {"dp_params"}  # no sharded
  #                                                                optimizer: nothing gathered


def test_choice_follows_the_rule(run):
  _, config, rep = run
  plan = plan_from_config(config.compression)
  for fam, choice in rep["choices"].items():
    base = choice["base_setting"]
    assert base == {k: getattr(getattr(plan, fam), k) for k in calibrate.SETTING_FIELDS}
    sites = [s for s in rep["results"] if SITES[s] == fam]
    scores, bits = {}, {}
    for r in rep["results"][sites[0]]:
      key = calibrate._key(r)
      mine = [next(x for x in rep["results"][s] if calibrate._key(x) == key) for s in sites]
      scores[key] = np.mean([x["rel_l2"] + x["share_off_by_8th"] for x in mine])
      bits[key] = np.mean([calibrate.bits_per_element(dict(zip(calibrate.SETTING_FIELDS, key)),
                                                      rep["shapes"][s][0][-1]) for s in sites])
    budget = bits[calibrate._key(base)]
    ok = {k: v for k, v in scores.items() if bits[k] <= budget}
    assert choice["score"] == pytest.approx(min(ok.values()))
    assert bits[calibrate._key(choice["setting"])] <= budget
    assert choice["score"] <= choice["base_score"]
  for site, rows in rep["results"].items():
    for r in rows:
      assert 0 < r["rel_l2"] < 0.2 and 0 < r["max_abs_over_absmax"] < 1, (site, r)


def test_capture_runs_xla_collectives_where_the_kernels_would_run(tmp_path):
  """A config whose TP collectives run inside the matmuls (kernel or ring layers) is
  captured through XLA's collectives, which report their messages, and says so; the
  config itself is left as it is."""
  config = _config(tmp_path)
  assert calibrate.capture_config(config) == (config, None)  # tp_overlap='none'
  for overlap in ("kernel", "ring"):
    config.parallel.tp_overlap = overlap
    captured, note = calibrate.capture_config(config)
    assert captured.parallel.tp_overlap == "none" and config.parallel.tp_overlap == overlap
    assert f"parallel.tp_overlap={overlap!r}" in note
    assert captured.compression.to_dict() == config.compression.to_dict()
  config.parallel.tp = 1
  assert calibrate.capture_config(config)[1] is None


def test_pick_prefers_fewer_bytes_then_the_configs_own():
  base = dict(format="e4m3", group_size=64, hadamard=True)
  scores = {("e4m3", 32, True): 0.01,   # best, but costs more bytes than the base
            ("e4m3", 64, True): 0.03, ("e4m3", 64, False): 0.02,
            ("e4m3", 128, True): 0.02}  # ties with 64/False at fewer bytes
  bits = lambda width: {k: calibrate.bits_per_element(  # noqa: E731
      dict(zip(calibrate.SETTING_FIELDS, k)), width) for k in scores}
  assert calibrate._pick(scores, bits(1024), base) == ("e4m3", 128, True)
  # on 64-wide messages a group of 128 is half padding: it costs more than the base
  assert calibrate._pick(scores, bits(64), base) == ("e4m3", 64, False)
  assert calibrate._pick({("e4m3", 64, False): 0.03, ("e4m3", 64, True): 0.03},
                         bits(1024), base) == ("e4m3", 64, True)


def test_wire_bits_count_the_padding():
  cfg = CompressionConfig(group_size=128)
  assert cfg.wire_bits(4096) == cfg.bits_per_element == 8.5
  assert cfg.wire_bits(64) == (128 * 8 + 64) / 64     # one group, half of it padding
  assert cfg.wire_bits(192) == 2 * (128 * 8 + 64) / 192


def test_written_config_carries_the_choices(run):
  """The config calibrate writes: the trained run's config with each family's and site's
  choice. (test_readme trains it; test_monitor checks the per-family error metrics.)"""
  tmp, config, rep = run
  spec = importlib.util.spec_from_file_location("calibrated", rep["out"])
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  assert c.name == "calibrated_tiny"  # its own name, so its own workdir
  assert c.to_dict() | {"compression": None, "name": None} == \
      config.to_dict() | {"compression": None, "name": None}
  assert c.compression.log_errors is False
  plan = plan_from_config(c.compression)
  for fam, choice in rep["choices"].items():
    assert {k: getattr(getattr(plan, fam), k) for k in calibrate.SETTING_FIELDS} == \
        choice["setting"]
    for site, own in choice["sites"].items():  # each collective runs its own choice
      assert {k: getattr(plan.codec(site), k) for k in calibrate.SETTING_FIELDS} == \
          own["setting"], site
  assert sorted(c.compression.sites) == rep["site_overrides"]
  assert json.loads((tmp / "calibrated_tiny.json").read_text())["choices"] == rep["choices"]


@pytest.mark.parametrize("base", ["taco_jax.configs.parallel_tiny", None])
def test_config_source_round_trips(tmp_path, base):
  """With an importable base: base + overrides + sections; without: a literal."""
  config = _config(tmp_path)
  section = dict(enabled=True, format="e5m2", group_size=128, hadamard=False,
                 dual_scale=True, min_bytes=0)
  src = calibrate.config_source(config, {"tp_backward": section}, base, "header")
  assert ("from taco_jax.configs.parallel_tiny import" in src) == (base is not None)
  namespace = {}
  exec(compile(src, "calibrated.py", "exec"), namespace)
  want = config.to_dict()
  want["compression"]["tp_backward"] = section
  assert namespace["get_config"]().to_dict() == want


def test_measure_all_against_numpy_and_the_hadamard_spread():
  """measure_all's figures equal a numpy computation on the same round trip; on rows with
  one large element per group, plain per-group FP8 keeps every element to FP8 precision,
  while the Hadamard transform spreads the large one's error over its small neighbours."""
  rng = np.random.default_rng(3)
  rows = rng.normal(size=(64, 128)).astype(np.float32) * np.exp(rng.normal(size=(64, 1)))
  rows[:, ::64] *= 300.0  # one outlier channel per group of 64
  cap = monitor.Capture()
  cap.add("gather_from_sp/fwd", rows)
  plain, spread = (dict(format="e4m3", group_size=64, hadamard=h) for h in (False, True))
  res = calibrate.measure_all(cap, [plain, spread])["gather_from_sp/fwd"]
  for r, s in zip(res, (plain, spread)):
    err = np.asarray(collectives.roundtrip(rows, CompressionConfig(**s))) - rows
    assert r["rel_l2"] == pytest.approx(np.linalg.norm(err) / np.linalg.norm(rows), rel=1e-4)
    assert r["max_abs"] == pytest.approx(np.abs(err).max(), rel=1e-5)
    assert r["share_off_by_8th"] == pytest.approx(np.mean(8 * np.abs(err) > np.abs(rows)))
  assert res[0]["share_off_by_8th"] < 0.01 < 0.2 < res[1]["share_off_by_8th"]


# --- the sharded optimizer's sites (benchmarks/measure_dp_codec.py) ---------------------------


def test_capture_continues_a_trained_run_with_the_sharded_optimizer(tmp_path):
  """calibrate.capture from a replicated run's checkpoint onto a sharded step that keeps a
  master: the Adam moments are the run's (not fresh ones, whose first updates are lr *
  sign(g)), the master starts as the parameters, and both data-parallel sites are captured."""
  from taco_jax.configs import tiny
  from taco_jax.tp import layout, mesh as mesh_lib
  from taco_jax.train import checkpoint, trainer
  from taco_jax.train.config import parallel_spec
  c = tiny.get_micro_config()
  c.model.update(n_layers=1, d_model=32, d_ff=64, max_seq_len=16)
  c.data.update(seq_len=16, batch_size=8)
  c.train.update(steps=2, eval_batches=1)
  trainer.train(c, tmp_path)
  c.parallel.update(dp=8, shard_optimizer=True)
  c.compression.update(enabled=True)
  c.compression.dp.enabled = c.compression.dp_params.enabled = True
  spec, mesh = parallel_spec(c), mesh_lib.make_mesh(8, 1, 1)
  tx = trainer.make_optimizer(c.optim, c.train.steps)
  p_abs = layout.abstract_params(spec.cfg, mesh)
  ckpt = checkpoint.Checkpoints(tmp_path)
  params, state = calibrate._restore(ckpt, 2, spec, tx, p_abs,
                                     trainer.opt_state_target(tx, p_abs, mesh, spec))
  _, stored = checkpoint.restore_state(ckpt, 2, spec.cfg, p_abs, trainer.opt_state_target(
      tx, p_abs, mesh_lib.make_mesh(1, 1, 1, jax.devices()[:1])))
  ckpt.close()
  for got, want in zip(jax.tree.leaves(state["tx"]), jax.tree.leaves(stored), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  counts = [int(x) for x in jax.tree.leaves(state["tx"]) if x.ndim == 0]
  assert counts and set(counts) == {2}  # the run's step counts: not a fresh state
  jax.tree.map(lambda m, p: np.testing.assert_array_equal(np.asarray(m), np.asarray(p)),
               state["master"], params)
  cap = calibrate.capture(c, 1, tmp_path, compiler_options=FAST_COMPILE)
  assert set(cap.tensors) == {"dp/scatter", "dp_params"} and len(cap.tensors["dp_params"]) == 8


def test_simulated_4bit_quantizers_by_hand():
  from benchmarks.measure_dp_codec import bits4, roundtrip4
  x = np.zeros((2, 40), np.float32)  # G = 32: one group and one 8-wide one, padded
  x[0, :6] = [7, 3.5, -1, 0.4, 2.6, -6.9]          # absmax 7: INT4's scale is 1
  x[1, :7] = [6, 0.3, 0.2, 2.6, 4.9, 5.1, -1.3]    # absmax 6: FP4's scale is 1
  x[0, 32:34] = [0.7, 0.3]                          # the padded group: scale 0.1
  x[1, 32:34] = [6e-3, 1.9e-3]                      # scale 1e-3
  q = lambda f, h=False: np.asarray(roundtrip4(x, dict(format=f, group_size=32, hadamard=h)))
  np.testing.assert_allclose(q("int4")[0, :6], [7, 4, -1, 0, 3, -7])  # 3.5: ties to even
  np.testing.assert_allclose(q("int4")[0, 32:34], [0.7, 0.3], rtol=1e-6)
  np.testing.assert_allclose(q("fp4")[1, :7], [6, 0.5, 0, 3, 4, 6, -1.5])
  np.testing.assert_allclose(q("fp4")[1, 32:34], [6e-3, 2e-3], rtol=1e-6)
  assert q("int4").shape == x.shape and not q("int4")[:, 34:].any()
  from pallas_kernels.common import hadamard_matrix
  row = 1e-2 * hadamard_matrix(32)[5]  # one coefficient after the transform: kept exactly,
  rows = np.stack([row, row + 1e-3])   # which the plain grid cannot do for 1e-2 +- 1e-3
  for f in ("int4", "fp4"):
    h = np.asarray(roundtrip4(rows, dict(format=f, group_size=32, hadamard=True)))
    np.testing.assert_allclose(h[0], row, atol=1e-8)
    assert np.abs(np.asarray(roundtrip4(rows, dict(format=f, group_size=32, hadamard=False)))
                  - rows)[1].max() > 1e-4
  assert bits4(dict(group_size=32), 32) == 5.0 and bits4(dict(group_size=128), 4096) == 4.25
  assert bits4(dict(group_size=32), 40) == 2 * (4 * 32 + 32) / 40


def test_measure_dp_codec_on_a_toy_capture():
  """The benchmark's measurement on a sharded step's sites as the run sends them: the
  weight differences of 4 ranks, 5 steps, delivered in shuffled order per step (as the
  devices' callbacks come), from updates with Adam-like momentum, sent with error feedback
  through the run's codec. measure() pairs the messages up by rank, recovers the updates,
  and replays them: with feedback the run's own codec lags the master exactly as the run's
  parameters did; without, the errors add up."""
  from benchmarks import measure_dp_codec as m
  from taco_jax.plan import CompressionPlan
  run = CompressionConfig(group_size=64)
  plan = CompressionPlan(dp=run, dp_params=run)
  dp, steps, rng = 4, 5, np.random.default_rng(0)
  cap, mom, r = monitor.Capture(), np.zeros((dp, 3, 256)), np.zeros((dp, 3, 256), np.float32)
  u, lag, scale = [], [], np.exp(rng.normal(size=(dp, 3, 1)))  # per row, as per tensor
  for t in range(steps):
    mom = 0.9 * mom + 0.1 * rng.normal(size=mom.shape) * scale
    u.append((1e-3 * mom).astype(np.float32))
    delta = u[-1] + r
    r = delta - np.asarray(collectives.roundtrip(delta, run))
    lag.append(np.linalg.norm(r) / np.linalg.norm(u[-1]))
    for d in rng.permutation(dp):
      cap.add("dp_params", delta[d])
  cap.add("dp/scatter", rng.normal(size=(16, 256)).astype(np.float32))
  out = m.measure(cap, plan, dp, fp8=[dict(format="e4m3", group_size=64, hadamard=False)],
                  four=m.grid4(group_sizes=(64,), hadamard=(False,)))
  seq, same, other = m.by_rank(cap.tensors["dp_params"], dp)
  assert same > 0.5 > 0.1 > other
  first = {tuple(seq[0, i, 0, :2]): i for i in range(dp)}  # which rank came first where
  order = [first[tuple(u[0][d, 0, :2])] for d in range(dp)]
  np.testing.assert_allclose(np.asarray(m.updates(seq, run))[:, order], np.stack(u),
                             atol=1e-9)
  fb = out["feedback"]
  assert fb["steps"] == steps and fb["pairing"]["lowest_same_rank"] == same
  own = next(f for f in fb["fp8"] if f["group_size"] == 64 and f["format"] == "e4m3")
  np.testing.assert_allclose(own["with_feedback"], lag, rtol=1e-4)
  assert own["without_feedback"][0] == pytest.approx(own["with_feedback"][0])
  assert own["without_feedback"][-1] > 1.5 * own["with_feedback"][-1]
  for f in fb["four_bit"]:  # 4 bits: ~8x FP8's rounding, still bounded with feedback
    assert 3 * own["with_feedback"][-1] < f["with_feedback"][-1] < f["without_feedback"][-1]
  assert set(out["choice"]) == {"dp", "dp_params"}
  for fam in ("dp", "dp_params"):
    (four,) = [r for r in out["families"][fam]["four_bit"] if r["format"] == "int4"]
    assert four["bits_per_element"] == 4.5
    assert four["rel_l2"] > 2 * out["families"][fam]["fp8"][0]["rel_l2"]


# --- the pipeline hand-offs (benchmarks/measure_dp_codec.py --families pp) -------------------


def test_token_axis_roundtrip_is_the_codec_on_the_transpose():
  """Groups along the token axis: each message's [tokens, hidden] transposed, through the
  codec, transposed back; on activations whose hidden units each hold one value over the
  tokens (plus a little noise), one group along the tokens has one scale and loses
  nothing but the noise's rounding, far less than groups across the hidden units."""
  from benchmarks import measure_dp_codec as m
  t, d, rng = 64, 32, np.random.default_rng(0)
  offset = np.exp(3 * rng.normal(size=(3, 1, d)))  # per hidden unit, over 3 orders
  msgs = (offset * (1 + 1e-3 * rng.normal(size=(3, t, d)))).astype(np.float32)
  x = msgs.reshape(-1, d)
  s = dict(format="e4m3", group_size=32, hadamard=False)
  got = np.asarray(m.roundtrip_tokens(x, dict(s, axis="tokens", tokens=t)))
  want = np.stack([np.asarray(collectives.roundtrip(msg.T.copy(), CompressionConfig(**s))).T
                   for msg in msgs]).reshape(-1, d)
  np.testing.assert_array_equal(got, want)
  err = lambda y: np.linalg.norm(y - x) / np.linalg.norm(x)  # noqa: E731
  hidden = np.asarray(collectives.roundtrip(x, CompressionConfig(**s)))
  assert err(got) < 0.5 * err(hidden)
  assert m.bits_tokens(dict(s, tokens=48), 4096) == (2 * 32 * 8 + 2 * 64) / 48  # padded
  with pytest.raises(ValueError, match="whole messages"):
    m.roundtrip_tokens(x[:-1], dict(s, axis="tokens", tokens=t))


def test_measure_dp_codec_families():
  """--families picks what is compressed, measured and named: dp by default (8,1,1, the
  sharded optimizer), pp alone on a pipeline mesh with a micro-batch per stage, the data-
  parallel codecs off; measure() keeps only the families' sites and adds, for pp, each
  site's tables and the token-axis groups."""
  from benchmarks import measure_dp_codec as m
  a = m.parse_args([])
  assert (a.families, a.mesh, a.label) == (("dp", "dp_params"), (8, 1, 1), "tiny")
  _, c = m.configs(a)
  assert c.parallel.shard_optimizer and c.compression.dp.enabled and not c.compression.pp.enabled
  a = m.parse_args(["--families", "pp"])
  assert (a.mesh, a.label) == ((1, 4, 1), "tiny_pp")
  _, c = m.configs(a)
  assert c.compression.pp.enabled and not (c.compression.dp.enabled or
                                           c.compression.dp_params.enabled)
  assert not c.parallel.shard_optimizer and c.parallel.microbatches == 4
  for bad in ("pp,dp", "tp_forward"):
    with pytest.raises(SystemExit):
      m.parse_args(["--families", bad])
  from taco_jax.plan import CompressionPlan
  rng, cap = np.random.default_rng(1), monitor.Capture(1 << 12)
  for _ in range(3):
    cap.add("pp/fwd", rng.normal(size=(2, 32, 64)).astype(np.float32))
    cap.add("pp/bwd", 1e-4 * rng.normal(size=(2, 32, 64)).astype(np.float32))
    cap.add("dp/scatter", rng.normal(size=(4, 64)).astype(np.float32))
  fp8 = [dict(format=f, group_size=32, hadamard=False) for f in ("e4m3", "e5m2")]
  out = m.measure(cap, CompressionPlan(pp=CompressionConfig(group_size=32)), 1, fp8=fp8,
                  four=m.grid4(group_sizes=(32,), hadamard=(False,)), families=("pp",))
  assert set(out["results_fp8"]) == set(out["sites"]) == {"pp/fwd", "pp/bwd"}
  assert set(out["choice"]) == {"pp"}
  for site, t in out["sites"].items():
    assert [r["format"] for r in t["fp8"]] == ["e4m3", "e5m2"]  # best first
    assert {r["axis"] for r in t["tokens"]} == {"tokens"} and t["tokens"][0]["tokens"] == 32
    assert t["tokens"][0]["bits_per_element"] == 10.0
