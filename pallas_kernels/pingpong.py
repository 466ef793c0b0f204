"""The GEMM core's ping-pong schedule (``gemm.Tiling(split="tiles")``): the two compute
warpgroups take an SM's output tiles in turns, each a whole ``[tile_m, tile_n]`` tile, so
that one warpgroup's epilogue runs while the other's wgmmas keep the tensor cores busy.

In the split schedule (``gemm.TileLoop``) both warpgroups multiply halves of one CTA tile
and finish it together, so the tensor cores wait while both run the epilogue: little for a
plain store, much for ``gelu_gemm``'s epilogues, which compute a GELU or its derivative
and write or read a second ``[M, N]`` array. Here the memory warpgroup streams the blocks
of the SM's tiles in order through one ring of ``stages`` shared-memory slots and signals
each load to the warpgroup whose tile it is (a barrier per warpgroup and slot, so each
waits on its own loads' phases only); the owner releases a slot once its wgmma has read
it. A warpgroup keeps one wgmma in flight across steps: no other fills the gaps between
its steps, as in the split schedule.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.pallas_kernels import gemm

# registers a thread: the memory warpgroup gives its own up to the compute warpgroups', as
# ``plgpu.emit_pipeline_warp_specialized`` does for the split schedule
MEMORY_REGISTERS, COMPUTE_REGISTERS = 40, 232


class PingPongLoop:
  """``gemm.TileLoop``'s counterpart for ``split="tiles"``: the same construction and
  ``allocations``; ``run`` takes the plain bf16 A operand and the epilogue's hooks only."""

  def __init__(self, tiling: gemm.Tiling, a_ops: list[gemm.Operand], w_dtype, k: int,
               transpose_w: bool = False):
    t = tiling
    if t.split != "tiles" or len(a_ops) != 1:
      raise ValueError("PingPongLoop: split='tiles' and one plain A operand only")
    self.t, self.k_iters, self.transpose_w = t, k // t.tile_k, transpose_w
    a_dtype = a_ops[0].dtype
    b_block = (t.tile_n, t.tile_k) if transpose_w else (t.tile_k, t.tile_n)
    self._types = dict(
        a=plgpu.SMEM((t.stages, t.tile_m, t.tile_k), a_dtype,
                     transforms=gemm.swizzled(t.tile_k, a_dtype)),
        b=plgpu.SMEM((t.stages, *b_block), w_dtype, transforms=gemm.swizzled(b_block[1], w_dtype)),
        # a warpgroup's slot holds its tile's A and B blocks: two copies arrive
        loaded=plgpu.Barrier(num_arrivals=2, num_barriers=gemm.COMPUTE_WGS * t.stages),
        consumed=plgpu.Barrier(num_barriers=t.stages))

  def allocations(self, *gmem_refs):
    return self._types

  def run(self, allocs, *, m: int, n: int, a_refs: Callable, w_ref, epilogue: Callable,
          before_tile: Callable | None = None):
    """Computes the ``[m, n]`` output tiles as ``TileLoop.run`` does, tile i of this SM's
    share on compute warpgroup i mod 2: ``before_tile(m_idx, n_idx, wg)``, then
    ``epilogue(m_idx, n_idx, wg, acc)`` with its fp32 ``[tile_m, tile_n]`` accumulator."""
    t, k_iters, stages = self.t, self.k_iters, self.t.stages
    grid = (m // t.tile_m, n // t.tile_n)
    tiles, wg = grid[0] * grid[1], lax.axis_index(gemm.WG)

    def coords(idx):
      return plgpu.planar_snake(idx, grid, "mn".index(t.grid_minor), t.grid_width)

    def slot(step):  # steps are counted over the SM's tiles: the ring's turns
      return lax.rem(step, stages)

    @pl.when(wg == gemm.COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      @gemm.dealt(tiles)
      def _tile(idx, i, count):
        m_idx, n_idx = coords(idx)
        a_ref, = a_refs(m_idx)
        cols = pl.ds(n_idx * t.tile_n, t.tile_n)
        owner = lax.rem(i, gemm.COMPUTE_WGS)

        def load(kk, _):
          step = i * k_iters + kk
          pl.when(step >= stages)(lambda: plgpu.barrier_wait(allocs["consumed"].at[slot(step)]))
          ks = pl.ds(kk * t.tile_k, t.tile_k)
          landed = allocs["loaded"].at[owner * stages + slot(step)]
          plgpu.copy_gmem_to_smem(a_ref.at[:, ks], allocs["a"].at[slot(step)], landed)
          w_block = w_ref.at[cols, ks] if self.transpose_w else w_ref.at[ks, cols]
          plgpu.copy_gmem_to_smem(w_block, allocs["b"].at[slot(step)], landed)
        lax.fori_loop(0, k_iters, load, None)

        @pl.when(i == count - 1)
        def _drain():  # the last turn of every slot consumed, before the ring goes
          end = count * k_iters
          for back in range(stages, 0, -1):
            pl.when(end - back >= 0)(
                lambda: plgpu.barrier_wait(allocs["consumed"].at[slot(end - back)]))

    @pl.when(wg < gemm.COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

      @gemm.dealt(tiles)
      def _tile(idx, i, count):
        @pl.when(lax.rem(i, gemm.COMPUTE_WGS) == wg)
        def _mine():
          m_idx, n_idx = coords(idx)
          if before_tile is not None:
            before_tile(m_idx, n_idx, wg)
          first = i * k_iters

          def mma(acc):
            def step(kk, acc):
              s = slot(first + kk)
              plgpu.barrier_wait(allocs["loaded"].at[wg * stages + s])
              b = allocs["b"].at[s]
              plgpu.wgmma(acc, allocs["a"].at[s], b.transpose((1, 0)) if self.transpose_w else b)
              plgpu.wgmma_wait(1)  # the last step's wgmma is done with its slot

              @pl.when(kk > 0)
              def _release():
                plgpu.barrier_arrive(allocs["consumed"].at[slot(first + kk - 1)])
              return acc
            acc = lax.fori_loop(0, k_iters, step, acc)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(allocs["consumed"].at[slot(first + k_iters - 1)])
            return acc[...]
          with jax.named_scope("mma"):
            acc = pl.run_scoped(mma, plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
          with jax.named_scope("epilogue"):
            epilogue(m_idx, n_idx, wg, acc)
