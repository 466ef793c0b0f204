"""Loss and gradients by the 1F1B / interleaved schedule (`schedules.ticks`), inside the
shard_map: a `jax.lax.scan` over ticks, every stage running the same program.

Per tick, on stage s (= axis_index("pipeline")), as the tick tables say:

  backward  the chunk's vjp, rebuilt from the residuals kept in its slot, applied to the
            gradient received last tick; its parameter gradients are accumulated (fp32);
            on the first chunk also the embedding's vjp (first stage only)
  forward   the chunk on the activation received last tick (the first chunk: on the
            embedding of its micro-batch, first stage only) under `jax.vjp`; its residuals
            go to a slot. The last chunk instead runs the head and loss and their vjp and
            the chunk's backward at once (last stage only), keeping nothing.
  hand-off  the forward's output to stage s + 1, the backward's input gradient to s - 1
            (ppermutes over "pipeline", codecs `fwd` and `bwd`; rings when v > 1)

Which branch runs depends on the tick and the stage only, so a stage's tensor (and data)
group takes the same one and the TP collectives inside stay matched; the ppermutes stay
outside the branches. Residuals that are the chunk's own parameters are not kept (they are
taken again from the parameters); the matmul weights enter the vjp already in the compute
dtype (`cast_kernels`), so no per-micro-batch residual is a copy of a weight.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.flatten_util
import jax.numpy as jnp

from taco_jax import collectives
from taco_jax.codec import CompressionConfig
from taco_jax.tp import schedules
from taco_jax.tp.mesh import PIPE


@dataclasses.dataclass(frozen=True)
class Parts:
  """The model in the pieces the schedule places, each on this device's shards."""
  embed: Callable   # (params, tokens_BT) -> h_BSD: embedding (+ positions)
  chunk: Callable   # (chunk_blocks, h_BSD) -> h_BSD: one chunk's layers
  head: Callable    # (params, h_BSD, targets_BT) -> mean token loss (final norm + xent)
  dtype: object     # compute dtype of the matmul weights


def cast_kernels(blocks, dtype):
  """The blocks' matmul weights ("kernel") in the compute dtype, as the layers use them."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: x.astype(dtype) if getattr(p[-1], "key", None) == "kernel" else x, blocks)


def _param_sources(leaves, params) -> tuple:
  """For each residual leaf, the index of the parameter leaf it is, or None."""
  ps = jax.tree.leaves(params)
  return tuple(next((j for j, p in enumerate(ps) if leaf is p), None) for leaf in leaves)


def _vjp_stored(chunk, p, x):
  """(y, residual leaves to keep, (treedef, sources)) of `jax.vjp(chunk, p, x)`."""
  y, vjp = jax.vjp(chunk, p, x)
  leaves, tree = jax.tree.flatten(vjp)
  src = _param_sources(leaves, p)
  return y, [leaf for leaf, s in zip(leaves, src) if s is None], (tree, src)


def _rebuild(layout, stored, p):
  """The chunk's vjp function from its kept residuals and its parameters."""
  tree, src = layout
  ps, kept = jax.tree.leaves(p), iter(stored)
  return jax.tree.unflatten(tree, [next(kept) if s is None else ps[s] for s in src])


def _chunk_moves(pp: int, v: int) -> dict:
  """{(r, k): ppermute pairs (q, s)}: stage q's stored chunk r is stage s's chunk k."""
  moves = {}
  for r in range(v):
    for k in range(v):
      pairs = [(q, q * v + r - k * pp) for q in range(pp) if 0 <= q * v + r - k * pp < pp]
      if pairs:
        moves[(r, k)] = pairs
  return moves


def _permute_chunks(tree, moves: dict):
  """{(a, b): pairs}: chunk b of the result is chunk a of `tree` (leaves [v, ...]) sent
  along `pairs`, summed over a (a stage receives one chunk per b); the chunks travel as one
  flat fp32 vector each."""
  v = jax.tree.leaves(tree)[0].shape[0]
  unravel = jax.flatten_util.ravel_pytree(jax.tree.map(lambda x: x[0], tree))[1]
  flat = [jax.flatten_util.ravel_pytree(jax.tree.map(lambda x: x[a], tree))[0]
          for a in range(v)]
  out = [jnp.zeros_like(flat[0]) for _ in range(v)]
  for (a, b), pairs in moves.items():
    out[b] = out[b] + collectives.ppermute(flat[a], PIPE, pairs)
  return jax.tree.map(lambda *xs: jnp.stack(xs), *[unravel(x) for x in out])


def to_chunks(blocks, pp: int, v: int):
  """This stage's stored blocks [L / pp, ...] (model chunks s v .. s v + v - 1, the
  parameter layout of every schedule) -> the chunks it runs [v, L / (v pp), ...] (model
  chunks k pp + s). For v > 1 that moves (v - 1) / v of the blocks between stages (one
  ppermute per (stored, run) chunk index pair)."""
  local = jax.tree.map(lambda x: x.reshape(v, x.shape[0] // v, *x.shape[1:]), blocks)
  return local if v == 1 else _permute_chunks(local, _chunk_moves(pp, v))


def from_chunks(grads, pp: int, v: int):
  """Inverse of `to_chunks`: gradients of the run chunks back to the stored blocks."""
  if v > 1:
    grads = _permute_chunks(grads, {(k, r): [(b, a) for a, b in pairs]
                                    for (r, k), pairs in _chunk_moves(pp, v).items()})
  return jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), grads)


def _decided(x, codec, pp: int, site: str) -> collectives.Decided:
  """The codec of one pipeline message, decided (and recorded) as ``site``'s."""
  return collectives.Decided(collectives.decide("ppermute", x, codec, pp, site=site))


