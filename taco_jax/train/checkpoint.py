"""Orbax checkpoints of (params, opt_state, meta) under <workdir>/checkpoints/<step>: params
in the stacked layout of `taco_jax.tp.layout`, meta {'step', 'mesh'}."""
from __future__ import annotations

import functools
import logging
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from taco_jax.tp import layout as layout_lib


@functools.cache
def _save_each_array_from_one_replica() -> None:
  """Unless JAX_PLATFORMS names the GPU, orbax saves a replicated array in slices, one per
  replica, each cut by a jitted program on its device: a compile per array shape and device
  on the first save (~2.5 s of a 4-step CPU run on 8 devices), where one process writes
  every replica anyway. Orbax keeps one handler registry per process, so this sets the
  arrays' handler for every save in the process; its warning about the override is kept
  out of the run's output."""
  absl_logger = logging.getLogger("absl")  # orbax logs through absl
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
  finally:
    absl_logger.setLevel(level)


class Checkpoints:
  """Thin wrapper over `ocp.CheckpointManager`; items: params, opt_state, meta (JSON)."""

  def __init__(self, workdir: str | pathlib.Path, keep: int = 2):
    _save_each_array_from_one_replica()
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

  def restore_meta(self, step: int) -> dict:
    """The metadata saved with checkpoint `step`."""
    return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def stored_shapes(self, step: int, item: str = 'params'):
    """The shapes of checkpoint `step`'s `item`, as a pytree (read from its metadata; an
    optax state's tuples come back as lists)."""
    from etils import epath
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory / str(step) / item))
    return jax.tree.map(lambda x: tuple(x.shape), meta.tree)

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()


def restore_state(ckpt: Checkpoints, step: int, cfg, params_target, opt_state_target=None,
                  tx=None, *, meta: dict | None = None):
  """(params, opt_state or None) of checkpoint `step`, placed like the targets (any mesh).

  Also reads the checkpoints of the single-device trainer of taco-jax 0.1 (one nnx state
  per model, recognized by metadata without a mesh): their layers are stacked into today's
  layout (`taco_jax.tp.layout.to_parallel`), and so are the moments (`tx`: the optimizer,
  needed with `opt_state_target`). `meta`: the checkpoint's metadata, if the caller has
  read it already (`Checkpoints.restore_meta`).
  """
  if 'mesh' in (ckpt.restore_meta(step) if meta is None else meta):
    params, opt_state, _ = ckpt.restore(step, params_target, opt_state_target)
    return params, opt_state
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  on_one = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)
  old = nnx.state(nnx.eval_shape(lambda: layout_lib.single_device_model(cfg)), nnx.Param)
  old_opt = None if opt_state_target is None else on_one(jax.eval_shape(tx.init, old))
  params, opt_state, _ = ckpt.restore(step, on_one(old), old_opt)
  is_state = lambda x: isinstance(x, nnx.State)
  stack = lambda x: layout_lib.to_parallel(nnx.to_pure_dict(x)) if is_state(x) else x
  place = lambda tree, target: jax.tree.map(lambda x, t: jax.device_put(x, t.sharding),
                                            jax.tree.map(stack, tree, is_leaf=is_state), target)
  return (place(params, params_target),
          None if opt_state is None else place(opt_state, opt_state_target))
