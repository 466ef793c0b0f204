"""GPT ~1.3B (24 x 2048, 16 heads, context 2048) on 4 GPUs, tensor-parallel 4, with FP8
(TACO) compression of the TP activations and their gradients.

  python -m taco_jax.train --config=configs/gpt_1_3b_tp4.py
Switch compression off with --config.compression.enabled=False; change the layout with
--config.parallel.dp/pp/tp (e.g. pp=2 tp=2 --config.parallel.microbatches=8).
"""
from taco_jax.configs.common import base_config
from taco_jax.configs.parallel_tiny import add_parallel_sections


def get_config():
  c = base_config('gpt_1_3b_tp4')
  c.model.update(n_layers=24, d_model=2048, n_heads=16, d_ff=8192, max_seq_len=2048,
                 remat=True)
  c.data.update(seq_len=2048, batch_size=16)
  c.optim.update(lr=2e-4, warmup_steps=2000)
  c.train.update(steps=50_000, eval_every=2000, checkpoint_every=2000, peak_flops=989e12)
  add_parallel_sections(c, dp=1, pp=1, tp=4, microbatches=1)
  # keep the TP collectives' outputs through remat: 10% faster on 4xH200 (189 against 210
  # ms a step at batch 8, bf16), for 320 MiB per layer per GPU at batch 16 (7.5 GiB)
  c.parallel.save_tp_outputs = True
  # the collectives inside the matmuls, FP8 where the link policy measured it to pay: on
  # 4xH200 (NVLink) 98.0-98.6 ms a bench_train step against 119.6-119.7 for the bf16
  # collectives and 113.4 for the FP8 ones (bench_train_nvlink_cm_policy*_4gpu); the trainer 1.135x
  # (trainer_summary_1.3b_tp4_*_4gpu_20261127); where a kernel cannot run (P2P off, no
  # Hopper GPU) that collective is XLA's, compressed as before, said once
  c.parallel.tp_overlap = 'kernel'
  for family in ('tp_forward', 'tp_backward', 'pp'):
    c.compression[family].group_size = 128
  return c
