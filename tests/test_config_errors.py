"""Config validation and config-file resolution: clear errors before anything is built."""
import dataclasses
import importlib
import pathlib

import pytest

from taco_jax.configs import gpt_1_3b, gpt_125m, gpt_350m, tiny
from taco_jax.models import model_config
from taco_jax.models.decoder import num_params
from taco_jax.models.qwen import QwenConfig
from taco_jax.tp import layout as layout_lib
from taco_jax.train import cli
from taco_jax.train.config import resolve_config_path, validate
from taco_jax.train.trainer import train

CONFIGS_DIR = pathlib.Path(tiny.__file__).parent


@pytest.mark.parametrize('mod', [tiny, gpt_125m, gpt_350m, gpt_1_3b])
def test_shipped_configs_are_valid(mod):
  c = mod.get_config()
  validate(c)
  assert c.parallel.dp * c.parallel.pp * c.parallel.tp == 1  # one device
  assert c.compression.enabled is False and c.model.vocab_size == 256


def test_model_sizes():
  sizes = {m.__name__.split('.')[-1]: num_params(model_config(m.get_config().model))
           for m in (gpt_125m, gpt_350m, gpt_1_3b)}
  # byte vocab: no 50k-row embedding table, so ~39M/~51M/~100M below the GPT-2 counts
  assert 80e6 < sizes['gpt_125m'] < 90e6
  assert 295e6 < sizes['gpt_350m'] < 310e6
  assert 1.2e9 < sizes['gpt_1_3b'] < 1.3e9


@pytest.mark.parametrize('section,key,value,needle', [
    ('model', 'd_model', 31, 'model.d_model=31 is not divisible by model.n_heads=2'),
    ('model', 'n_layers', 0, 'model.n_layers=0 must be a positive integer'),
    ('model', 'dtype', 'fp8', "model.dtype='fp8' is unknown"),
    ('data', 'seq_len', 64, 'data.seq_len=64 exceeds model.max_seq_len=32'),
    ('data', 'batch_size', -1, 'data.batch_size=-1 must be a positive integer'),
    ('data', 'val_fraction', 1.0, 'data.val_fraction'),
    ('train', 'steps', 0, 'train.steps=0 must be a positive integer'),
    ('train', 'eval_every', -5, 'train.eval_every=-5'),
    ('optim', 'lr', 0.0, 'optim.lr=0.0 must be a positive number'),
    ('optim', 'warmup_steps', -1, 'optim.warmup_steps=-1 must be an integer >= 0'),
    ('compression', 'link_probe', None, 'compression.link_probe=None must be True (time '),
    ('model', 'attention', 'cudnn', "model.attention=cudnn: cuDNN flash attention refuses q "
     "(1, 32, 2, 16) float32: no GPU (backend 'cpu'); use attention=auto or xla"),
])
def test_bad_values_name_the_field(section, key, value, needle):
  c = tiny.get_micro_config()
  c[section][key] = value
  with pytest.raises(ValueError, match='invalid config') as e:
    validate(c)
  assert needle in str(e.value)


@pytest.mark.parametrize('name', sorted(
    p.stem for p in CONFIGS_DIR.glob('*.py') if p.stem not in ('__init__', 'common')))
def test_every_shipped_config_is_valid(name):
  """Each config file as shipped, on as many devices as its layout needs."""
  c = importlib.import_module(f'taco_jax.configs.{name}').get_config()
  validate(c, n_devices=c.parallel.dp * c.parallel.pp * c.parallel.tp)


def test_overlap_grad_reduce_needs_one_backward_pass_per_step():
  c = tiny.get_micro_config()
  c.parallel.overlap_grad_reduce = True
  validate(c)
  c.parallel.shard_optimizer = True
  with pytest.raises(ValueError, match='parallel.overlap_grad_reduce=True reduces each layer'):
    validate(c)


def test_model_fields():
  c = tiny.get_micro_config()
  c.model.update(block='gpt', n_kv_heads=2, rope_theta=1e4)  # shared fields: accepted, ignored
  validate(c)
  assert model_config(c.model) == model_config(tiny.get_micro_config().model)
  c.model.n_kv_head = 2
  with pytest.raises(ValueError, match=r"unknown model config field\(s\) \['n_kv_head'\]; "
                     r"known: \[.*'n_kv_heads'"):
    validate(c)
  c = tiny.get_micro_config()
  c.model.block = 'qwen'
  validate(c)  # a Qwen config (n_kv_heads defaults)
  own = {f.name for f in dataclasses.fields(QwenConfig)}  # GPT's mlp_gelu: accepted, ignored
  assert model_config(c.model) == QwenConfig(**{k: v for k, v in c.model.items() if k in own})


def test_errors_come_before_any_model_is_built(tmp_path, monkeypatch):
  def boom(*a, **k):
    raise AssertionError('model built before the error')

  monkeypatch.setattr(layout_lib, 'init_params', boom)
  c = tiny.get_micro_config()
  c.data.path = str(tmp_path / 'missing.txt')
  with pytest.raises(FileNotFoundError, match='missing.txt'):
    train(c, tmp_path / 'wd')
  c = tiny.get_micro_config()
  c.parallel.dp = 2
  with pytest.raises(ValueError, match='parallel.dp'):
    train(c, tmp_path / 'wd')


def test_resolve_config_path(tmp_path):
  installed = str(CONFIGS_DIR / 'tiny.py')
  for name in ('configs/tiny.py', 'tiny.py', 'tiny'):
    assert resolve_config_path(name, cwd=tmp_path) == installed
  assert resolve_config_path('configs/tiny.py:arg', cwd=tmp_path) == installed + ':arg'
  mine = tmp_path / 'configs' / 'tiny.py'
  mine.parent.mkdir()
  mine.write_text('')
  assert resolve_config_path('configs/tiny.py', cwd=tmp_path) == 'configs/tiny.py'  # local wins
  with pytest.raises(FileNotFoundError, match=r"'nope.py' not found.*available: \[.*'tiny'"):
    resolve_config_path('nope.py', cwd=tmp_path)
  with pytest.raises(FileNotFoundError):
    resolve_config_path('elsewhere/tiny.py', cwd=tmp_path)  # only configs/ maps to the package


def test_rewrite_config_arg(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  installed = str(CONFIGS_DIR / 'gpt_125m.py')
  argv = ['prog', '--config=configs/gpt_125m.py', '--config.seed=3', '--workdir=w']
  assert cli.rewrite_config_arg(argv) == ['prog', f'--config={installed}', '--config.seed=3',
                                          '--workdir=w']
  assert cli.rewrite_config_arg(['prog', '--config', 'gpt_125m']) == ['prog', '--config',
                                                                      installed]
