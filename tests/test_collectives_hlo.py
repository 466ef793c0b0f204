"""What goes on the wire: collectives and their payload bytes in the HLO.

Compressed collectives are checked in the *compiled* module (what really runs: one u8
transfer per message, codes and scales together, nothing wider). The CPU backend widens bf16
collectives to f32 when compiling, so the bf16 baseline is read from the *lowered* HLO.
Wire bytes per device are modelled from result sizes: all-gather and all-to-all move
about their result, reduce-scatter about N times its result, all-reduce twice its result
(ring), a collective-permute its result (the common (N-1)/N factor cancels in ratios).
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from taco_jax import CompressionConfig
from taco_jax import collectives as tc
from taco_jax import mappings as tm
from taco_jax.testing import hlo_collectives

N = 4
CFG = CompressionConfig(group_size=128)
RATIO = CFG.bits_per_element / 16  # 8.5 / 16 at G = 128
X = jnp.zeros((N * 64, 1024), jnp.bfloat16)  # local [64, 1024] bf16: 128 KiB per device


@functools.cache
def mesh():
  return jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])


def wire_bytes(ops):
  factor = {"all-gather": 1, "all-to-all": 1, "reduce-scatter": N, "all-reduce": 2,
            "collective-permute": 1}
  return sum(o["bytes"] * factor[o["op"]] for o in ops)


COLLECTIVES = {
    "all_gather": lambda x, c: tc.all_gather(x, "x", compression=c),
    "all_gather_last": lambda x, c: tc.all_gather(x, "x", axis=1, compression=c),
    "reduce_scatter": lambda x, c: tc.reduce_scatter(x, "x", compression=c),
    "reduce_scatter_last": lambda x, c: tc.reduce_scatter(x, "x", scatter_dimension=1,
                                                          compression=c),
    "all_reduce_two_shot": lambda x, c: tc.all_reduce(x, "x", compression=c),
    "ppermute": lambda x, c: tc.ppermute(x, "x", [(i, (i + 1) % N) for i in range(N)],
                                         compression=c),
}
PLAIN_OP = {"all_gather": "all-gather", "all_gather_last": "all-gather",
            "reduce_scatter": "reduce-scatter", "reduce_scatter_last": "reduce-scatter",
            "all_reduce_two_shot": "all-reduce", "all_reduce_one_shot": "all-reduce",
            "ppermute": "collective-permute"}


def lowered(fn, compression):
  f = jax.jit(jax.shard_map(lambda x: fn(x, compression), mesh=mesh(), in_specs=P("x"),
                            out_specs=P("x")))
  return f.lower(X)


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_compressed_moves_u8_at_8_5_over_16_of_bf16(name):
  plain = hlo_collectives(lowered(COLLECTIVES[name], None).as_text(dialect="hlo"))
  assert [(o["op"], o["dtypes"]) for o in plain] == [(PLAIN_OP[name], {"bf16"})]
  ops = hlo_collectives(lowered(COLLECTIVES[name], CFG).compile().as_text())
  # One transfer per message: the two-shot all-reduce's all-to-all + all-gather, else one.
  expected = ["all-to-all", "all-gather"] if name == "all_reduce_two_shot" else [
      {"reduce-scatter": "all-to-all"}.get(PLAIN_OP[name], PLAIN_OP[name])]
  assert [(o["op"], o["dtypes"]) for o in ops] == [(op, {"u8"}) for op in expected], ops
  ratio = wire_bytes(ops) / wire_bytes(plain)
  assert ratio == pytest.approx(RATIO, rel=0.02), (ratio, ops)


def test_one_shot_all_reduce_gathers_u8():
  name = "all_reduce_one_shot"
  fn = lambda x, c: tc.all_reduce(x, "x", compression=c, algorithm="one_shot")
  plain = hlo_collectives(lowered(fn, None).as_text(dialect="hlo"))
  assert [(o["op"], o["dtypes"]) for o in plain] == [(PLAIN_OP[name], {"bf16"})]
  ops = hlo_collectives(lowered(fn, CFG).compile().as_text())
  assert [(o["op"], o["dtypes"]) for o in ops] == [("all-gather", {"u8"})], ops
  # Every rank receives every rank's full message: N/2 times a ring all-reduce's bytes.
  assert wire_bytes(ops) / wire_bytes(plain) == pytest.approx(RATIO * N / 2, rel=0.02)


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_uncompressed_is_the_plain_lax_collective(name):
  text = lowered(COLLECTIVES[name], None).as_text(dialect="hlo")
  lax_fn = {"all_gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
            "all_gather_last": lambda x: jax.lax.all_gather(x, "x", axis=1, tiled=True),
            "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
            "reduce_scatter_last": lambda x: jax.lax.psum_scatter(
                x, "x", scatter_dimension=1, tiled=True),
            "all_reduce_two_shot": lambda x: jax.lax.psum(x, "x"),
            "ppermute": lambda x: jax.lax.ppermute(
                x, "x", [(i, (i + 1) % N) for i in range(N)])}[name]
  ref = lowered(lambda x, _: lax_fn(x), None).as_text(dialect="hlo")
  assert "f8" not in text and "u8[" not in text
  assert hlo_collectives(text) == hlo_collectives(ref)


def test_min_bytes_keeps_small_messages_plain():
  cfg = CompressionConfig(min_bytes=64 * 1024 * 2 + 1)  # just over the local message
  text = lowered(COLLECTIVES["all_gather"], cfg).as_text(dialect="hlo")
  assert [(o["op"], o["dtypes"]) for o in hlo_collectives(text)] == [("all-gather", {"bf16"})]


@pytest.mark.parametrize("bwd", [None, CFG])
def test_region_backward_compression_is_separate(bwd):
  """gather_from_sp with FP8 forward: the backward reduce-scatter is bf16 or u8 by bwd."""
  def loss(x):
    f = jax.shard_map(
        lambda x: tm.gather_from_sp(x, "x", axis=0, fwd_compression=CFG, bwd_compression=bwd),
        mesh=mesh(), in_specs=P("x"), out_specs=P("x"))
    return jnp.sum(f(x).astype(jnp.float32) ** 2)

  low = jax.jit(jax.grad(loss)).lower(X)
  ops = hlo_collectives(low.as_text(dialect="hlo"))
  ag = [o for o in ops if o["op"] == "all-gather"]
  assert [o["dtypes"] for o in ag] == [{"u8"}]  # forward: compressed
  if bwd is None:
    assert [o["dtypes"] for o in ops if o["op"] == "reduce-scatter"] == [{"bf16"}]
    assert not [o for o in ops if o["op"] == "all-to-all"]
  else:
    a2a = [o for o in ops if o["op"] == "all-to-all"]
    assert [o["dtypes"] for o in a2a] == [{"u8"}]
    assert not [o for o in ops if o["op"] == "reduce-scatter"]


def test_two_shot_with_fewer_rows_than_ranks_runs_one_shot():
  """Padding 1 row up to N rows would send more than one-shot does: one all-gather, no
  all-to-all."""
  f = jax.jit(jax.shard_map(lambda v: tc.all_reduce(v, "x", compression=CFG), mesh=mesh(),
                            in_specs=P("x"), out_specs=P()))
  ops = hlo_collectives(f.lower(jnp.ones((N, 256), jnp.bfloat16)).as_text(dialect="hlo"))
  assert {o["op"] for o in ops} == {"all-gather"}


def test_a_kernels_custom_call_text_is_not_read_as_a_collective():
  """A Mosaic GPU kernel's custom call carries its whole module as one string attribute:
  text in it that looks like a collective is not one. (Searching that text took minutes a
  step at TP=4.)"""
  module = "=(" * 5_000 + ' %x = bf16[4]{0} all-reduce(bf16[4]{0} %y)'
  kernel = (f'  %k = (bf16[8]{{0}}, u8[4]{{0}}) custom-call(bf16[8]{{0}} %p), '
            f'custom_call_target="mosaic_gpu_v2", backend_config={{module="{module}"}}')
  gather = ("  ROOT %all-gather-start.1 = (bf16[2,4]{1,0}, bf16[4,4]{1,0}) "
            "all-gather-start(bf16[2,4]{1,0} %k), replica_groups={{0,1}}, dimensions={0}")
  ops = hlo_collectives(f"{kernel}\n{gather}")
  assert [(o["op"], o["dtypes"]) for o in ops] == [("all-gather", {"bf16"})]


def test_kernel_scratch_inputs_name_each_kernels_scratch_and_its_maker():
  """`hlo.kernel_scratch_inputs`: per Mosaic GPU custom call, its last operand (the zeroed
  scratch jax passes last), the opcode that makes it and the instructions that read it;
  operands whose types hold commas or parentheses (a 2-D layout, a tuple) included."""
  from taco_jax.testing import hlo
  text = "\n".join([
      "  %zero = u32[8]{0} broadcast(u32[] %c0), dimensions={}",
      "  %shared = u32[8]{0} constant({0,0,0,0,0,0,0,0})",
      '  %k1 = (bf16[4]{0}, u32[8]{0}) custom-call(bf16[4,2]{1,0} %x, u32[8]{0} %zero), '
      'custom_call_target="mosaic_gpu_v2", backend_config={module="=(x) all-reduce("}',
      '  %k2 = (bf16[4]{0}, u32[8]{0}) custom-call((bf16[4]{0}, f32[]) %t, u32[8]{0} %shared), '
      'custom_call_target="mosaic_gpu_v2"',
      '  %other = bf16[4]{0} custom-call(bf16[4]{0} %x), custom_call_target="cublas"',
      '  ROOT %k3 = (bf16[4]{0}, u32[8]{0}) custom-call(bf16[4]{0} %x, u32[8]{0} %shared), '
      'custom_call_target="mosaic_gpu_v2"'])
  two = ["custom-call", "custom-call"]
  assert hlo.kernel_scratch_inputs(text) == [
      dict(kernel="%k1", scratch="%zero", producer="broadcast", reader_ops=["custom-call"]),
      dict(kernel="%k2", scratch="%shared", producer="constant", reader_ops=two),
      dict(kernel="%k3", scratch="%shared", producer="constant", reader_ops=two)]
