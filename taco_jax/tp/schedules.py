"""Static tick tables of the 1F1B and interleaved pipeline schedules (numpy; no JAX).

The model's layers form C = v * pp chunks in order; chunk c runs on stage c % pp as its
virtual chunk c // pp (v = 1: 1F1B, one chunk per stage; v > 1: the interleaved schedule).
All stages run the same program in lockstep ticks. In a tick each stage does at most one
chunk backward (first) and one chunk forward, then sends the forward's output to the next
stage and the backward's input gradient to the previous one (one ppermute each way, a
ring when v > 1). Micro-batch i = g pp + j (group g, 0 <= j < pp) starts at tick
g v pp + j and then never waits:

    forward of (i, c)   at tick  start(i) + c
    backward of (i, c)  at tick  start(i) + 2 (C - 1) - c

so every hand-off is consumed the tick after it was sent, and no two items meet on one
stage in one tick (their starts differ by less than v pp within a group, by at least v pp
across groups). The last chunk's forward, loss and backward run together ("fused"): the
last stage keeps nothing for them. Everything else keeps its chunk's residuals in a slot
from its forward to its backward. With v = 1, stage s keeps 2 (pp - 1 - s) micro-batches,
at most 2 (pp - 1) on stage 0, whatever m is (GPipe keeps all m): a lockstep hop costs a
whole tick (a forward and a backward), where Megatron's asynchronous 1F1B (pp on stage 0)
hops after one forward. Ticks cost F + B where both kinds run, so the idle share is
(pp - 1) / (v m + pp - 1) when pp divides m.
"""
from __future__ import annotations

import dataclasses

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved")  # parallel.schedule
# what a tick's forward does: nothing, keep residuals, keep them + loss + backward
IDLE, STORE, FUSED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Ticks:
  """Per tick and stage ([ticks, pp] int32 arrays), what the forward and backward do."""
  fwd_mode: np.ndarray   # IDLE | STORE | FUSED
  fwd_mb: np.ndarray     # micro-batch of the forward
  fwd_chunk: np.ndarray  # its virtual chunk on this stage (0 .. v-1)
  fwd_slot: np.ndarray   # residual slot it writes (slots: an unused scratch slot)
  bwd_on: np.ndarray     # 1: a backward (its cotangent arrived last tick), 0: none
  bwd_mb: np.ndarray
  bwd_chunk: np.ndarray
  bwd_slot: np.ndarray   # residual slot it reads (and frees)
  slots: int             # residual slots per stage (the most any stage keeps at once)

  @property
  def ticks(self) -> int:
    return self.fwd_mode.shape[0]

  def rows(self) -> dict:
    """The tables by name, for `jax.lax.scan` over ticks."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "slots"}


def start_tick(i: int, pp: int, v: int) -> int:
  return (i // pp) * v * pp + i % pp


def ticks(pp: int, v: int, m: int) -> Ticks:
  """The tick tables of `m` micro-batches through `v` chunks on each of `pp` stages."""
  c_last = v * pp - 1
  n = start_tick(m - 1, pp, v) + 2 * c_last + 1
  z = lambda: np.zeros((n, pp), np.int32)  # noqa: E731
  fmode, fmb, fchunk, fslot, bon, bmb, bchunk, bslot = (z() for _ in range(8))
  for i in range(m):
    t0 = start_tick(i, pp, v)
    for c in range(c_last + 1):
      s, k, tf = c % pp, c // pp, t0 + c
      assert fmode[tf, s] == IDLE, "two forwards meet"
      fmode[tf, s], fmb[tf, s], fchunk[tf, s] = (FUSED if c == c_last else STORE), i, k
      if c < c_last:
        tb = t0 + 2 * c_last - c
        assert not bon[tb, s], "two backwards meet"
        bon[tb, s], bmb[tb, s], bchunk[tb, s] = 1, i, k
  slots = _assign_slots(fmode, fmb, fchunk, fslot, bon, bmb, bchunk, bslot)
  fslot[fmode != STORE] = slots  # the scratch slot: written, never read
  return Ticks(fmode, fmb, fchunk, fslot, bon, bmb, bchunk, bslot, slots)


def _assign_slots(fmode, fmb, fchunk, fslot, bon, bmb, bchunk, bslot) -> int:
  """Fills the slot tables (a backward frees its slot before the same tick's forward takes
  the lowest free one); returns the most slots any stage uses."""
  most = 0
  for s in range(fmode.shape[1]):
    held, free, top = {}, [], 0
    for t in range(fmode.shape[0]):
      if bon[t, s]:
        bslot[t, s] = held.pop((bmb[t, s], bchunk[t, s]))
        free.append(bslot[t, s])
      if fmode[t, s] == STORE:
        free.sort()
        slot = free.pop(0) if free else top
        top = max(top, slot + 1)
        held[(fmb[t, s], fchunk[t, s])] = fslot[t, s] = slot
    most = max(most, top)
  return most


def kept_microbatches(t: Ticks) -> list[int]:
  """Per stage, the most (micro-batch, chunk) residual sets it keeps at once."""
  live = np.cumsum((t.fwd_mode == STORE).astype(int) - t.bwd_on, axis=0)
  return [int(x) for x in live.max(axis=0)]


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1,
                    backward_cost: float = 2.0) -> float:
  """Idle share of a stage's step with a backward costing `backward_cost` forwards:
  (pp - 1) / (m + pp - 1) for GPipe and 1F1B, (pp - 1) / (v m + pp - 1) interleaved when
  pp divides m (a lockstep tick lasts as long as its slowest stage's work)."""
  if schedule == "gpipe":
    return (pp - 1) / (m + pp - 1)
  t = ticks(pp, v, m)
  fwd, bwd = t.fwd_mode != IDLE, (t.bwd_on == 1) | (t.fwd_mode == FUSED)
  span = np.max(fwd + backward_cost * bwd, axis=1).sum() / v
  return 1 - m * (1 + backward_cost) / span
