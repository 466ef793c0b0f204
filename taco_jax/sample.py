"""Generate text from a trained workdir: `python -m taco_jax.sample --workdir=workdir/tiny`.

Rebuilds the model from <workdir>/config.json, restores the latest checkpoint's params,
and samples byte tokens one at a time (no KV cache: each step reruns the jitted model
on the last `max_seq_len` tokens, right-padded to a fixed shape).
"""
from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from models.gpt import GPT, GPTConfig
from taco_jax import data
from taco_jax.train import checkpoint, step as step_lib


def define_flags() -> None:
  """Defines the sampler's flags (in run(), so importing this module defines no flags)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a training run (has config.json).')
  flags.DEFINE_string('prompt', 'def ', 'Text to continue.')
  flags.DEFINE_integer('max_new_tokens', 256, 'Tokens (bytes) to generate.')
  flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 = greedy.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens; 0 = all.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')


def load_model(workdir: str | pathlib.Path) -> tuple[GPT, int]:
  """(model with the latest checkpoint's params, its step). Errors name what is missing."""
  workdir = pathlib.Path(workdir)
  cfg_path = workdir / 'config.json'
  if not cfg_path.exists():
    raise FileNotFoundError(f'{cfg_path} not found: --workdir must be a training workdir')
  cfg = GPTConfig.from_dict(json.loads(cfg_path.read_text())['model'])
  ckpt = checkpoint.Checkpoints(workdir)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f'no checkpoint in {ckpt.directory}')
  model = step_lib.build_model(cfg, 0)
  graphdef, params = nnx.split(model)
  params, _, _ = ckpt.restore(step, params)
  ckpt.close()
  return nnx.merge(graphdef, params), step


def generate(model: GPT, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0) -> np.ndarray:
  """Prompt + `max_new_tokens` sampled tokens (1-D int32); context truncated to the window."""
  ctx = model.cfg.max_seq_len
  graphdef, params = nnx.split(model)

  @jax.jit
  def next_token(params, window_1T, n, key):
    logits_V = nnx.merge(graphdef, params)(window_1T)[0, n - 1]
    if top_k:
      kth = jax.lax.top_k(logits_V, top_k)[0][-1]
      logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    if temperature <= 0:
      return jnp.argmax(logits_V)
    return jax.random.categorical(key, logits_V / temperature)

  tokens = [int(x) for x in prompt_tokens] or [ord('\n')]
  key = jax.random.key(seed)
  for _ in range(max_new_tokens):
    window = tokens[-ctx:]
    buf = np.zeros((1, ctx), np.int32)
    buf[0, :len(window)] = window  # right padding never reaches earlier positions (causal)
    key, sub = jax.random.split(key)
    tokens.append(int(next_token(params, buf, len(window), sub)))
  return np.asarray(tokens, np.int32)


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:  # orbax logs every checkpoint step at INFO
    logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if not f.workdir:
    raise app.UsageError('--workdir is required (a training workdir, e.g. workdir/tiny)')
  try:
    model, step = load_model(f.workdir)
  except (FileNotFoundError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  if model.cfg.vocab_size != data.VOCAB_SIZE:
    print(f'warning: vocab_size={model.cfg.vocab_size}: tokens are decoded as bytes',
          file=sys.stderr)
  out = generate(model, data.encode(f.prompt), f.max_new_tokens, temperature=f.temperature,
                 top_k=f.top_k, seed=f.seed)
  print(f'# step {step}', file=sys.stderr)
  print(data.decode(np.clip(out, 0, 255)))


def run():
  """Console-script entry point (`taco-sample`)."""
  define_flags()
  app.run(main)


if __name__ == '__main__':
  run()
