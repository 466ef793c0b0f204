"""GPT-2 small (12 x 768, 12 heads, context 1024; ~86M with the byte vocab) on 4 GPUs,
tensor-parallel 4, FP8 (TACO) compression of the TP activations and their gradients: the
model of the accuracy benchmark (`benchmarks/bench_accuracy.py`).

  python -m taco_jax.train --config=configs/gpt_125m_tp4.py
Off: --config.compression.enabled=False. On CPU (slow): --cpu_devices=4.
"""
from taco_jax.configs.common import base_config
from taco_jax.configs.parallel_tiny import add_parallel_sections


def get_config():
  c = base_config('gpt_125m_tp4')
  c.model.update(n_layers=12, d_model=768, n_heads=12, d_ff=3072, max_seq_len=1024)
  c.data.update(seq_len=1024, batch_size=16)
  c.optim.update(lr=6e-4, warmup_steps=200)
  c.train.update(steps=2000, eval_every=250, eval_batches=16, checkpoint_every=1000,
                 peak_flops=989e12)
  add_parallel_sections(c, dp=1, pp=1, tp=4, microbatches=1)
  for family in ('tp_forward', 'tp_backward', 'pp'):
    c.compression[family].group_size = 128
  return c
