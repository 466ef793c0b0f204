"""Modules that moved when the package was laid out in layer order: importing (or running
with `python -m`) an old name fails with a message naming the new one.

The finder sits last on `sys.meta_path`, so it only answers for names that nothing else
provides.
"""
from __future__ import annotations

import importlib.abc

MOVED = {
    'taco_jax.parallel': 'taco_jax.tp',
    'taco_jax.parallel.model': 'taco_jax.tp.layout',
    'taco_jax.parallel.train': 'taco_jax.train (python -m taco_jax.train)',
    'taco_jax.parallel.compression': 'taco_jax.plan',
    'taco_jax.parallel.gspmd': 'benchmarks.gspmd',
    'taco_jax.parallel.pgle': 'taco_jax.train.pgle',
    'benchmarks.pgle': 'taco_jax.train.pgle',
    'taco_jax.parallel.hlo': 'taco_jax.testing.hlo',
    'taco_jax.quality': 'taco_jax.monitor',
    'taco_jax.calibrate': 'taco_jax.apps.calibrate',
    'taco_jax.sample': 'taco_jax.apps.sample',
    'taco_jax.plot': 'taco_jax.apps.plot',
    'taco_jax.train.loop': 'taco_jax.train.trainer',
    'models': 'taco_jax.models',
    'pallas_kernels': 'taco_jax.pallas_kernels',
    'configs': 'taco_jax.configs',
}


def new_name(fullname: str) -> str | None:
  """Where module `fullname` (or the package it is in) went, or None if it did not move."""
  for old in sorted(MOVED, key=len, reverse=True):
    if fullname == old or fullname.startswith(old + '.'):
      new = MOVED[old]
      return new + fullname[len(old):] if fullname != old and ' ' not in new else new
  return None


class MovedModuleFinder(importlib.abc.MetaPathFinder):
  """Raises ModuleNotFoundError naming the new module for an old name nothing else found."""

  def find_spec(self, fullname, path=None, target=None):
    new = new_name(fullname)
    if new is None:
      return None
    inside = [f'{old[len(fullname) + 1:]} -> {MOVED[old]}' for old in MOVED
              if old.startswith(fullname + '.')]
    more = f" ({'; '.join(inside)})" if inside else ''
    raise ModuleNotFoundError(f'{fullname} moved: use {new}{more}', name=fullname)
