"""The SM clock and the GPU's timer read from inside a stream of kernels.

NVML samples the clock from the host every few ms and CUPTI times kernels from outside, so
neither says what a GEMM in a sequence ran at (docs/measurements.md, "What slows them").
Two probes read the GPU's own counters, the SM's cycle counter (``%clock64``) and the global
nanosecond timer (``%globaltimer``):

* ``stamp(dep)`` / ``between(before, after_input)``: a one-CTA Mosaic GPU kernel that spins
  for ``spin_ns`` between two kernels; it returns int32 ``[cycles, ns, start ns]`` (low 32
  bits), ``mhz`` the clock. It reads the clock of a GPU that has just gone quiet (a GEMM's
  own clock is lower), and its start times place the kernels around it on the GPU's timer.
* ``clocked_store()``: the GEMM core's plain store, stamping each tile as its pipeline
  starts and its epilogue ends; ``tile_clocks`` gives the SMs' clock while the GEMM ran,
  the tiles' time and the span of the GEMM's work on the GPU's timer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SPIN_NS = 10_000


def _clock64():
  """Mosaic GPU code: the SM's cycle counter, as an i64 (``utils.globaltimer``'s twin)."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils
  return utils.inline_ptx("mov.u64 $0, %clock64;", result_types=ir.IntegerType.get_signless(64),
                          has_side_effects=True)


def _spin_and_store(spin_ns: int, out_ref) -> None:
  """Mosaic GPU code: read both counters, spin, read them again, store the differences."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf
  from jax.experimental.mosaic.gpu import utils
  i32, i64, index = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                     ir.IndexType.get())
  t0, c0 = utils.globaltimer(), _clock64()
  spin = scf.WhileOp([i64], [t0])
  before = spin.before.blocks.append(i64)
  with ir.InsertionPoint(before):
    now = utils.globaltimer()
    waiting = arith.cmpi(arith.CmpIPredicate.ult, arith.subi(now, t0),
                         arith.constant(i64, spin_ns))
    scf.condition(waiting, [now])
  after = spin.after.blocks.append(i64)
  with ir.InsertionPoint(after):
    scf.yield_([after.arguments[0]])
  t1, c1 = utils.globaltimer(), _clock64()
  with utils.single_thread():
    for i, value in enumerate((arith.subi(c1, c0), arith.subi(t1, t0), t0)):
      memref.store(arith.trunci(i32, value), out_ref, [arith.constant(index, i)])


def stamp(dep: jax.Array, spin_ns: int = SPIN_NS) -> jax.Array:
  """int32 ``[cycles, ns, start ns (low 32 bits)]`` of a ``spin_ns`` spin, launched once
  ``dep`` is computed (it is passed, not read)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if spin_ns <= 0:
    raise ValueError(f"sm_clock.stamp: spin_ns must be positive, not {spin_ns}")

  def body(dep_ref, out_ref):
    del dep_ref

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def spin(ctx, out):
      del ctx
      _spin_and_store(spin_ns, out)
    spin(out_ref)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((3,), jnp.int32),
                      kernel_name="sm_clock_stamp")(dep)


def between(before: jax.Array, after_input, spin_ns: int = SPIN_NS):
  """``(after_input, stamp)``: a stamp launched once ``before`` is computed, and
  ``after_input`` held back until the stamp is done, so that whatever reads it starts after
  the stamp."""
  s = stamp(before, spin_ns)
  return jax.lax.optimization_barrier((after_input, s))


def mhz(stamps) -> list[float]:
  """The SM clock in MHz of each stamp (rows of ``[cycles, ns, start]``)."""
  import numpy as np
  s = np.asarray(stamps, dtype=np.int64).reshape(-1, 3)
  return [round(1e3 * c / ns, 1) if ns > 0 else float("nan") for c, ns, _ in s]


