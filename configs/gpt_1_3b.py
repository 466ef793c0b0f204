"""GPT-3 XL / GPT-2 XL-like (~1.3B): 24 x 2048, 16 heads, context 2048, remat on (keeping
the matmul outputs and the attention's), the loss head's softmax kept, layers unrolled, the
MLP's GELU in its GEMMs (Hopper GPUs; XLA's elsewhere); at tp > 1 the TP collectives inside
the matmuls (fused collective-matmul kernels; XLA's collectives where they cannot run)."""
from taco_jax.configs.common import base_config


def get_config():
  c = base_config('gpt_1_3b')
  c.model.update(n_layers=24, d_model=2048, n_heads=16, d_ff=8192, max_seq_len=2048, remat=True)
  c.data.update(seq_len=2048, batch_size=16)
  c.optim.update(lr=2e-4, warmup_steps=2000)
  c.train.update(steps=50_000, eval_every=2000, checkpoint_every=2000)
  # keep the blocks' matmul outputs through remat and unroll the layers: the trainer's own
  # step on one H200 (batch 8) went from MFU 0.455 to 0.491 (save_dots) and 0.521 (both),
  # compiling in 18 s instead of 9 (benchmarks/results/trainer_summary_1.3b_*_1gpu_*.json)
  # keeping the attention's inputs and cuDNN's outputs too: the trainer's step at batch 8 on
  # one H200 went from MFU 0.542 to 0.563 (trainer_summary_1.3b_h200_b8_save_attention_*)
  # and the loss head's softmax: 269.50 ms a bench_train step (vocab 50304) against 274.28,
  # no higher peak (bench_train_head_1gpu_20261128.json); no change at this vocab of 256
  c.parallel.update(save_dots=True, save_attention=True, save_head=True, scan_layers=False)
  # the MLP's GELU in its GEMMs' epilogues (models.gelu_mlp): the trainer's step at batch 8
  # on one H200 went from 66.5k to 68.2k tokens/s (MFU 0.569 -> 0.583), its peak from 36.3 to
  # 42.3 GB (trainer_summary_1.3b_h200_b8_mlp_gelu_*); with the kernel layers
  # (parallel.tp_overlap=kernel) in their all-gather kernels' epilogues; the ring layers keep
  # XLA's
  c.model.mlp_gelu = 'fused'
  # at tp > 1 the collectives run inside the matmuls (no effect at tp = 1): the trainer at
  # batch 8 on 2xH200, TP=2, 119.9k tokens/s against 105.5k (1.136x), peak 24.8 against 24.2
  # GB, compiling in 46 s against 30 (trainer_summary_1.3b_tp2_*_2gpu_20261129); on 4xH200,
  # TP=4, 162.5k against 143.3k (1.135x, trainer_summary_1.3b_tp4_*_4gpu_20261127)
  c.parallel.tp_overlap = 'kernel'
  return c
