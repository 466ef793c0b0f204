"""GPipe schedule over mesh axis "pipeline", inside the shard_map.

Stage s (= axis_index("pipeline")) holds layers [s L/pp, (s+1) L/pp). With m micro-batches
the schedule runs m + pp - 1 ticks; at tick t stage s works on micro-batch t - s (when
0 <= t - s < m), then hands its output to stage s + 1 with `shift_to_next_stage` (a
ppermute, compressible by `compression.pp`, or per direction by the sites pp/fwd and
pp/bwd). All micro-batches' forwards come before all backwards (jax.grad through the scan
of ticks runs the ticks in reverse, and the ppermute's transpose carries cotangents from
stage s + 1 back to s). Every stage idles for pp - 1 of
the m + pp - 1 ticks in each direction: bubble fraction (pp - 1) / (m + pp - 1).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from taco_jax import collectives, monitor
from taco_jax.codec import CompressionConfig
from taco_jax.collectives import Compression, Decided
from taco_jax.tp.mesh import PIPE


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def shift_to_next_stage(x, pp: int, fwd: Compression = None, bwd: Compression = None):
  """Stage s sends x to stage s + 1; stage 0 receives zeros.
  forward: ppermute s -> s+1 (codec `fwd`), backward: ppermute s+1 -> s (codec `bwd`)."""
  perm = [(i, i + 1) for i in range(pp - 1)]
  return collectives.ppermute(x, PIPE, perm, compression=fwd)


def _shift_fwd(x, pp, fwd, bwd):
  return shift_to_next_stage(x, pp, fwd, bwd), None


def _shift_bwd(pp, fwd, bwd, _, g):
  perm = [(i + 1, i) for i in range(pp - 1)]
  return (collectives.ppermute(g, PIPE, perm, compression=bwd),)


shift_to_next_stage.defvjp(_shift_fwd, _shift_bwd)


def gpipe(stage_fn: Callable, x_MBSD: jax.Array, *, pp: int,
          fwd: CompressionConfig | None = None,
          bwd: CompressionConfig | None = None) -> jax.Array:
  """Runs `stage_fn` (this stage's layers) over m micro-batches x_MBSD in a GPipe schedule.

  `x_MBSD` are stage 0's inputs (other stages ignore theirs); `fwd` / `bwd`: the codecs
  of the activations sent forward and of their gradients sent back. Returns the last stage's
  outputs [m, ...] (other stages return values of no meaning; mask them out of the loss).
  """
  if pp == 1:
    return jax.lax.map(stage_fn, x_MBSD)
  m = x_MBSD.shape[0]
  first = jax.lax.axis_index(PIPE) == 0
  pad = jnp.zeros((pp - 1, *x_MBSD.shape[1:]), x_MBSD.dtype)
  xs = jnp.concatenate([x_MBSD, pad])  # stage 0's input at each of the m + pp - 1 ticks

  # each direction's message has x's shape: decided once, for the shift and the monitor
  sends = [collectives.decide("ppermute", x_MBSD[0], c, pp, site=f"pp/{d}")
           for c, d in ((fwd, "fwd"), (bwd, "bwd"))]
  shift = lambda x: shift_to_next_stage(x, pp, *map(Decided, sends))

  def tick(prev_out, x_in):
    recv = monitor.region(shift, prev_out, fwd=sends[0], bwd=sends[1], fwd_site="pp/fwd",
                          bwd_site="pp/bwd")
    out = stage_fn(jnp.where(first, x_in, recv))
    return out, out

  _, ys = jax.lax.scan(tick, jnp.zeros_like(x_MBSD[0]), xs)
  return ys[pp - 1:pp - 1 + m]  # the last stage finishes micro-batch i at tick i + pp - 1
