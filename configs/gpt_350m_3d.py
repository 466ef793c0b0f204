"""GPT-2 medium (~350M) on 8 devices as (data, pipeline, tensor) = (2, 2, 2), 8 micro-batches
(GPipe bubble (pp-1)/(m+pp-1) = 1/9), FP8 compression of TP and pipeline activations.

  python -m taco_jax.train --config=configs/gpt_350m_3d.py
"""
from taco_jax.configs.common import base_config
from taco_jax.configs.parallel_tiny import add_parallel_sections


def get_config():
  c = base_config('gpt_350m_3d')
  c.model.update(n_layers=24, d_model=1024, n_heads=16, d_ff=4096, max_seq_len=1024)
  c.data.update(seq_len=1024, batch_size=32)
  c.optim.update(lr=3e-4, warmup_steps=1000)
  c.train.update(steps=30_000, eval_every=1000, checkpoint_every=2000)
  add_parallel_sections(c, dp=2, pp=2, tp=2, microbatches=8)
  for family in ('tp_forward', 'tp_backward', 'pp'):
    c.compression[family].group_size = 128
  return c
