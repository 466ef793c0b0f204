"""GPT-3 XL / GPT-2 XL-like (~1.3B): 24 x 2048, 16 heads, context 2048, remat on."""
from taco_jax.configs.common import base_config


def get_config():
  c = base_config('gpt_1_3b')
  c.model.update(n_layers=24, d_model=2048, n_heads=16, d_ff=8192, max_seq_len=2048, remat=True)
  c.data.update(seq_len=2048, batch_size=16)
  c.optim.update(lr=2e-4, warmup_steps=2000)
  c.train.update(steps=50_000, eval_every=2000, checkpoint_every=2000)
  return c
