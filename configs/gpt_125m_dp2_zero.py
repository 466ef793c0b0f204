"""GPT-2 small (as `gpt_125m_tp4`) on 2 GPUs, data-parallel 2 with the optimizer sharded
(`parallel.shard_optimizer`) and both data-parallel directions FP8-compressed: the
gradients' reduce-scatter (`compression.dp`) and the parameters' all-gather as weight
differences (`compression.dp_params`). The DP model of the accuracy benchmark:

  python benchmarks/bench_accuracy.py --config configs/gpt_125m_dp2_zero.py --variants off,on

Off: --config.compression.enabled=False. On CPU (slow): --cpu_devices=2.
"""
from taco_jax.configs import gpt_125m_tp4
from taco_jax.configs.common import codec


def get_config():
  c = gpt_125m_tp4.get_config()
  c.name = 'gpt_125m_dp2_zero'
  c.parallel.update(dp=2, tp=1, shard_optimizer=True)
  c.compression.dp = codec()          # e4m3, G=128, no Hadamard: measure_dp_codec's choice
  c.compression.dp_params = codec()
  return c
