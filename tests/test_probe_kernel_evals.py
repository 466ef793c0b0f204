"""benchmarks/probe_kernel_evals.py: its summary of the ways of evaluating (and a slow
smoke run on CPU, where the kernels fall back to XLA's collectives)."""
import json

import pytest

from benchmarks import probe_kernel_evals as probe


def _evaluation(step, **losses):
  return dict(step=step, train_loss=1.0, **{w: losses.get(w, [1.0, 2.0]) for w in probe.WAYS})


def test_summary_counts_nan_evaluations_per_way_and_calls_that_differ():
  evals = [_evaluation(4),
           _evaluation(8, back_to_back=[None, 2.0], again=[1.0, 2.0]),
           _evaluation(12, back_to_back=[1.0, None], again=[1.0, None], one_by_one=[None, 2.0])]
  s = probe.summarize(evals)
  assert s["back_to_back"] == dict(evaluations_with_nan=2, of=3, batches_with_nan=[0, 1])
  assert s["again"] == dict(evaluations_with_nan=1, of=3, batches_with_nan=[1])
  assert s["one_by_one"]["batches_with_nan"] == [0]
  assert s["collectives"]["evaluations_with_nan"] == 0
  assert s["calls_that_differ"] == [8]
  assert probe.finite_or_none([1.5, float("nan"), float("inf")]) == [1.5, None, None]


def test_summary_counts_a_way_only_in_the_evaluations_it_ran_in():
  first, second = probe.BEHIND_STEP
  evals = [_evaluation(4, **{first: [None, 2.0]}), _evaluation(8), _evaluation(12)]
  del evals[0][second], evals[1][first], evals[2][first]
  s = probe.summarize(evals)
  assert s[first] == dict(evaluations_with_nan=1, of=1, batches_with_nan=[0])
  assert s[second] == dict(evaluations_with_nan=0, of=2, batches_with_nan=[])


def test_scratch_summary_counts_the_makers_of_the_kernels_scratch():
  text = "\n".join([
      "  %zero = u32[8]{0} broadcast(u32[] %c0), dimensions={}",
      '  %k1 = (bf16[4]{0}, u32[8]{0}) custom-call(bf16[4]{0} %x, u32[8]{0} %zero), '
      'custom_call_target="mosaic_gpu_v2"',
      '  %k2 = (bf16[4]{0}, u32[8]{0}) custom-call(bf16[4]{0} %x, u32[8]{0} %zero), '
      'custom_call_target="mosaic_gpu_v2"'])
  assert probe.scratch_summary(text) == dict(kernels=2, producers={"broadcast": 2},
                                             most_readers=2, reader_ops=["custom-call"])
  assert probe.scratch_summary("") == dict(kernels=0, producers={}, most_readers=0,
                                           reader_ops=[])


def test_graphs_are_the_compiler_options_kernel_graphs():
  from taco_jax.tp import step as step_lib
  assert probe.GRAPHS == tuple(step_lib.KERNEL_GRAPHS)
  with pytest.raises(SystemExit):
    probe.parse_args(["--graphs", "some"])


@pytest.mark.slow
def test_probe_kernel_evals_smoke(tmp_path):
  path = probe.main(["--smoke", "--out-dir", str(tmp_path)])
  report = json.loads(path.read_text())
  assert [e["step"] for e in report["evaluations"]] == [2, 4]
  assert [probe.BEHIND_STEP[0] in e for e in report["evaluations"]] == [True, False]
  assert report["summary"]["behind_other"]["of"] == 2
  assert report["summary"]["collectives"]["evaluations_with_nan"] == 0
  assert report["kernel_fallbacks"]  # on CPU the kernel layers take XLA's collectives
  assert report["kernel_scratch"]["evaluate"]["kernels"] == 0


def test_step_check_flags_the_run_fed_differently():
  """`step_check` compares every run with the first one-by-one run: runs fed the same
  batches agree bit for bit; one whose batches changed (here the second trainer-order run,
  the batch function's 10th to 12th calls) is flagged from its first step on."""
  import jax.numpy as jnp
  calls = []

  def batch(i):
    calls.append(i)
    return jnp.full((2,), float(i) + (0.5 if 10 <= len(calls) <= 12 else 0.0))

  def train(params, opt_state, b):
    params = params * 0.5 + b
    return params, opt_state, {"loss": params.sum()}

  got = probe.step_check(train, lambda: (jnp.zeros((2,)), None), batch, steps=3)["runs"]
  assert set(got) == {f"{w}_{k}" for w in probe.STEP_WAYS for k in range(2)}
  for name, r in got.items():
    bad = name == "trainer_order_1"
    assert r["losses_equal"] is not bad and r["params_equal"] is not bad
    assert r["first_step_that_differs"] == (1 if bad else None)
    assert r["nonfinite_losses"] == 0


def test_an_unknown_way_is_refused_before_anything_compiles(capsys):
  with pytest.raises(SystemExit):
    probe.parse_args(["--ways", "trainer_order,nope"])
  assert "unknown nope" in capsys.readouterr().err
  assert probe.parse_args(["--ways", "trainer_order"]).ways == "trainer_order"
