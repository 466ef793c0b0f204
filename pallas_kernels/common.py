"""Constants and small pieces shared by the encode and decode kernels and references."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import pallas as pl
from jax.sharding import ManualAxisType
from jax.sharding import PartitionSpec as P

FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

# Clip ranges of the two scales, as in the TACO authors' kernels.
ALPHA_MIN, ALPHA_MAX = 1e-3, 1e3
SCALE_MIN, SCALE_MAX = 1e-12, 1e6


@functools.cache
def hadamard_matrix(group_size: int, repeat: int = 1) -> np.ndarray:
  """The Sylvester Hadamard matrix H_G (entries +-1, symmetric), float32.

  ``repeat=2`` repeats every row twice (``[2G, G]``), for ``hadamard_dot(two_term=True)``.
  """
  if group_size < 1 or group_size & (group_size - 1):
    raise ValueError(f"Hadamard size must be a power of two, got {group_size}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < group_size:
    h = np.block([[h, h], [h, -h]])
  return np.repeat(h, repeat, axis=0)


def pallas_call(kernel, operands, out_shape, *, interpret: bool, **kwargs):
  """``pl.pallas_call(kernel, out_shape=..., interpret=..., **kwargs)(*operands)`` that also
  runs inside ``jax.shard_map(check_vma=True)``: the outputs vary over the manual mesh axes
  that the operands vary over.

  ``out_shape``: a pytree of ``jax.ShapeDtypeStruct`` (shape and dtype only). Pallas cannot
  infer an output's varying axes from the kernel, so with ``check_vma=True`` each output must
  state them; a kernel's output varies wherever one of its operands does. Outside
  shard_map, or with ``check_vma=False``, no operand varies and this is the plain call.

  jax 0.11's interpreter (``interpret=True``) cannot run a kernel on varying operands: it
  evaluates the kernel's jaxpr, traced on unvarying blocks, on the varying ones, and each op
  that mixes the two (a block times a constant) fails the check. There the kernel runs in a
  nested ``shard_map`` over no new axes with ``check_vma=False`` (the workaround JAX's own
  error suggests, scoped to the kernel), and its outputs are cast back to varying (``pcast``
  compiles to nothing). The compiled (Triton) kernel needs no such detour.
  """
  varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in operands))

  def call(out):
    return pl.pallas_call(kernel, out_shape=out, interpret=interpret, **kwargs)

  if not (interpret and varying):
    mat = ManualAxisType(varying=varying)
    typed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat),
                         out_shape)
    return call(typed)(*operands)

  def unchecked(*operands):
    # Under check_vma=False an op's output varies over nothing; reshape is one such op (a
    # round trip that XLA removes), which hands the interpreter unvarying operands.
    operands = [jax.lax.reshape(jax.lax.reshape(x, (1, *x.shape)), x.shape) for x in operands]
    return call(out_shape)(*operands)

  outs = jax.shard_map(unchecked, in_specs=(P(),) * len(operands), out_specs=P(),
                       axis_names=frozenset(), check_vma=False)(*operands)
  return jax.lax.pcast(outs, tuple(sorted(varying, key=str)), to="varying")


def hopper_problem() -> str | None:
  """Why no Mosaic GPU kernel of ours runs in this process (no GPU, or not a Hopper one:
  they are written for sm_90's wgmma and TMA), or None."""
  if jax.default_backend() != "gpu":
    return f"no GPU (backend {jax.default_backend()!r}); the kernels are Mosaic GPU"
  cc = getattr(jax.devices()[0], "compute_capability", "9.0")
  if not str(cc).startswith("9"):
    return f"{jax.devices()[0].device_kind} (sm_{cc}) is not a Hopper GPU (sm_90)"
  return None


# Triton stages the transform's H operand in shared memory (227 KiB a CTA on Hopper): H of
# G = 512, or the two-term H of fp32 inputs at G = 256 ([2G, G] bf16), does not fit.
MAX_H_BYTES = 128 * 1024
_warned: set[tuple[str, str]] = set()


def warn_once(reason: str, message: str, *args) -> None:
  """``logging.warning(message, *args)``, once per message and ``reason`` in this process:
  a fallback is decided each time a step is traced, and said once (a reason shared by two
  messages still says both)."""
  if (message, reason) not in _warned:
    _warned.add((message, reason))
    logging.warning(message, *args)


def warned(message: str) -> list[str]:
  """The reasons for which `warn_once` has said ``message`` in this process."""
  return sorted(reason for said, reason in _warned if said == message)


def transform_misfit(group_size: int, hadamard: bool, dtype=jnp.bfloat16) -> str | None:
  """Why a compiled codec kernel cannot hold the Hadamard matrix for inputs of ``dtype``
  (fp32 ones need ``hadamard_dot``'s two-term H), or None when it can."""
  if not hadamard:
    return None
  h_bytes = 2 * group_size * group_size * (1 + needs_two_terms(dtype))
  if h_bytes <= MAX_H_BYTES:
    return None
  return (f"the Hadamard matrix for {jnp.dtype(dtype).name} values at G={group_size} takes "
          f"{h_bytes >> 10} KiB of shared memory, over the kernels' {MAX_H_BYTES >> 10} KiB")


def dispatch(what: str, implementation: str, table: dict, *args, kernel_kwargs: dict,
             dtype=jnp.bfloat16, **kwargs):
  """``table[implementation](*args, **kwargs)``: the one dispatcher of the codec's entry
  points, ``table`` being ``{"xla": reference, "pallas": kernel}``; the kernel also gets
  ``kernel_kwargs`` (``interpret`` and its tiling), which the reference has no use for.
  Where the compiled kernel cannot hold the transform (``transform_misfit`` for values of
  ``dtype``) the reference runs instead, and says so once."""
  if implementation not in table:
    raise NotImplementedError(f"{what} implementation {implementation!r}")
  compiled = implementation == "pallas" and not kernel_kwargs.get("interpret")
  if compiled and (problem := transform_misfit(kwargs["group_size"], kwargs["hadamard"],
                                               dtype)):
    warn_once(problem, "the codec runs as its XLA reference, not the Pallas kernel: %s",
              problem)
    implementation = "xla"
  extra = kernel_kwargs if implementation == "pallas" else {}
  return table[implementation](*args, **kwargs, **extra)


def check_2d(x, group_size: int, what: str) -> None:
  if x.ndim != 2 or x.shape[1] % group_size:
    raise ValueError(
        f"{what} expects [rows, groups * {group_size}], got shape {x.shape}")


# jax 0.11 warns once per pallas_call site that its Triton backend is deprecated. The
# backend is an implementation detail behind `implementation="pallas"`; keep the noise out.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)


def row_mask(rows: int, shape):
  """Inside a kernel: True for the tile's rows (axis 0 of ``shape``, tiles along grid axis 0)
  that lie inside the array's ``rows`` (the last row block may overhang)."""
  row_ids = pl.program_id(0) * shape[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  return row_ids < rows


def hadamard_dot(u_MG, h_GG, *, two_term: bool = False):
  """``u_MG @ H_G`` with bf16 operands and fp32 accumulation: the transform of both codecs.

  The kernels and the references call this same function, so they compute the transform
  identically. bf16 operands run on tensor cores on GPU; H's entries are exact in bf16 and
  the products are exact, so the dot is exact up to the fp32 sum when ``u`` is
  bf16-exact (bf16 inputs, fp8 codes). Otherwise (``two_term``, e.g. fp32 inputs) ``u`` is
  split as ``hi + lo`` (two bf16 terms, 16 significant bits, relative error <= 2^-17) and
  ``[hi_0, lo_0, hi_1, lo_1, ...] @ [H_0; H_0; H_1; H_1; ...]`` runs as one dot
  (``h_GG`` must then be ``hadamard_matrix(G, repeat=2)``, shape ``[2G, G]``).
  """
  if not two_term:
    return jnp.dot(u_MG.astype(jnp.bfloat16), h_GG.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
  m, g = u_MG.shape
  hi_MG = u_MG.astype(jnp.bfloat16)
  lo_MG = (u_MG - hi_MG.astype(jnp.float32)).astype(jnp.bfloat16)
  u_M2G = jnp.stack([hi_MG, lo_MG], axis=-1).reshape(m, 2 * g)
  return jnp.dot(u_M2G, h_GG.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def sum_of_squares(xb_MG, *, fixed_order: bool = True):
  """Per-row sum of squares of bf16-exact values (the squares are exact in fp32).

  ``fixed_order``: ``pairwise_sum``'s order, so the reference and the kernel in interpret
  mode agree bit for bit. The compiled GPU kernel passes False and lets Triton reduce in
  its own tree order: the fixed order costs 2.6x the whole encode there (its reshapes
  shuffle registers through shared memory; measured in docs/codec.md), and a different
  fp32 summation order moves alpha by a few ulps at most.
  """
  sq_MG = xb_MG * xb_MG
  return pairwise_sum(sq_MG) if fixed_order else jnp.sum(sq_MG, axis=-1)


def needs_two_terms(dtype) -> bool:
  """Whether values of ``dtype`` lose bits when cast to bf16 (see ``hadamard_dot``)."""
  return jnp.finfo(dtype).nmant > jnp.finfo(jnp.bfloat16).nmant


def pow2_floor_f32(v):
  """2^floor(log2 v) for positive normal fp32 ``v``, exactly (masks the mantissa bits)."""
  bits = jax.lax.bitcast_convert_type(v, jnp.int32)
  return jax.lax.bitcast_convert_type(bits & jnp.int32(0x7F800000), jnp.float32)


def pow2_ceil(n: int) -> int:
  return 1 << (max(int(n), 1) - 1).bit_length()


def choose_blocks(rows: int, groups: int, block_rows: int, block_groups: int,
                  min_groups: int = 16):
  """Power-of-two tile ``[block_rows, block_groups * G]`` for ``rows x groups`` groups.

  ``block_groups`` is the largest power of two <= the request that divides ``groups`` (so
  no tile straddles the end of a row); ``block_rows`` is cut to cover ``rows`` but kept
  large enough that a tile holds >= ``min_groups`` groups (Triton's dot needs M >= 16);
  rows past the end are masked.
  """
  if block_rows < 1 or block_rows & (block_rows - 1):
    raise ValueError(f"block_rows must be a power of two, got {block_rows}")
  if block_groups < 1 or block_groups & (block_groups - 1):
    raise ValueError(f"block_groups must be a power of two, got {block_groups}")
  bk = min(block_groups, groups & -groups)  # groups & -groups: largest pow2 dividing it
  br = min(block_rows, pow2_ceil(rows))
  br = max(br, pow2_ceil(-(-min_groups // bk)))
  return br, bk


def pairwise_sum(v_MG):
  """Sums the rows of ``v_MG`` in a fixed pairwise tree (adjacent pairs first).

  ``jnp.sum``'s order is the compiler's choice (XLA CPU picks it by shape, Triton by
  layout); this order is part of the spec, so the kernel in interpret mode and the
  reference agree bit for bit. The last dim must be a power of two.
  """
  m, g = v_MG.shape
  while g > 1:
    g //= 2
    # An explicit add of the two halves of each pair, not a reduce: XLA would merge
    # chained reduces into one and pick its own order again.
    a_MG1, b_MG1 = jnp.split(v_MG.reshape(m, g, 2), 2, axis=-1)
    v_MG = (a_MG1 + b_MG1).reshape(m, g)
  return v_MG.reshape(m)


def hadamard_iota(group_size: int, repeat: int = 1):
  """H_G built in registers from iotas: H[i, j] = (-1)^popcount(i & j), as bf16.

  Equal to ``hadamard_matrix(group_size, repeat)`` entry for entry (``repeat`` is 1 or 2);
  lets a kernel skip loading H from memory.
  """
  shape = (repeat * group_size, group_size)
  rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  if repeat == 2:
    rows = jax.lax.shift_right_logical(rows, jnp.int32(1))
  v = rows & jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  shift = 16
  while shift:
    v = v ^ jax.lax.shift_right_logical(v, jnp.int32(shift))
    shift //= 2
  return (1 - 2 * (v & 1)).astype(jnp.float32).astype(jnp.bfloat16)
