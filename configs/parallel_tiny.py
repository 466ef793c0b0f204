"""Tiny GPT on a 2x2x2 (data, pipeline, tensor) mesh, FP8 compression of every family.

On CPU: `python -m taco_jax.train --config=configs/parallel_tiny.py --cpu_devices=8`.
"""
import ml_collections

from taco_jax.configs.common import base_config


def codec(**kw) -> ml_collections.ConfigDict:
  """A codec section (taco_jax.codec.CompressionConfig fields) plus an on/off switch."""
  c = ml_collections.ConfigDict()
  c.enabled = True         # False: this collective family sends plain values
  c.format = 'e4m3'        # e4m3 (max 448) | e5m2 (max 57344)
  c.group_size = 64        # elements per scale group along the last (hidden) axis
  c.hadamard = False       # Walsh-Hadamard transform of each group before quantizing (off:
  #                          measured to cost accuracy; see taco_jax.codec.CompressionConfig)
  c.dual_scale = True      # RMS pre-scale before the transform
  c.min_bytes = 0          # smaller messages (per device) go uncompressed
  c.link = ml_collections.FieldReference('auto', field_type=str)  # compress only the sizes
  #                          measured to pay on this link: 'auto' (on GPU 'p2p_disabled' if
  #                          NCCL_P2P_DISABLE=1 else 'nvlink'; none off GPU) | 'nvlink' |
  #                          'p2p_disabled' | None (every message from min_bytes on)
  c.update(kw)
  return c


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
  z.tp_forward = codec()                  # TP+SP all-gather / reduce-scatter of activations
  z.tp_backward = codec()                 # their transposes (activation gradients)
  z.pp = codec()                          # pipeline ppermute of activations, both directions
  z.dp = codec(enabled=False)             # data-parallel gradient all-reduce or, with
  #                                         parallel.shard_optimizer, reduce-scatter (off: fp32)
  z.dp_params = codec(enabled=False)      # shard_optimizer's parameter all-gather, as weight
  #                                         differences (off: the fp32 parameters)
  return c


def get_config():
  c = base_config('parallel_tiny')
  c.model.update(n_layers=4, d_model=64, n_heads=8, d_ff=256, max_seq_len=64, dtype='float32')
  c.data.update(seq_len=64, batch_size=16)
  c.optim.update(lr=2e-3, warmup_steps=20)
  c.train.update(steps=200, log_every=10, eval_every=100, eval_batches=4,
                 checkpoint_every=100)
  return add_parallel_sections(c, dp=2, pp=2, tp=2, microbatches=2)
