"""Config validation, compression switches, and the parallel trainer (train, resume on
another mesh, picked by the unified entry point) on 8 fake CPU devices."""
import json

import jax
import pytest

from taco_jax.configs import parallel_tiny
from taco_jax.codec import CompressionConfig
from taco_jax.tp import step as step_lib
from taco_jax.plan import CompressionPlan, plan_from_config
from taco_jax.tp.mesh import make_mesh
from taco_jax.train.config import parallel_spec, validate
from taco_jax.train.trainer import global_batch, load_data, train
from taco_jax.tp import layout as layout_lib
from taco_jax import data
from taco_jax.train import checkpoint, cli, metrics


def _config(cache_dir="", **parallel):
  c = parallel_tiny.get_config()
  c.model.update(n_layers=2, d_model=64, n_heads=8, d_ff=128, max_seq_len=32)
  c.data.update(seq_len=32, batch_size=8, max_corpus_bytes=2_000_000, cache_dir=cache_dir)
  c.train.update(steps=6, log_every=2, eval_every=0, eval_batches=1, checkpoint_every=0,
                 progress_bar=False)
  c.optim.update(lr=1e-2, warmup_steps=1)
  c.parallel.update(**parallel)
  return c


@pytest.mark.parametrize("change, messages", [
    (dict(parallel=dict(dp=2, pp=2, tp=4)), ["dp*pp*tp = 2*2*4 = 16 but there are 8 devices"]),
    (dict(parallel=dict(dp=1, pp=1, tp=8), model=dict(n_heads=4, d_ff=100)),
     ["model.n_heads=4", "model.d_ff=100"]),
    (dict(parallel=dict(dp=1, pp=8, tp=1)), ["model.n_layers=2 is not divisible by "
                                             "parallel.pp=8"]),
    (dict(parallel=dict(dp=4, pp=1, tp=2, microbatches=4)),
     ["data.batch_size=8 is not divisible by parallel.dp * parallel.microbatches = 4*4"]),
    (dict(parallel=dict(dp=2, pp=2, tp=2, microbatches=2, interleave=4)),
     ["data.batch_size=8 is not divisible by parallel.dp * parallel.microbatches * "
      "parallel.interleave = 2*2*4 = 16 (each micro-batch splits into 4 sub-batches)"]),
    (dict(parallel=dict(interleave=0)), ["parallel.interleave=0 must be a positive integer"]),
    (dict(parallel=dict(collectives_in_flight=0)),
     ["parallel.collectives_in_flight=0 must be an integer >= 1"]),
    (dict(parallel=dict(save_tp_outputs=True)), ["parallel.save_tp_outputs=True keeps what "
                                                 "model.remat would recompute"]),
    (dict(parallel=dict(save_dots=True)), ["parallel.save_dots=True keeps what model.remat "
                                           "would recompute"]),
    (dict(parallel=dict(save_attention=True)), ["parallel.save_attention=True keeps what "
                                                "model.remat would recompute"]),
    (dict(parallel=dict(dp=1, pp=1, tp=8), data=dict(seq_len=36), model=dict(vocab_size=260,
                                                                             max_seq_len=36)),
     ["data.seq_len=36", "model.vocab_size=260"]),
    (dict(model=dict(block="llama")), ["model.block='llama' is unknown"]),
    (dict(compression=dict(tp_forward=dict(group_size=48))), ["compression.tp_forward",
                                                             "group_size"]),
    (dict(compression=dict(dp_params=dict(enabled=True))),
     ["compression.dp_params compresses the sharded optimizer's parameter all-gather: set "
      "parallel.shard_optimizer=True"]),
])
def test_validation_names_the_fields(change, messages):
  c = _config()
  for sec, fields in change.items():
    for k, v in fields.items():
      if isinstance(v, dict):
        c[sec][k].update(v)
      else:
        c[sec][k] = v
  with pytest.raises(ValueError) as e:
    validate(c, n_devices=8)
  for m in messages:
    assert m in str(e.value)


def test_compression_plan_from_config():
  c = _config()
  assert plan_from_config(c.compression) == CompressionPlan(
      tp_forward=CompressionConfig(group_size=64), tp_backward=CompressionConfig(group_size=64),
      pp=CompressionConfig(group_size=64), dp=None)
  c.compression.enabled = False
  assert plan_from_config(c.compression) == CompressionPlan()
  c.compression.enabled = True
  c.compression.tp_backward = None
  assert plan_from_config(c.compression).tp_backward is None


def test_disabled_compression_lowers_to_the_plain_program():
  """enabled=False with every family section set == no compression section at all: the
  same program, op for op (source locations left out: a persistent compilation cache may
  hand either the other's executable, whose text carries the other's)."""
  c = _config(dp=1, pp=2, tp=4, microbatches=2)
  c.compression.enabled = False
  mesh = make_mesh(1, 2, 4)
  plain = step_lib.ParallelSpec(parallel_spec(c).cfg, 1, 2, 4, 2)
  params = layout_lib.abstract_params(plain.cfg, mesh)
  tokens = jax.ShapeDtypeStruct((8, 33), jax.numpy.int32, sharding=step_lib.batch_sharding(mesh))
  texts = [jax.jit(step_lib.loss_and_grads_fn(s, mesh)).lower(params, tokens).as_text(
      debug_info=False) for s in (parallel_spec(c), plain)]
  assert texts[0] == texts[1]


