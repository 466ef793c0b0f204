"""GPT-2 medium (~350M with a 50k vocab): 24 x 1024, 16 heads, context 1024."""
from taco_jax.configs.common import base_config


def get_config():
  c = base_config('gpt_350m')
  c.model.update(n_layers=24, d_model=1024, n_heads=16, d_ff=4096, max_seq_len=1024)
  c.data.update(seq_len=1024, batch_size=32)
  c.optim.update(lr=3e-4, warmup_steps=1000)
  c.train.update(steps=30_000, eval_every=1000, checkpoint_every=2000)
  # layers unrolled: on one H100 the scanned step ran out of memory (an allocation of 61 GiB
  # failed); unrolled it runs at MFU 0.397 with a 34 GiB peak, compiling in 22 s
  # (benchmarks/results/trainer_summary_350m_h100_b32_*)
  c.parallel.scan_layers = False
  # the MLP's GELU in its GEMMs' epilogues (models.gelu_mlp): on one H200 the trainer's step
  # ran at 238k and 236k tokens/s against 217k and 217k (MFU 0.510 against 0.465), peak 30.3
  # against 36.9 GB, compiling in 24 s against 26 (trainer_summary_350m_h200_b32_mlp_gelu_*)
  c.model.mlp_gelu = 'fused'
  return c