def _add(acc, g):
  return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)


def _add_chunk(grads, k, dp):
  """`grads` with chunk k's parameter gradients `dp` added to its blocks."""
  return dict(grads, blocks=jax.tree.map(lambda a, g: a.at[k].add(g.astype(a.dtype)),
                                         grads["blocks"], dp))


def loss_and_grads(parts: Parts, params, inputs_MBT, targets_MBT, *, pp: int, v: int,
                   fwd: CompressionConfig | None = None,
                   bwd: CompressionConfig | None = None):
  """(mean loss over the m micro-batches on the last stage (0 elsewhere), fp32 gradients
  of this device's `params`). `params["blocks"]` holds this stage's v chunks: [v, layers of
  a chunk, ...]; `inputs_MBT` / `targets_MBT`: the m micro-batches' token ids."""
  m = inputs_MBT.shape[0]
  t = schedules.ticks(pp, v, m)
  s = jax.lax.axis_index(PIPE)
  head_params = {k: x for k, x in params.items() if k != "blocks"}
  chunk_params = lambda k: cast_kernels(  # noqa: E731
      jax.tree.map(lambda x: x[k], params["blocks"]), parts.dtype)
  h = jax.eval_shape(parts.embed, params, inputs_MBT[0])
  layout = {}

  def trace_layout(p, x):
    _, kept, layout["vjp"] = _vjp_stored(parts.chunk, p, x)
    return kept

  kept = jax.eval_shape(trace_layout, chunk_params(0), h)
  slots = [jnp.zeros((t.slots + 1, *a.shape), a.dtype) for a in kept]  # + scratch slot
  grads = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)

  def embed_grads(tokens_BT, dx):
    e = lambda hp: parts.embed(hp, tokens_BT)  # noqa: E731
    return jax.vjp(e, head_params)[1](dx)[0]

  def backward(recv, row, slots, grads):
    k, i = row["bwd_chunk"], row["bwd_mb"]
    stored = [a[row["bwd_slot"]] for a in slots]

    def run(grads):
      dp, dx = _rebuild(layout["vjp"], stored, chunk_params(k))(recv)
      grads = _add_chunk(grads, k, dp)
      first = (s == 0) & (k == 0)  # the first chunk: the embedding's backward too
      hg = jax.lax.cond(first, lambda: embed_grads(inputs_MBT[i], dx),
                        lambda: jax.tree.map(jnp.zeros_like, head_params))
      return dx, dict(grads, **_add({n: grads[n] for n in head_params}, hg))

    return jax.lax.cond(row["bwd_on"] == 1, run,
                        lambda g: (jnp.zeros(h.shape, h.dtype), g), grads)

  def forward(recv, dx, row, grads, loss):
    k, i = row["fwd_chunk"], row["fwd_mb"]
    zeros_kept = [jnp.zeros(a.shape, a.dtype) for a in kept]

    def idle(recv, dx, grads, loss):
      return jnp.zeros(h.shape, h.dtype), zeros_kept, dx, grads, loss

    def store(recv, dx, grads, loss):  # pp > 1: the first chunk (stage 0) embeds its input
      x = jax.lax.cond((s == 0) & (k == 0), lambda: parts.embed(params, inputs_MBT[i]),
                       lambda: recv)
      y, stored, _ = _vjp_stored(parts.chunk, chunk_params(k), x)
      return y, stored, dx, grads, loss

    def fused(recv, dx, grads, loss):  # the last chunk: forward, loss, backward
      x = parts.embed(params, inputs_MBT[i]) if pp == 1 else recv
      y, vjp = jax.vjp(parts.chunk, chunk_params(k), x)
      li, vjp_head = jax.vjp(lambda hp, y: parts.head(hp, y, targets_MBT[i]), head_params, y)
      hg, dy = vjp_head(jnp.ones_like(li) / m)
      dp, dx = vjp(dy)
      if pp == 1:  # the last chunk is also the first
        hg = _add(hg, embed_grads(inputs_MBT[i], dx))
      grads = _add_chunk(dict(grads, **_add({n: grads[n] for n in head_params}, hg)), k, dp)
      return jnp.zeros(h.shape, h.dtype), zeros_kept, dx, grads, loss + li / m

    branches = [idle, store, fused] if pp > 1 else [idle, idle, fused]  # pp = 1 never stores
    return jax.lax.switch(row["fwd_mode"], branches, recv, dx, grads, loss)

  ring = v > 1
  to_next = [(j, j + 1) for j in range(pp - 1)] + ([(pp - 1, 0)] if ring else [])
  to_prev = [(b, a) for a, b in to_next]

  def tick(carry, rows):
    recv_f, recv_b, slots, grads, loss = carry
    row = jax.tree.map(lambda a: a[s], rows)
    dx, grads = backward(recv_b, row, slots, grads)
    y, stored, dx, grads, loss = forward(recv_f, dx, row, grads, loss)
    slots = [a.at[row["fwd_slot"]].set(r) for a, r in zip(slots, stored)]
    if pp > 1:
      y = collectives.ppermute(y, PIPE, to_next, compression=_decided(y, fwd, pp, "pp/fwd"))
      dx = collectives.ppermute(dx, PIPE, to_prev, compression=_decided(dx, bwd, pp, "pp/bwd"))
    return (y, dx, slots, grads, loss), None

  zeros_h = jnp.zeros(h.shape, h.dtype)
  carry = (zeros_h, zeros_h, slots, grads, jnp.zeros((), jnp.float32))
  rows = jax.tree.map(jnp.asarray, t.rows())
  (_, _, _, grads, loss), _ = jax.lax.scan(tick, carry, rows)
  return loss, grads
