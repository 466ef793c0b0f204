"""link="auto" decided by measurement: `link_probe.choose` from given times, the plan it
writes, the trainer's cache of the times, the probe itself on fake CPU devices, and the
trainer's summary."""
import json
import types

import pytest

from taco_jax import collectives, link_probe, policy
from taco_jax.codec import CompressionConfig
from taco_jax.configs import parallel_tiny
from taco_jax.link_probe import Message, Timing, choose
from taco_jax.plan import CompressionPlan
from taco_jax.tp.mesh import FAMILY_AXES, make_mesh
from taco_jax.train import link_policy
from taco_jax.train.trainer import train

KIB, MIB = 1 << 10, 1 << 20
CODEC = CompressionConfig(group_size=64)


def msg(family, collective, nbytes, count=1, axis_size=4):
  return Message(family, collective, "tensor", axis_size, (nbytes // 2,), "bfloat16", CODEC,
                 count)


def timing(family, collective, nbytes, plain_ms, compressed_ms, count=1):
  return Timing(msg(family, collective, nbytes, count), plain_ms / 1e3, compressed_ms / 1e3)


def test_choose_per_family_from_given_times():
  pol = choose([
      timing("tp_forward", "all_gather", MIB, 2.0, 1.0, count=3),  # compressed wins
      timing("tp_forward", "reduce_scatter", MIB, 2.0, 1.5),
      timing("tp_backward", "all_gather", MIB, 1.0, 1.2),          # loses
      timing("dp", "all_reduce", 64 * KIB, 0.1, 0.3),              # wins from 4 MiB on
      timing("dp", "all_reduce", MIB, 0.5, 0.4),
      timing("dp", "all_reduce", 4 * MIB, 1.0, 1.1),
      timing("dp", "all_reduce", 16 * MIB, 4.0, 2.0),
      timing("pp", "ppermute", MIB, 1.0, 0.5),                     # mixed in one family
      timing("pp", "all_gather", MIB, 1.0, 2.0)])
  fams = pol.families
  assert list(fams) == ["tp_forward", "tp_backward", "pp", "dp"]  # no dp_params: no times
  tp = fams["tp_forward"]
  assert (tp["plain_ms"], tp["compressed_ms"], tp["chosen_ms"]) == pytest.approx((8, 4.5, 4.5))
  assert tp["decision"] == "compress"
  assert tp["min_bytes"] == {"all_gather": MIB, "reduce_scatter": MIB}
  assert fams["tp_backward"]["decision"] == "plain"
  assert fams["tp_backward"]["min_bytes"] == {"all_gather": None}
  assert fams["tp_backward"]["chosen_ms"] == fams["tp_backward"]["plain_ms"] == 1.0
  assert fams["dp"]["min_bytes"] == {"all_reduce": 16 * MIB}  # won at every larger size
  assert fams["dp"]["decision"] == "compress from 16 MiB"
  assert fams["dp"]["chosen_ms"] == pytest.approx(0.1 + 0.5 + 1.0 + 2.0)
  assert fams["pp"]["decision"] == "all_gather plain, ppermute compress"
  assert pol.threshold("dp", "all_reduce") == (True, 16 * MIB)
  assert pol.threshold("dp", "reduce_scatter") == (False, None)
  assert pol.lines()[1] == "tp_backward: plain 1.000 ms, compressed 1.200 ms -> plain"
  assert choose([]).families == {}


def test_apply_rewrites_only_the_probed_auto_sites_and_changes_tells_what_moves():
  plan = CompressionPlan(tp_forward=CODEC, tp_backward=CompressionConfig(min_bytes=2 * MIB),
                         dp=CompressionConfig(link="nvlink"))
  pol = choose([timing("tp_forward", "all_gather", MIB, 2.0, 1.0),
                timing("tp_backward", "reduce_scatter", MIB, 2.0, 1.0),
                timing("tp_backward", "all_gather", MIB, 1.0, 2.0),
                timing("dp", "all_reduce", MIB, 2.0, 1.0)])
  new = link_probe.apply(plan, pol)
  assert new.codec("gather_from_sp/fwd") == CompressionConfig(group_size=64, link=None,
                                                              min_bytes=MIB)
  assert new.codec("reduce_scatter_to_sp/fwd") == CODEC  # not probed: the tables decide
  assert new.codec("gather_from_sp/bwd").min_bytes == 2 * MIB  # the configured one is larger
  assert new.codec("reduce_scatter_to_sp/bwd").min_bytes == policy.NEVER  # never won
  assert new.codec("dp") == plan.dp  # link="nvlink": what the user asked for
  assert new.codec("pp/fwd") is None  # the config does not compress it: stays off
  record = lambda site, coll, nbytes, sent, codec=CODEC: collectives.Decision(
      coll, nbytes, sent, site, 4, (nbytes // 2,), "bfloat16", codec)
  same = [record("gather_from_sp/fwd", "all_gather", MIB, True),
          record("reduce_scatter_to_sp/fwd", "reduce_scatter", KIB, True)]
  assert not link_probe.changes(same, new)
  assert link_probe.changes([record("reduce_scatter_to_sp/bwd", "all_gather", MIB, True)],
                            new)


def test_messages_are_the_probed_sites_counted_once():
  d = lambda site, coll, **kw: collectives.Decision(
      **{**dict(collective=coll, nbytes=256, compressed=True, site=site, axis_size=4,
                shape=(128,), dtype="bfloat16", codec=CODEC), **kw})
  decisions = [d("gather_from_sp/fwd", "all_gather"), d("gather_from_sp/fwd", "all_gather"),
               d("gather_from_sp/bwd", "reduce_scatter"),
               d("pp/fwd", "ppermute", axis_size=1),        # nothing sent
               d("", "all_gather"),                         # no site: not the plan's
               d("dp", "all_reduce", kernel=True),          # a fused kernel's
               d("dp", "all_reduce", codec=CompressionConfig(link=None)),  # not "auto"
               d("dp", "all_reduce", codec=None)]
  axes = dict(FAMILY_AXES)
  got = link_probe.messages(decisions, axes)
  assert [(m.family, m.collective, m.axis, m.count) for m in got] == [
      ("tp_forward", "all_gather", "tensor", 2), ("tp_backward", "reduce_scatter", "tensor", 1)]
  assert link_probe.messages(decisions, axes, ("pp", "dp")) == []


@pytest.fixture
def probe_calls(monkeypatch):
  """link_policy.resolve probes (as on GPU) with given times; the calls are counted."""
  calls = []

  def fake(mesh, msgs):
    calls.append(len(msgs))
    return [Timing(m, 2e-3, 1e-3 if m.family == "tp_forward" else 3e-3) for m in msgs]

  monkeypatch.setattr(link_policy, "skip_reason", lambda config, msgs: None)
  monkeypatch.setattr(link_probe, "probe", fake)
  return calls


def _resolve(tmp_path, shape=(128,)):
  config = parallel_tiny.get_config()
  plan = CompressionPlan(tp_forward=CODEC, tp_backward=CODEC)
  spec = types.SimpleNamespace(tp_overlap="none", plan=plan)
  decisions = [collectives.Decision(c, 256, True, site, 4, shape, "bfloat16", CODEC)
               for site, c in (("gather_from_sp/fwd", "all_gather"),
                               ("gather_from_sp/bwd", "reduce_scatter"))]
  return link_policy.resolve(config, spec, make_mesh(2, 1, 4), decisions, tmp_path)


def test_cache_hit_key_mismatch_and_corrupt_file(tmp_path, probe_calls):
  first = _resolve(tmp_path)
  assert first.summary["source"] == "probe" and probe_calls == [2]
  assert first.summary["families"]["tp_backward"]["decision"] == "plain"
  assert first.plan.codec("gather_from_sp/bwd").min_bytes == policy.NEVER
  again = _resolve(tmp_path)  # the same machine, mesh and messages: the cached times
  assert again.summary["source"] == "cache" and probe_calls == [2]
  assert again.plan == first.plan
  other = _resolve(tmp_path, shape=(256,))  # another step's messages: probed again
  assert other.summary["source"] == "probe" and probe_calls == [2, 2]
  assert any("probing again" in line for line in other.lines)
  (tmp_path / link_policy.FILE).write_text("{not json")
  broken = _resolve(tmp_path)
  assert broken.summary["source"] == "probe" and probe_calls == [2, 2, 2]
  assert broken.lines[0].startswith(f"ignoring {tmp_path / link_policy.FILE}, not a link ")
  assert json.loads((tmp_path / link_policy.FILE).read_text())["key"]["mesh"] == {
      "data": 2, "pipeline": 1, "tensor": 4}


def test_a_failing_probe_leaves_the_tables(tmp_path, probe_calls, monkeypatch):
  def fail(mesh, msgs):
    raise RuntimeError("out of memory")

  monkeypatch.setattr(link_probe, "probe", fail)
  got = _resolve(tmp_path)
  assert got.summary == dict(source="tables", why="the probe failed (RuntimeError: out of "
                             "memory)")
  assert got.plan == CompressionPlan(tp_forward=CODEC, tp_backward=CODEC)
  assert got.lines == ["link policy: compression.*.link decides (the measured tables), not "
                       "probed: the probe failed (RuntimeError: out of memory)"]


def test_off_gpu_the_tables_decide_and_say_why(tmp_path):
  got = _resolve(tmp_path)
  assert got.summary == dict(source="tables", why="not on GPU (cpu): times of its "
                             "collectives would not predict a GPU's")
  assert len(got.lines) == 1 and not (tmp_path / link_policy.FILE).exists()
  c = parallel_tiny.get_config()
  c.compression.link_probe = False
  assert link_policy.skip_reason(c, ["a message"], "gpu") == "compression.link_probe=False"


def test_probe_runs_on_fake_cpu_devices():
  mesh = make_mesh(2, 1, 4)
  msgs = [Message("tp_forward", "all_gather", "tensor", 4, (2, 8, 64), "bfloat16", CODEC),
          Message("dp", "reduce_scatter", "data", 2, (4, 64), "float32", CODEC),
          Message("dp", "all_reduce", "data", 2, (4, 64), "float32", CODEC),
          Message("pp", "ppermute", "tensor", 4, (2, 64), "float32", CODEC)]
  got = link_probe.probe(mesh, msgs, reps=2)
  assert [t.message for t in got] == msgs
  assert all(t.plain_s > 0 and t.compressed_s > 0 for t in got)


def test_trainer_applies_the_probed_policy_and_writes_it(tmp_path, tmp_path_factory,
                                                         probe_calls, capsys):
  """Probed (given times): tp_forward compresses, tp_backward's messages go plain, and the
  run says which went plain; the step is traced again under that policy, which
  summary.json and link_policy.json record."""
  c = parallel_tiny.get_config()
  c.model.update(n_layers=2, d_model=64, n_heads=8, d_ff=128, max_seq_len=32)
  c.data.update(seq_len=32, batch_size=8, max_corpus_bytes=2_000_000,
                cache_dir=str(tmp_path_factory.mktemp("corpus")))
  c.train.update(steps=1, log_every=1, eval_every=0, eval_batches=1, checkpoint_every=0,
                 progress_bar=False)
  c.parallel.update(dp=4, pp=1, tp=2, microbatches=1)
  s = train(c, tmp_path)
  got = s["link_policy"]
  assert got["source"] == "probe" and probe_calls and got["tables_for"] == []
  assert {f: r["decision"] for f, r in got["families"].items()} == {
      "tp_forward": "compress", "tp_backward": "plain"}
  sent = s["compressed_messages"]  # tp_forward's all-gathers and reduce-scatters compressed,
  for coll in ("all_gather", "reduce_scatter"):  # tp_backward's plain
    assert sent[coll]["compressed"] > 0 and sent[coll]["plain"] > 0, sent
  assert "sent plain, below the size from which compression pays" in capsys.readouterr().out
  stored = json.loads((tmp_path / "summary.json").read_text())["link_policy"]
  assert stored["families"] == got["families"]
  assert (tmp_path / link_policy.FILE).exists()
