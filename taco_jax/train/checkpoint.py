"""Orbax checkpoints of (params, opt_state, meta) under <workdir>/checkpoints/<step>."""
from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  """Thin wrapper over `ocp.CheckpointManager`; items: params, opt_state, meta (JSON)."""

  def __init__(self, workdir: str | pathlib.Path, keep: int = 2):
    self.directory = pathlib.Path(workdir).absolute() / 'checkpoints'
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, params, opt_state, meta: dict) -> None:
    """Saves asynchronously (device->host copy happens now); `wait()` before exiting."""
    if step in self._mngr.all_steps():
      return
    self._mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, params_target, opt_state_target=None):
    """(params, opt_state or None, meta) of checkpoint `step`; targets give shapes/dtypes."""
    items = {'params': ocp.args.StandardRestore(params_target), 'meta': ocp.args.JsonRestore()}
    if opt_state_target is not None:
      items['opt_state'] = ocp.args.StandardRestore(opt_state_target)
    out = self._mngr.restore(step, args=ocp.args.Composite(**items))
    return out['params'], out.get('opt_state') if opt_state_target is not None else None, \
        out['meta']

  def stored_shapes(self, step: int, item: str = 'params'):
    """The shapes of checkpoint `step`'s `item`, as a pytree (read from its metadata)."""
    from etils import epath
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory / str(step) / item))
    return jax.tree.map(lambda x: tuple(x.shape), dict(meta))

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()
