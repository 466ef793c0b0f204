"""Megatron tensor-/sequence-parallel regions as ``jax.custom_vjp`` functions.

Each region is one collective in the forward pass and its transpose in the backward pass
(all-gather <-> reduce-scatter, all-reduce <-> identity), both through
``taco_jax.collectives`` so each can be compressed on its own: ``fwd_compression`` for
activations, ``bwd_compression`` for gradients (which may want E5M2, or nothing).
Configs are static (``CompressionConfig`` is hashable); ``None`` means uncompressed; a
``collectives.Decided`` codec is sent with as the caller decided it (not decided again).

Use inside a fully manual ``jax.shard_map``; ``check_vma=True`` and ``False`` both work.
With ``check_vma=True`` the regions keep JAX's varying-manual-axes types right:
``copy_to_tp`` returns a value varying over the axis (so JAX inserts no implicit ``pvary``,
whose transpose would be an uncompressed psum), and the backward pass of every region
returns a cotangent with its primal's type.

The regions are pure: they know no sites and no monitor. The callers that know which site a
region is (``taco_jax.tp.layers``) wrap it in ``monitor.region``.

The forward outputs of the regions that communicate (``reduce_from_tp``,
``gather_from_sp``, ``reduce_scatter_to_sp``) carry the checkpoint name ``TP_OUTPUT``: a
``jax.checkpoint`` policy that saves them (``save_tp_outputs_policy``) keeps the backward
pass's recomputation of a block from communicating (and compressing) again.
"""
from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from taco_jax import collectives
from taco_jax.collectives import Compression

TP_OUTPUT = "taco_tp_output"  # checkpoint name of the communicating regions' forward outputs


def save_tp_outputs_policy():
  """A ``jax.checkpoint`` policy saving the forward outputs of the TP collectives (Megatron's
  selective recomputation: the rest of the block is recomputed, no collective is)."""
  return jax.checkpoint_policies.save_only_these_names(TP_OUTPUT)


def _axes(axis_name) -> tuple:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _vma(x) -> frozenset:
  """The manual mesh axes x varies over (empty with ``check_vma=False``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.11; older jax: ``aval.vma``
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _cast_varying(x, axis_name, vma: frozenset):
  """``pcast`` x to varying over those of the axes that ``vma`` has and x lacks."""
  missing = tuple(a for a in _axes(axis_name) if a in vma and a not in _vma(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


# --- copy_to_tp ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _copy_to_tp(x, axis_name, bwd, algorithm):
  return _copy_to_tp_fwd(x, axis_name, bwd, algorithm)[0]


def _copy_to_tp_fwd(x, axis_name, bwd, algorithm):
  vma = _vma(x)
  y = _cast_varying(x, axis_name, vma | frozenset(_axes(axis_name)))
  return y, None


def _copy_to_tp_bwd(axis_name, bwd, algorithm, _, ct):
  return (collectives.all_reduce(ct, axis_name, compression=bwd, algorithm=algorithm),)


_copy_to_tp.defvjp(_copy_to_tp_fwd, _copy_to_tp_bwd)


def copy_to_tp(x, axis_name, *, bwd_compression: Compression = None,
               algorithm: collectives.Algorithm = "two_shot"):
  """forward: identity (replicated -> varying over ``axis_name``), backward: all-reduce.

  Put before a column-parallel matmul whose input is replicated over the TP axis.
  """
  return _copy_to_tp(x, axis_name, bwd_compression, algorithm)


# --- reduce_from_tp --------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _reduce_from_tp(x, axis_name, fwd, algorithm, vma):
  return collectives.all_reduce(x, axis_name, compression=fwd, algorithm=algorithm)


def _reduce_from_tp_fwd(x, axis_name, fwd, algorithm, vma):
  return _reduce_from_tp(x, axis_name, fwd, algorithm, vma), None


def _reduce_from_tp_bwd(axis_name, fwd, algorithm, vma, _, ct):
  return (_cast_varying(ct, axis_name, vma),)


_reduce_from_tp.defvjp(_reduce_from_tp_fwd, _reduce_from_tp_bwd)


def reduce_from_tp(x, axis_name, *, fwd_compression: Compression = None,
                   algorithm: collectives.Algorithm = "two_shot"):
  """forward: all-reduce (partial sums -> replicated), backward: identity.

  Put after a row-parallel matmul (tensor parallelism without sequence parallelism).
  """
  return checkpoint_name(_reduce_from_tp(x, axis_name, fwd_compression, algorithm, _vma(x)),
                         TP_OUTPUT)


# --- gather_from_sp ---------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather_from_sp(x, axis_name, axis, fwd, bwd, vma):
  return collectives.all_gather(x, axis_name, axis=axis, tiled=True, compression=fwd)


def _gather_from_sp_fwd(x, axis_name, axis, fwd, bwd, vma):
  return _gather_from_sp(x, axis_name, axis, fwd, bwd, vma), None


def _gather_from_sp_bwd(axis_name, axis, fwd, bwd, vma, _, ct):
  ct = _cast_varying(ct, axis_name, frozenset(_axes(axis_name)))
  g = collectives.reduce_scatter(ct, axis_name, scatter_dimension=axis, compression=bwd)
  return (_cast_varying(g, axis_name, vma),)


_gather_from_sp.defvjp(_gather_from_sp_fwd, _gather_from_sp_bwd)


def gather_from_sp(x, axis_name, *, axis: int = 1, fwd_compression: Compression = None,
                   bwd_compression: Compression = None):
  """forward: all-gather along ``axis`` (the sequence; 1 for [B, T, D]), backward:
  reduce-scatter along it. Put before a column-parallel matmul in sequence parallelism.
  """
  return checkpoint_name(
      _gather_from_sp(x, axis_name, axis, fwd_compression, bwd_compression, _vma(x)), TP_OUTPUT)


# --- reduce_scatter_to_sp -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _reduce_scatter_to_sp(x, axis_name, axis, fwd, bwd):
  return collectives.reduce_scatter(x, axis_name, scatter_dimension=axis, compression=fwd)


def _reduce_scatter_to_sp_fwd(x, axis_name, axis, fwd, bwd):
  return _reduce_scatter_to_sp(x, axis_name, axis, fwd, bwd), None


def _reduce_scatter_to_sp_bwd(axis_name, axis, fwd, bwd, _, ct):
  ct = _cast_varying(ct, axis_name, frozenset(_axes(axis_name)))
  return (collectives.all_gather(ct, axis_name, axis=axis, tiled=True, compression=bwd),)


_reduce_scatter_to_sp.defvjp(_reduce_scatter_to_sp_fwd, _reduce_scatter_to_sp_bwd)


def reduce_scatter_to_sp(x, axis_name, *, axis: int = 1, fwd_compression: Compression = None,
                         bwd_compression: Compression = None):
  """forward: reduce-scatter along ``axis`` (the sequence; 1 for [B, T, D]), backward:
  all-gather along it. Put after a row-parallel matmul in sequence parallelism.
  """
  return checkpoint_name(
      _reduce_scatter_to_sp(x, axis_name, axis, fwd_compression, bwd_compression), TP_OUTPUT)
