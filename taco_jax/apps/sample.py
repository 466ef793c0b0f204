"""Generate text from a trained workdir: `python -m taco_jax.apps.sample --workdir=workdir/tiny`.

Rebuilds the model from <workdir>/config.json, restores the latest checkpoint's params (a
run on any mesh, or of the single-device trainer of taco-jax 0.1), and samples byte tokens
one at a time (no KV cache: each step reruns the jitted model on the last `max_seq_len`
tokens, right-padded to a fixed shape).
"""
from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags, logging
from flax import nnx

from taco_jax import data
from taco_jax.models.gpt import GPT
from taco_jax.tp import layout as layout_lib, mesh as mesh_lib
from taco_jax.train import checkpoint


def define_flags() -> None:
  """Defines the sampler's flags (in run(), so importing this module defines no flags)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a training run (has config.json).')
  flags.DEFINE_string('prompt', 'def ', 'Text to continue.')
  flags.DEFINE_integer('max_new_tokens', 256, 'Tokens (bytes) to generate.')
  flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 = greedy.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens; 0 = all.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')


def load_model(workdir: str | pathlib.Path) -> tuple[GPT, int]:
  """(model with the latest checkpoint's params, its step), from a run on any mesh: the
  checkpoint (stacked layers, `taco_jax.tp.layout`) is restored onto one device and
  unstacked into the single-device model. Errors say in one line what is missing or cannot
  be read."""
  workdir = pathlib.Path(workdir)
  cfg_path = workdir / 'config.json'
  if not cfg_path.exists():
    raise FileNotFoundError(f'{cfg_path} not found: --workdir must be a training workdir')
  config = ml_collections.ConfigDict(json.loads(cfg_path.read_text()))
  cfg = layout_lib.model_config(config.model)
  ckpt = checkpoint.Checkpoints(workdir)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f'no checkpoint in {ckpt.directory}')
  mesh = mesh_lib.make_mesh(1, 1, 1, jax.devices()[:1])
  target = layout_lib.abstract_params(cfg, mesh)
  try:
    meta = ckpt.restore_meta(step)
    if 'mesh' in meta:  # the stacked layout: its shapes are the target's
      _check_shapes(ckpt.stored_shapes(step), target)
    restored, _ = checkpoint.restore_state(ckpt, step, cfg, target, meta=meta)
  except Exception as e:  # noqa: BLE001 - orbax explains a mismatch in hundreds of lines
    lines = str(e).strip().splitlines() or [type(e).__name__]
    raise ValueError(f'cannot read checkpoint {ckpt.directory / str(step)} as the model of '
                     f'{cfg_path}: {lines[0][:300]}') from e
  finally:
    ckpt.close()
  model = layout_lib.single_device_model(cfg)
  params = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(params, layout_lib.from_parallel(restored))
  nnx.update(model, params)
  return model, step


def _shapes_by_name(tree, is_leaf=None) -> dict:
  """{'blocks/0/qkv/kernel': shape} of a params tree, however it nests (nnx.State keeps
  each array under 'value'; a checkpoint's keys are strings)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf):
    keys = [str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))) for k in path]
    out['/'.join(k for k in keys if k != 'value')] = tuple(getattr(leaf, 'shape', leaf))
  return out


def _check_shapes(stored, target) -> None:
  """Raises ValueError naming the first parameter whose stored shape is not the model's."""
  want = _shapes_by_name(target)
  have = _shapes_by_name(stored, is_leaf=lambda x: isinstance(x, tuple))
  for name in sorted(set(want) | set(have)):
    if want.get(name) != have.get(name):
      raise ValueError(f'parameter {name} is {have.get(name)} in the checkpoint but '
                       f'{want.get(name)} in the model')


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
