"""The SM clock at a point in a stream of kernels, read by a kernel of its own.

NVML samples the clock from the host every few ms, so it cannot say what the clock was
while one GEMM of a sequence ran (docs/measurements.md, "In sequences of kernels"). This
tiny Mosaic GPU kernel (one CTA) reads the SM's cycle counter (``%clock64``) and the
global nanosecond timer (``%globaltimer``) as it starts, spins for ``spin_ns``, and reads
both again: cycles over nanoseconds is the SM clock at that point of the stream. Put
between two kernels (``between``), it stamps the clock the first ran at as the second
starts; 10 us of one busy SM barely gaps the stream.

``stamp(dep)`` returns int32 ``[cycles, ns, start_ns_low_bits]``; ``mhz(stamp)`` the clock.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SPIN_NS = 10_000


def _spin_and_store(spin_ns: int, out_ref) -> None:
  """Mosaic GPU code: read both counters, spin, read them again, store the differences."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf
  from jax.experimental.mosaic.gpu import utils
  i32, i64, index = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                     ir.IndexType.get())

  def clock():
    return utils.inline_ptx("mov.u64 $0, %clock64;", result_types=i64, has_side_effects=True)
  t0, c0 = utils.globaltimer(), clock()
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
  t1, c1 = utils.globaltimer(), clock()
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
