"""Tiny GPT on a 2x2x2 (data, pipeline, tensor) mesh, FP8 compression of every family.

On CPU: `python -m taco_jax.train --config=configs/parallel_tiny.py --cpu_devices=8`.
"""
from taco_jax.configs.common import base_config, codec


def add_parallel_sections(c, *, dp, pp, tp, microbatches, compression=True):
  """The parallel and compression sections every parallel config shares."""
  c.parallel.update(dp=dp, pp=pp, tp=tp)
  c.parallel.microbatches = microbatches  # GPipe micro-batches per step (per data rank)
  c.parallel.distributed = False          # True: jax.distributed.initialize() (multi-host)
  c.model.block = 'gpt'                   # 'gpt' (models.gpt) | 'qwen' (models.qwen)
  c.model.n_kv_heads = c.model.n_heads    # KV heads (qwen block only)
  c.model.rope_theta = 10000.0            # rotary base (qwen block only)
  z = c.compression
  z.enabled = compression                 # one switch for all five families below
  z.tp_forward = codec(group_size=64)     # TP+SP all-gather / reduce-scatter of activations
  z.tp_backward = codec(group_size=64)    # their transposes (activation gradients)
  z.pp = codec(group_size=64)             # pipeline ppermute of activations, both directions
  z.dp = codec(group_size=64, enabled=False)  # data-parallel gradient all-reduce or, with
  #                                         parallel.shard_optimizer, reduce-scatter (off: fp32)
  z.dp_params = codec(group_size=64, enabled=False)  # shard_optimizer's parameter all-gather,
  #                                         as weight differences (off: the fp32 parameters)
  return c


def get_config():
  c = base_config('parallel_tiny')
  c.model.update(n_layers=4, d_model=64, n_heads=8, d_ff=256, max_seq_len=64, dtype='float32')
  c.data.update(seq_len=64, batch_size=16)
  c.optim.update(lr=2e-3, warmup_steps=20)
  c.train.update(steps=200, log_every=10, eval_every=100, eval_batches=4,
                 checkpoint_every=100)
  return add_parallel_sections(c, dp=2, pp=2, tp=2, microbatches=2)