def test_train_lowers_loss_and_resumes_on_another_mesh(tmp_path, tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("corpus"))
  # Train with every TP/PP family compressed on (dp, pp, tp) = (2, 1, 4).
  s = train(_config(cache, dp=2, pp=1, tp=4, microbatches=2), tmp_path)
  assert s["status"] == "completed" and s["last_checkpoint"] == 6
  assert s["attention"] == "xla"  # model.attention=auto on CPU
  sent = s["compressed_messages"]  # off GPU, link "auto" compresses every message
  assert sent["all_gather"]["compressed"] > 0 and sent["reduce_scatter"]["compressed"] > 0
  assert not any(row["plain"] for row in sent.values()), sent
  losses = [r["loss"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
  assert len(losses) == 6 and max(losses[-2:]) < min(losses[:2])
  # The same run again: nothing to train, and it says so; with compression off: refused.
  again = train(_config(cache, dp=2, pp=1, tp=4, microbatches=2), tmp_path)
  assert again["status"] == "already_done" and again["step"] == 6
  assert again["val_loss"] == s["val_loss"]  # its summary, kept
  off = _config(cache, dp=2, pp=1, tp=4, microbatches=2)
  off.compression.enabled = False
  with pytest.raises(ValueError, match=r"different compression settings \(compression.enabled "
                     r"True -> False\); give this run its own --workdir"):
    train(off, tmp_path)
  # The step-6 checkpoint restored on the same mesh and on (2, 2, 2), uncompressed: both
  # evaluate the same validation batch and must agree to fp32 rounding.
  val = []
  for layout in (dict(dp=2, pp=1, tp=4), dict(dp=2, pp=2, tp=2)):
    c = _config(cache, microbatches=2, **layout)
    c.compression.enabled = False
    mesh, spec = make_mesh(**layout), parallel_spec(c)
    ckpt = checkpoint.Checkpoints(tmp_path)
    params, _, _ = ckpt.restore(6, layout_lib.abstract_params(spec.cfg, mesh))
    ckpt.close()
    batch = data.batch_at(load_data(c).val, 0, seed=c.seed, stream=1,
                          batch_size=c.data.batch_size, seq_len=c.data.seq_len)
    val.append(float(jax.jit(step_lib.make_eval_step(spec, mesh))(
        params, global_batch(batch, mesh))))
  assert val[0] == pytest.approx(val[1], rel=1e-5)
  assert json.loads((tmp_path / "summary.json").read_text())["mesh"]["tensor"] == 4


def test_tp_exchange_reaches_the_attention_out_projection_only():
  """`parallel.tp_exchange` goes from the config to the layers, where only a row-parallel
  layer whose local input is narrower than its output (the attention's) exchanges it."""
  from flax import nnx
  from taco_jax.models.gpt import Block
  from taco_jax.tp.layers import TensorParallelFactory
  c = _config(dp=2, pp=2, tp=2, tp_exchange=True)
  ctx = parallel_spec(c).ctx
  assert ctx.exchange and not parallel_spec(_config(dp=2, pp=2, tp=2)).ctx.exchange
  block = Block(parallel_spec(c).cfg, rngs=nnx.Rngs(0), linear=TensorParallelFactory(ctx))
  assert block.attn_out.exchanges and not block.mlp_out.exchanges


@pytest.mark.slow  # covered: test_parallel_step's remat-policy tests, test_train's meshes
def test_entry_point_runs_remat_policies_on_a_mesh(tmp_path, tmp_path_factory):
  c = _config(str(tmp_path_factory.mktemp("corpus")), dp=2, pp=2, tp=2, microbatches=2,
              save_tp_outputs=True, save_dots=True)
  c.model.remat = True
  c.compression.enabled = False
  c.train.steps = 2
  assert parallel_spec(c).save_tp_outputs and parallel_spec(c).save_dots
  s = cli.train(c, tmp_path)  # what `python -m taco_jax.train` calls
  assert s["status"] == "completed" and s["step"] == 2
  assert s["mesh"] == {"data": 2, "pipeline": 2, "tensor": 2}


def test_compression_site_overrides_from_config():
  c = _config()
  c.compression.sites = dict(gather_from_sp_fwd=dict(group_size=32, format="e5m2"),
                             pp_bwd=None)
  plan = plan_from_config(c.compression)
  assert plan.codec("gather_from_sp/fwd") == CompressionConfig(group_size=32, format="e5m2")
  assert plan.codec("gather_from_sp/bwd") == plan.tp_backward == CompressionConfig(group_size=64)
  assert plan.codec("pp/bwd") is None and plan.codec("pp/fwd") == plan.pp
  assert plan.codec("dp") is None and not plan.compresses("dp") and plan.compresses("pp")
  c.compression.sites = dict(gather_from_sp=dict(group_size=32))
  with pytest.raises(ValueError, match="unknown site.*gather_from_sp'"):
    plan_from_config(c.compression)
  c.compression.sites = dict(dp=dict(group_size=48))
  with pytest.raises(ValueError, match="compression.sites.dp"):
    plan_from_config(c.compression)
  with pytest.raises(ValueError, match="unknown site"):
    CompressionPlan(sites=(("tp/fwd", None),))
