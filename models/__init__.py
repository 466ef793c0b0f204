"""Models: the single-device decoders (GPT, Qwen; one base, `models.decoder`) built from
injectable linear layers, the numerical reference the parallel code is tested against; and
the registry of them.

A config's `model.block` names the model: 'gpt' (`models.gpt`, the default) or 'qwen'
(`models.qwen`). `model_config` turns a config's model section into that model's config;
`kind`, `model_class` and `block_class` answer for a model config.
"""
from __future__ import annotations

import dataclasses

from taco_jax.models import gpt, qwen

MODELS = {m.config_class.block: m for m in (gpt.GPT, qwen.Qwen)}  # model.block -> model class


def kind(cfg) -> str:
  """The block name ('gpt' | 'qwen') of model config `cfg`."""
  name = getattr(type(cfg), 'block', None)
  if name not in MODELS or type(cfg) is not MODELS[name].config_class:
    raise TypeError(f'{type(cfg).__name__} is not a model config; use one of '
                    f'{[m.config_class.__name__ for m in MODELS.values()]}')
  return name


def model_class(cfg) -> type:
  """The model class (a `models.decoder.Decoder`) that model config `cfg` describes."""
  return MODELS[kind(cfg)]


def block_class(cfg) -> type:
  """The block class (a `models.decoder.DecoderBlock`) of the model `cfg` describes."""
  return model_class(cfg).block_class


def model_config(section):
  """`config.model` (a mapping or ConfigDict) -> the config of the model its `block` names.

  The section is shared by every model, so the fields of the others (e.g. Qwen's
  `n_kv_heads` under block 'gpt') are accepted and ignored; a field of none is an error
  that lists the known ones."""
  d = dict(section.to_dict() if hasattr(section, 'to_dict') else section)
  block = d.pop('block', 'gpt')
  if block not in MODELS:
    raise ValueError(f'model.block={block!r} is unknown; use one of {sorted(MODELS)}')
  fields = {m: {f.name for f in dataclasses.fields(m.config_class)} for m in MODELS.values()}
  known = set().union(*fields.values())
  unknown = sorted(set(d) - known)
  if unknown:
    raise ValueError(f'unknown model config field(s) {unknown}; known: '
                     f'{sorted(known | {"block"})}')
  own = fields[MODELS[block]]
  return MODELS[block].config_class(**{k: v for k, v in d.items() if k in own})