def _stamp_now(out_ref, copy=None) -> None:
  """Mosaic GPU code: one thread of the warpgroup stores ``[%clock64, %globaltimer]`` (low
  32 bits each) and the SM's id; with ``copy=(src, dst)`` it also copies 3 values from src
  to dst (a stamp kept in shared memory to its place in the output)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref
  from jax.experimental.mosaic.gpu import utils
  i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
  clock, now = _clock64(), utils.globaltimer()
  with utils.single_thread(scope=utils.ThreadSubset.WARPGROUP):
    for i, value in enumerate((arith.trunci(i32, clock), arith.trunci(i32, now),
                               utils.smid())):
      memref.store(value, out_ref, [arith.constant(index, i)])
    if copy is not None:
      src, dst = copy
      for i in range(3):
        idx = [arith.constant(index, i)]
        memref.store(memref.load(src, idx), dst, idx)


def clocked_store():
  """``gemm.Store`` that also stamps each warpgroup tile as its pipeline starts and as its
  epilogue ends: a second output ``[M, N / tile_n * 6]`` int32 whose row ``row`` (a tile's
  first) holds, per column tile, ``[clock, ns, SM]`` at its end, then at its start
  (``tile_clocks`` reads them). The same SM's consecutive tiles give its clock while the
  GEMM ran, which a stamp between kernels cannot see, and the stamps' span against the
  kernel's time says how long it spent outside its tiles."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from taco_jax.pallas_kernels import gemm

  def at(t, outs, row, col, which):
    if t.tile_n != gemm.Tiling().tile_n:
      raise ValueError(f"clocked_store: tiles of {t.tile_n} columns, not the default's")
    return outs[1].at[row, pl.ds(col // t.tile_n * 6 + 3 * which, 3)]

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def stamp_start(ctx, smem):
    del ctx
    _stamp_now(smem)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
  def stamp_end(ctx, end, start, smem):
    del ctx
    _stamp_now(end, copy=(smem, start))

  @jax.tree_util.register_pytree_node_class
  class ClockedStore(gemm.Store):
    name = "_clocked"

    def outputs(self, m, n, dtype):
      return (*super().outputs(m, n, dtype),
              jax.ShapeDtypeStruct((m, n // gemm.Tiling().tile_n * 6), jnp.int32))

    def scratch(self, t):
      return dict(clock_smem=plgpu.SMEM((gemm.COMPUTE_WGS, 3), jnp.int32))

    def before_tile(self, t, ins, scratch, row, col, wg):
      stamp_start(scratch["clock_smem"].at[wg])

    def store(self, t, ins, outs, scratch, acc, row, col, wg):
      super().store(t, ins, outs, scratch, acc, row, col, wg)
      stamp_end(at(t, outs, row, col, 0), at(t, outs, row, col, 1),
                scratch["clock_smem"].at[wg])
  return ClockedStore()


def tile_clocks(stamps, tile_m: int = 128) -> dict:
  """From ``clocked_store``'s stamps of one GEMM: the SM clock between each SM's
  consecutive tile ends, in MHz (median, 10th percentile, min over the SMs' windows); a
  tile's median time from its pipeline's start to its epilogue's end (``tile_us``); and the
  span from the first tile's start to the last tile's end (``span_us``), which a kernel's
  own time exceeds by what it spends outside its tiles (launch, set-up, the last stores);
  that span's ends on the global timer (low 32 bits, as ``stamp``'s start)."""
  import numpy as np
  s = np.asarray(stamps, dtype=np.int64)[::tile_m].reshape(-1, 6) & 0xFFFFFFFF
  clock, ns, sm, start_ns = s[:, 0], s[:, 1], s[:, 2], s[:, 4]
  rates = []
  for one in np.unique(sm):
    order = np.argsort(ns[sm == one])
    c, t = clock[sm == one][order], ns[sm == one][order]
    dc, dt = (c[1:] - c[:-1]) % 2**32, (t[1:] - t[:-1]) % 2**32
    rates += [1e3 * a / b for a, b in zip(dc, dt) if b > 0]
  rates = np.asarray(rates) if rates else np.asarray([np.nan])
  first = start_ns.min()
  span = int(((ns - first) % 2**32).max())
  return dict(median_mhz=round(float(np.median(rates)), 1),
              p10_mhz=round(float(np.percentile(rates, 10)), 1),
              min_mhz=round(float(rates.min()), 1), sms=int(len(np.unique(sm))),
              tile_us=round(float(np.median((ns - start_ns) % 2**32)) / 1e3, 2),
              span_us=round(span / 1e3, 1), first_start_ns=int(first),
              last_end_ns=(int(first) + span) % 2**32)
