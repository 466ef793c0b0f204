"""Tiny GPT for CPU: trains on the embedded stdlib corpus in a few minutes on 2 cores."""
from taco_jax.configs.common import base_config


def get_config():
  c = base_config('tiny')
  # float32: on CPU, bf16 matmuls are ~3x slower than fp32 (the GPU configs keep bf16).
  c.model.update(n_layers=4, d_model=128, n_heads=4, d_ff=512, max_seq_len=128, dtype='float32')
  c.parallel.scan_layers = False  # on CPU the unrolled layers run ~10% faster than a scan
  c.data.update(seq_len=128, batch_size=32)
  c.optim.update(lr=2e-3, warmup_steps=50, weight_decay=0.1)
  c.train.update(steps=400, log_every=10, eval_every=100, eval_batches=8, checkpoint_every=200)
  return c


def get_micro_config():
  """A seconds-on-CPU variant for unit tests: 2 x 32 wide, seq 32, a 2 MB corpus slice."""
  c = get_config()
  c.name = 'micro'
  c.model.update(n_layers=2, d_model=32, n_heads=2, d_ff=128, max_seq_len=32)
  c.data.update(seq_len=32, batch_size=8, max_corpus_bytes=2_000_000)
  c.optim.update(lr=3e-3, warmup_steps=2)
  c.train.update(steps=8, log_every=1, eval_every=0, eval_batches=2, checkpoint_every=0,
                 progress_bar=False)
  return c
