"""Fused collective-matmul kernels (`pallas_kernels.ag_matmul`, `matmul_rs`) and the layers'
custom VJPs over them (`taco_jax.tp.fused`).

On CPU the kernels run in jax's Mosaic GPU interpret mode, one rank at a time in local mode
(the interpreter simulates no peer copies): what a rank computes and what it sends where,
against the pure-jnp references. The compressed all-gather kernel decodes into a register
operand of the wgmma, which the interpreter does not take; its decode is tested on its own
and the whole kernel lowers for sm_90 here and runs on the GPU (`bench_collective_matmul`
checks it against its reference). The custom VJPs are checked on the XLA path against the
regions they replace.
"""
import contextlib
import dataclasses
import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from taco_jax.pallas_kernels import (ag_matmul, all_to_all_matmul, common, exchange, gelu_gemm,
                                     gemm, matmul_all_to_all, matmul_rs, qkv_gemm)
from taco_jax.pallas_kernels.decode import decode_reference, group_multiplier
from taco_jax.pallas_kernels.encode import encode_reference
from taco_jax import collectives, mappings, testing
from taco_jax.codec import CompressionConfig
from taco_jax.tp import fused, overlap

# small tiles the interpreter runs quickly; a chunk is one row tile
TILING = gemm.Tiling(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32)
FP8 = dict(group_size=64, fmt="e4m3", dual_scale=True, lam=1e-6)


@contextlib.contextmanager
def _interpret(detect_races: bool = False):
  """jax's Mosaic GPU interpreter; ``detect_races``: under its happens-before race detector,
  failing the test on any data race it finds in the kernels run inside."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
  if detect_races:
    interpreter.reset_gpu_interpret_mode_state()
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=detect_races)):
    yield
  if detect_races:
    assert not interpreter.get_races().races_found


def _bf16(key, shape, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "w_transposed"])
def test_all_gather_matmul_kernel_per_rank(transpose_w):
  """Each rank's output rows equal the gathered x @ w (fp32 accumulation, bf16 out), its
  own chunk lands in the gathered x, and it forwards every chunk but the one rank r - 1
  started from to rank r - 1. Two by two output tiles per chunk: the tile order
  (``plgpu.planar_snake``) visits each once. Under the race detector, which found the copy
  to the peer of a tile's last A block (released by the pipeline as the tile ends)
  overwritten by the next tile's first. The warpgroups split the rows, as the layers'
  tiles do (``ag_matmul.WIDE``). The weight comes ``[K, N]``, or ``[N, K]`` as the backward
  pass holds it (``transpose_w``)."""
  n, b, s, k, nout = 2, 2, 128, 128, 128
  tiling = dataclasses.replace(TILING, split="m")
  kx, kw = jax.random.split(jax.random.key(1))
  x_full = _bf16(kx, (b, n * s, k))
  w = _bf16(kw, (k, nout), k ** -0.5)
  ref = jnp.einsum("btk,kn->btn", x_full, w, preferred_element_type=jnp.float32)
  with _interpret(detect_races=True):
    for r in range(n):
      x_r = x_full[:, r * s:(r + 1) * s]
      y, xg, sent = ag_matmul.all_gather_matmul(
          x_r, w.T if transpose_w else w, "t", tiling=tiling, num_sms=1,
          transpose_w=transpose_w, rank=r, local_gathered=x_full)
      np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(
          ref.astype(jnp.bfloat16), np.float32), rtol=1e-2, atol=1e-2)
      own = slice(r * s, (r + 1) * s)
      np.testing.assert_array_equal(xg[:, own], x_r)
      for c in (r + i for i in range(n - 1)):  # chunks r, ..., r + n - 2 go on to r - 1
        chunk = slice((c % n) * s, (c % n + 1) * s)
        np.testing.assert_array_equal(sent[:, chunk], x_full[:, chunk])


@pytest.mark.parametrize("cluster_n", [1, 2], ids=["ring", "pulled"])
def test_all_gather_matmul_kernel_epilogues_per_rank(cluster_n):
  """With the GELU GEMMs' epilogues (`gelu_gemm.BiasGelu`, `GeluGrad`) in place of the plain
  store, each rank's rows of h and gelu(h), and of the GELU's gradient, are their
  references on the gathered input (the MLP-in's forward, and the MLP-out's backward with
  its weight read transposed), and its own chunk is in the gathered input. The GELU gradient's h
  rows are read at the gathered rows the ring computes, chunk by chunk, and the bias's
  gradient it sums is the reference's. Under the race detector: its h tiles are loaded
  while the last tile's product is still being stored. With the QKV split's
  (`qkv_gemm.SplitHeads`), its rows of q, k and v are the reference's."""
  n, b, s, k, f = 2, 2, 128, 128, 256
  tiling = dataclasses.replace(TILING, split="m", cluster_n=cluster_n)
  ks = jax.random.split(jax.random.key(4), 7)
  w_qkv, b_qkv = _bf16(ks[5], (k, 384), k ** -0.5), jax.random.normal(ks[6], (384,))
  x_full, dy_full = _bf16(ks[0], (b, n * s, k)), _bf16(ks[1], (b, n * s, k))
  w_in, w_out = _bf16(ks[2], (k, f), k ** -0.5), _bf16(ks[3], (f, k), k ** -0.5)
  bias = jax.random.normal(ks[4], (f,), jnp.float32)
  want_h, want_a = gelu_gemm.matmul_bias_gelu_reference(x_full, w_in, bias)
  want_dh, want_db = gelu_gemm.matmul_gelu_grad_reference(dy_full, w_out, want_h)
  kw = dict(tiling=tiling, num_sms=2 * cluster_n)
  close = functools.partial(np.testing.assert_allclose, rtol=2e-2, atol=2e-2)
  with _interpret(detect_races=cluster_n == 1):
    for r in range(n):
      own = slice(r * s, (r + 1) * s)
      h, a, xg, *_ = ag_matmul.all_gather_matmul(
          x_full[:, own], w_in, "t", rank=r, local_gathered=x_full,
          epilogue=gelu_gemm.BiasGelu(bias), **kw)
      close(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
      close(np.asarray(a, np.float32), np.asarray(want_a, np.float32))
      np.testing.assert_array_equal(xg[:, own], x_full[:, own])
      grad = gelu_gemm.GeluGrad(want_h)
      dh, db_rows, dyg, *_ = ag_matmul.all_gather_matmul(
          dy_full[:, own], w_out, "t", transpose_w=True, rank=r, local_gathered=dy_full,
          epilogue=grad, **kw)
      close(np.asarray(dh, np.float32), np.asarray(want_dh, np.float32))
      assert db_rows.shape == (b * n * s // gelu_gemm.BIAS_ROWS, f)
      close(grad.bias_gradient((dh, db_rows)), want_db)
      np.testing.assert_array_equal(dyg[:, own], dy_full[:, own])
      *qkv, _ = ag_matmul.all_gather_matmul(
          x_full[:, own], w_qkv, "t", rank=r, local_gathered=x_full,
          epilogue=qkv_gemm.SplitHeads(b_qkv, 64), **kw)
      for got, want in zip(qkv, qkv_gemm.matmul_bias_split_reference(x_full, w_qkv, b_qkv,
                                                                     head_dim=64)):
        assert got.shape == (b, n * s, 128)
        close(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("n,cluster_n,sms,nout,b,races", [
    (2, 2, 2, 512, 2, True), (3, 4, 4, 512, 1, False), (2, 2, 8, 256, 3, True)],
    ids=["2_ranks_clusters_of_2", "3_ranks_clusters_of_4", "2_ranks_4_clusters_turns"])
def test_pulled_all_gather_matmul_kernel_per_rank(n, cluster_n, sms, nout, b, races):
  """The pulled schedule (clusters of CTAs along N sharing each A block): each rank's output
  rows equal the gathered x @ w, and its gathered x holds every chunk, its own from x and
  the peers' from where a peer's x stands in (local mode: the pre-gathered x, whose own
  chunk is garbled here, so a rank that read its own rows from there would fail). Clusters
  of 2 cover half a row (each row tile is read twice), clusters of 4 all of it. Four
  clusters, a multiple of the ranks, take turns between the chunks: 6 row tiles make one
  whole round of the deal and a part of one. Under the race detector (the blocks, shared by
  a cluster, are copied out as the ring's are): the turns, each tile a pipeline of its own
  (6 tiles on 4 clusters), and clusters of 2, each cluster's 8 tiles one chained pipeline
  (``Tiling.chain``)."""
  s, k = 64, 128
  kx, kw = jax.random.split(jax.random.key(2))
  x_full = _bf16(kx, (b, n * s, k))
  w = _bf16(kw, (k, nout), k ** -0.5)
  want = jnp.einsum("btk,kn->btn", x_full, w, preferred_element_type=jnp.float32)
  tiling = dataclasses.replace(TILING, cluster_n=cluster_n)
  with _interpret(detect_races=races):
    for r in range(n):
      own = slice(r * s, (r + 1) * s)
      x_r = x_full[:, own]
      stand_in = x_full.at[:, own].set(jnp.nan)
      y, xg = ag_matmul.all_gather_matmul(x_r, w, "t", tiling=tiling, num_sms=sms, rank=r,
                                          local_gathered=stand_in)
      np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(
          want.astype(jnp.bfloat16), np.float32), rtol=1e-2, atol=1e-2)
      np.testing.assert_array_equal(xg, x_full)


@pytest.mark.parametrize("split,sms,cluster_n,n,k,chain,transpose_w", [
    ("n", 1, 1, 256, 192, True, False), ("m", 3, 1, 256, 128, True, True),
    ("n", 3, 1, 256, 128, False, True), ("n", 4, 2, 512, 128, True, False),
    ("m", 4, 4, 512, 128, True, False)])
def test_gemm_core_alone_is_the_matmul(split, sms, cluster_n, n, k, chain, transpose_w):
  """``gemm.matmul``, the yardstick of the kernels' GEMM core: fp32-accumulated a @ w in
  bf16, over tiles dealt to 1 or 3 SMs (3 leaves one SM a tile fewer), or in clusters of 2
  or 4 CTAs along N that share each A block (multicast); each SM's tiles in one chained
  pipeline (two steps of two stages each), or a pipeline per tile (three steps, which
  do not chain, or ``chain=False``); w given ``[N, K]`` and read transposed
  (``transpose_w``), as the backward kernels take it."""
  m = 256
  ka, kw = jax.random.split(jax.random.key(7))
  a, w = _bf16(ka, (m, k)), _bf16(kw, (k, n), k ** -0.5)
  tiling = dataclasses.replace(TILING, split=split, cluster_n=cluster_n, chain=chain)
  loop = gemm.TileLoop(tiling, [], jnp.bfloat16, k)
  tiles = m // tiling.cta_m * n // (tiling.cta_n * cluster_n)
  assert loop.chains(tiles, gemm.clusters(sms, cluster_n)) == (chain and k == 128)
  with _interpret():
    y = gemm.matmul(a, w.T if transpose_w else w, tiling=tiling, num_sms=sms,
                    transpose_w=transpose_w)
  want = jnp.dot(a, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2, atol=1e-2)
  with pytest.raises(ValueError, match="do not contract"):
    gemm.matmul(a, w[:64], tiling=tiling, num_sms=sms)


def test_gemm_core_keeps_leading_dimensions():
  """``gemm.matmul`` of a ``[B, S, K]`` takes its B S rows and returns ``[B, S, N]``: the same
  values as the ``[B S, K]`` product."""
  ka, kw = jax.random.split(jax.random.key(8))
  a, w = _bf16(ka, (2, 64, 128)), _bf16(kw, (128, 128), 128 ** -0.5)
  with _interpret():
    y = gemm.matmul(a, w, tiling=TILING, num_sms=2)
    flat = gemm.matmul(a.reshape(128, 128), w, tiling=TILING, num_sms=2)
  assert y.shape == (2, 64, 128)
  np.testing.assert_array_equal(np.asarray(y.reshape(128, 128)), np.asarray(flat))
  want = jnp.einsum("bsk,kn->bsn", a, w, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)


def _partials(n, b, s, f, d, seed):
  ky, kw = jax.random.split(jax.random.key(seed))
  ys = [_bf16(jax.random.fold_in(ky, p), (b, n * s, f)) for p in range(n)]
  ws = [_bf16(jax.random.fold_in(kw, p), (f, d), f ** -0.5) for p in range(n)]
  return ys, ws


def _exchange(n, fp8, ys, ws, slots, tiling=TILING, num_sms=1, pull_depth=2,
              detect_races=False, **options):
  """Runs every rank twice in local mode: first to collect what each sends to whom, then
  with the partials its peers sent it. Returns each rank's output and what it sent."""
  run = functools.partial(matmul_rs.matmul_reduce_scatter, axis_name="t", tiling=tiling,
                          num_sms=num_sms, n=n, fp8=fp8, pull_depth=pull_depth, **options)
  with _interpret(detect_races):
    sent = [run(ys[p], ws[p], rank=p, received=slots)[1] for p in range(n)]
    outs = []
    for r in range(n):
      received = tuple(jnp.stack([sent[p][i][r] for p in range(n)]) for i in range(len(slots)))
      outs.append(run(ys[r], ws[r], rank=r, received=received)[0])
  return outs, sent


# two slabs of epilogue rows per tile: four sub-tiles, so that three ranks read eight
# received sub-tiles (plain) or four slabs (FP8) through the kernels' receive slots
TALL = dataclasses.replace(TILING, tile_m=128)


@pytest.mark.parametrize("n,tiling,b,s,depth,options", [
    (2, TILING, 2, 64, 2, dict(transpose_w=True)), (3, TALL, 1, 128, 3, {}),
    (2, TALL, 1, 128, 2, dict(_probe=("sent_all_reads",)))],
    ids=["2_ranks_w_transposed", "3_ranks_tall_pull_depth_3", "2_ranks_tall_probed"])
def test_matmul_reduce_scatter_kernel_per_rank(n, tiling, b, s, depth, options):
  """Rank r's output is the fp32 sum of every rank's y_p @ w_p over its chunk; what it
  sends to rank c is its own partial of chunk c, in bf16. Two ranks: two row tiles per
  chunk, which the schedule runs as two phases of one tile each, dealt by three SMs
  round-robin on from loop to loop (gemm.dealt): every tile is computed once, whichever SM
  takes it. Three ranks: each own tile reads eight partial sub-tiles through its
  ``depth`` receive slots, each refilled as soon as it is read (three slots: under the race
  detector). Probed (``_probe``, a timing tool; two ranks, tall tiles: four sub-tiles
  through two slots), every sent tile also reads and drops what an own tile reads, through
  the same slots: the results do not change. Two ranks take each weight as the backward
  pass holds it, ``[D, F]`` (``transpose_w``)."""
  f, d = 128, 128
  if tiling is TILING:  # two row tiles a chunk: two phases
    assert matmul_rs.default_phases(b * s // tiling.cta_m) == 2
  ys, ws = _partials(n, b, s, f, d, seed=2)
  parts = [jnp.einsum("btf,fd->btd", ys[p], ws[p], preferred_element_type=jnp.float32)
           for p in range(n)]
  if options.get("transpose_w"):
    ws = [w.T for w in ws]
  outs, sent = _exchange(n, None, ys, ws, (jnp.full((n, b * s, d), jnp.nan, jnp.bfloat16),),
                         tiling, num_sms=3 if n == 2 else 2, pull_depth=depth,
                         detect_races=depth == 3, **options)
  for r in range(n):
    chunk = slice(r * s, (r + 1) * s)
    want = sum(p[:, chunk].astype(jnp.bfloat16).astype(jnp.float32) for p in parts)
    np.testing.assert_allclose(np.asarray(outs[r], np.float32), np.asarray(want),
                               rtol=2e-2, atol=2e-2)
    for c in range(n):
      if c != r:
        np.testing.assert_allclose(
            np.asarray(sent[r][0][c], np.float32),
            np.asarray(parts[r][:, c * s:(c + 1) * s].reshape(b * s, d).astype(jnp.bfloat16),
                       np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,tiling,row_tiles", [(1, TILING, 1), (2, TILING, 1),
                                                (3, TALL, 1), (2, TILING, 2)],
                         ids=["1_rank", "2_ranks", "3_ranks_tall", "2_ranks_two_phases"])
def test_compressed_matmul_reduce_scatter_kernel_sends_the_codecs_codes(n, tiling, row_tiles):
  """The FP8 kernel encodes each partial tile as the codec does (same codes, same
  multipliers) and the owner's output is the reference's decode-and-sum. Integer inputs
  make every partial exact, so accumulation order cannot change a code. Two phases: the
  own tiles' prefetch into the send buffers comes after sent tiles and waits for them;
  under the race detector, which found a tile's one epilogue slab (these tiles) refilling
  a send slot still being copied out."""
  b, s, f, d = 1, tiling.cta_m * row_tiles, 128, 128
  ky, kw = jax.random.split(jax.random.key(3))
  ys = [jax.random.randint(jax.random.fold_in(ky, p), (b, n * s, f), -3, 4).astype(
      jnp.bfloat16) for p in range(n)]
  ws = [jax.random.randint(jax.random.fold_in(kw, p), (f, d), -3, 4).astype(jnp.bfloat16)
        for p in range(n)]
  fp8 = dict(FP8)
  slots = (jnp.zeros((n, b * s, d), jnp.float8_e4m3fn),
           jnp.zeros((n, d // fp8["group_size"], b * s), jnp.float32))
  outs, sent = _exchange(n, fp8, ys, ws, slots, tiling, detect_races=row_tiles == 2)
  parts = [jnp.einsum("btf,fd->btd", ys[p], ws[p], preferred_element_type=jnp.float32
                      ).astype(jnp.bfloat16) for p in range(n)]
  g = fp8["group_size"]
  for r in range(n):
    c = (r + 1) % n
    if n > 1:  # one rank sends nothing
      codes, alpha, scale = encode_reference(
          parts[r][:, c * s:(c + 1) * s].reshape(b * s, d), group_size=g, hadamard=False)
      np.testing.assert_array_equal(np.asarray(sent[r][0][c], np.float32),
                                    np.asarray(codes, np.float32))
      np.testing.assert_array_equal(sent[r][1][c], group_multiplier(alpha, scale).T)
    decoded = [np.asarray(decode_reference(*encode_reference(
        parts[p][:, r * s:(r + 1) * s].reshape(b * s, d), group_size=g, hadamard=False),
        group_size=g, hadamard=False, out_dtype=jnp.float32)) for p in range(n)]
    # same codes, so the same sum up to fp32 contraction (code * multiplier + running sum
    # may be one FMA): at most one bf16 rounding step apart, and rarely; where the terms
    # cancel, a few fp32 roundings of the terms
    got = np.asarray(outs[r], np.float32).reshape(b * s, d)
    want = np.asarray(jnp.asarray(sum(decoded)).astype(jnp.bfloat16), np.float32)
    roundings = n * 2.0 ** -24 * sum(np.abs(x) for x in decoded)
    assert np.all(np.abs(got - want) <= np.maximum(2 ** -7 * np.abs(want), roundings))
    assert np.mean(got != want) < 0.01


def test_decode_tile_is_the_codecs_decode():
  """The FP8 all-gather kernel's in-register decode equals `decode_reference` (no
  transform) bit for bit, on codes of random data of many scales."""
  x = jax.random.normal(jax.random.key(4), (64, 256)) * jnp.exp(
      jax.random.normal(jax.random.key(5), (64, 1)) * 4)
  codes, alpha, scale = encode_reference(x, group_size=128, hadamard=False)
  want = decode_reference(codes, alpha, scale, group_size=128, hadamard=False,
                          out_dtype=jnp.bfloat16)
  mult = ag_matmul.multipliers(alpha, scale)  # [groups, rows]
  for g in range(2):
    cols = slice(g * 128, (g + 1) * 128)
    got = ag_matmul.decode_tile(codes[:, cols], mult[g], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want[:, cols],
                                                                          np.float32))


@pytest.mark.parametrize("n, phases", [(1, 1), (2, 1), (2, 4), (4, 3)])
def test_reduce_scatter_schedule_sends_before_it_waits(n, phases):
  """Every (chunk, phase) once; a rank's own phase p (which waits, before its loop, for the
  peers' partials of phase p) comes in a later loop than its own partials of phase p for
  every peer, and the peers' phase p + 1 comes before it, so the link has work while the
  own phase computes. The kernel runs the loops as two nested ones and deals each loop's
  tiles on from its place in this order (``loop_index``, also on traced indices)."""
  loops = matmul_rs.schedule(n, phases)
  assert sorted(loops) == sorted((q, p) for q in range(1, n + 1) for p in range(phases))
  assert [int(matmul_rs.loop_index(q, p, n, phases)) for q, p in loops] == list(
      range(len(loops)))
  traced = jax.jit(lambda q, p: matmul_rs.loop_index(q, p, n, phases))
  assert [int(traced(q, p)) for q, p in loops] == list(range(len(loops)))
  for p in range(phases):
    own = loops.index((n, p))
    assert all(loops.index((q, p)) < own for q in range(1, n))
    if p + 1 < phases:
      assert all(loops.index((q, p + 1)) < own for q in range(1, n))


def _reduce_scatter_call(y_shape, n=2, **options):
  """The reduce-scatter kernel in local mode on zeros: y of ``y_shape``, w ``[128, 128]``."""
  return lambda: matmul_rs.matmul_reduce_scatter(
      jnp.zeros(y_shape, jnp.bfloat16), jnp.zeros((128, 128), jnp.bfloat16), "t",
      tiling=TILING, num_sms=1, rank=0, n=n, received=(), **options)


@pytest.mark.parametrize("call, match", [
    (lambda: ag_matmul.all_gather_matmul(jnp.zeros((1, 64, 100), jnp.bfloat16),
                                         jnp.zeros((100, 128), jnp.bfloat16), "t",
                                         tiling=TILING, num_sms=1, rank=0,
                                         local_gathered=jnp.zeros((1, 128, 100))),
     "contraction 100 is not a multiple of the tile 64"),
    (lambda: ag_matmul.all_gather_matmul(jnp.zeros((1, 64, 128), jnp.bfloat16),
                                         jnp.zeros((64, 128), jnp.bfloat16), "t",
                                         tiling=TILING, num_sms=1, rank=0,
                                         local_gathered=jnp.zeros((1, 128, 128))),
     "do not contract"),
    (_reduce_scatter_call((1, 96, 128)), "sequence shard 48 is not a multiple of the tile 64"),
    (_reduce_scatter_call((1, 128, 128), fp8=dict(FP8, group_size=128)),
     "encodes groups of its tile_n"),
    (_reduce_scatter_call((2, 128, 128), phases=3),
     "3 phases do not divide the chunk's 2 row tiles"),
    (_reduce_scatter_call((2, 128, 128), pull_depth=4), "pull_depth=4 is not between 1 and 3"),
    (_reduce_scatter_call((2, 128, 128), _probe=("sent_writes",)),
     "_probe .* is for the plain kernel with peers"),
    # the timing experiments' parts left out (``_skip``): only where they cannot hang
    (_reduce_scatter_call((2, 128, 128), _skip=("signals",)),
     "'signals' needs 'waits' and 'release'"),
    (lambda: ag_matmul.all_gather_matmul(jnp.zeros((1, 64, 128), jnp.bfloat16),
                                         jnp.zeros((128, 256), jnp.bfloat16), "t",
                                         tiling=dataclasses.replace(TILING, cluster_n=2),
                                         num_sms=2, rank=0, local_gathered=jnp.zeros(
                                             (1, 128, 128), jnp.bfloat16), _skip=("copy",)),
     "_skip and _chunk_waits are for the ring schedule"),
])
def test_shapes_the_tiles_do_not_divide_are_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_fp8_all_gather_takes_the_widest_tiles_that_divide():
  halves, wide, narrow = ag_matmul.FP8_TILINGS
  assert (halves.tile_k, halves.decode_parts) == (128, 2) and halves.cta_n == wide.cta_n
  assert ag_matmul.fp8_tiling((2, 256, 256), (256, 512), 128) == halves
  assert ag_matmul.fp8_tiling((2, 256, 256), (256, 512), 64) == wide  # groups of 64
  assert ag_matmul.fp8_tiling((2, 256, 128), (128, 512), 128) == wide  # one step of 128
  assert ag_matmul.fp8_tiling((2, 256, 256), (256, 384), 128) == narrow
  assert ag_matmul.misfit((2, 256, 256), (256, 384), wide, 128) is not None
  assert ag_matmul.misfit((2, 256, 256), (256, 384), narrow, 128) is None
  assert "2 decode parts of the pipeline step 64 are not multiples of 64" in ag_matmul.misfit(
      (2, 256, 256), (256, 512), dataclasses.replace(wide, decode_parts=2), 128)


def _lowers_for_hopper(f, *args) -> str:
  """The kernel's sm_90 lowering (Mosaic GPU's layout inference and dialect lowering), on
  a (2, 2, 2) mesh with TP as one of its axes; needs jax-cuda13-plugin's Mosaic GPU
  bindings, which `make install` adds (no GPU needed)."""
  pytest.importorskip("jax_cuda13_plugin", reason="jax-cuda13-plugin not installed")
  return testing.cuda_lowering(f, *args)


def _dp2_tp_mesh(tp: int):
  """A (2, 1, tp) ("data", "pipeline", "tensor") mesh over the first 2 tp devices: TP as
  one axis of the trainer's mesh, beside data parallelism."""
  return jax.make_mesh((2, 1, tp), ("data", "pipeline", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:2 * tp])


_SCALE = 2.0  # a module default that ``test_lowered_once_keys_on_the_globals_it_reads`` patches


def test_lowered_once_keys_on_the_globals_it_reads(monkeypatch):
  """A default that an entry point reads from a module global (``reads``, as the kernels'
  ``TILING``) is part of ``gemm.lowered_once``'s key: patched after a shape's first call, the
  next call traces anew instead of reusing the old value."""
  traces = []

  @gemm.lowered_once("k", reads=("_SCALE",))
  def scaled(x, k=None):
    traces.append(k)
    return x * (k or _SCALE)
  x = jnp.ones(3)
  assert float(scaled(x)[0]) == float(scaled(x)[0]) == 2.0 and len(traces) == 1
  monkeypatch.setattr(sys.modules[__name__], "_SCALE", 3.0)
  assert float(scaled(x)[0]) == 3.0 and len(traces) == 2
  assert float(scaled(x, k=5.0)[0]) == 5.0 and len(traces) == 3


def test_kernels_lower_once_however_many_layers_call_them(tmp_path):
  """The kernels' entry points are jitted (``gemm.lowered_once``): three layers' all-gather,
  reduce-scatter and exchange kernels of the same shapes put one copy of each kernel's
  Mosaic GPU module into the step's sm_90 lowering, as one layer's do; built with the
  profiler (``gemm.profiling``), the same calls are other kernels."""
  mesh = _dp2_tp_mesh(2)
  sd = jax.ShapeDtypeStruct

  args = sd((2, 512, 256), jnp.bfloat16), sd((256, 512), jnp.bfloat16), sd(
      (512, 256), jnp.bfloat16)

  def step(layers):
    def f(x, w, w2):
      outs = []
      for _ in range(layers):
        y, _ = ag_matmul.all_gather_matmul(x, w, "tensor", num_sms=132)
        outs.append(matmul_rs.matmul_reduce_scatter(y, w2, "tensor", num_sms=132))
        outs.append(exchange.all_to_all(x, "tensor", n=2, split_axis=1, num_sms=132))
      return outs
    return jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tensor"), P(), P()),
                         out_specs=P(None, "tensor"), check_vma=False)
  assert exchange.misfit(args[0].shape, 2, 1) is None
  one, three = _lowers_for_hopper(step(1), *args), _lowers_for_hopper(step(3), *args)
  assert one.count("mosaic_gpu") == three.count("mosaic_gpu") > 0
  assert len(three) < 1.1 * len(one)
  plain = str(jax.make_jaxpr(step(1))(*args))
  with gemm.profiling(str(tmp_path)):
    profiled = str(jax.make_jaxpr(step(1))(*args))
  assert str(tmp_path) in profiled and str(tmp_path) not in plain


def test_the_ring_lowers_with_row_waits_at_four_ranks():
  """At 4 ranks (``ROW_WAITS_FROM`` on) the ring's tiles wait for their A rows, a semaphore
  per step and row tile: plain and FP8 through the sm_90 lowering on a (2, 1, 4) mesh, and
  the plain kernel with the bench's chunk waits (``_chunk_waits``) too. (Local mode, which
  the per-rank tests run, has no semaphores: there both ways compute the same.)"""
  mesh = _dp2_tp_mesh(4)
  sd = jax.ShapeDtypeStruct
  b, t, d, f = 2, 1024, 256, 512
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
  for chunk_waits in (None, True):
    fn = smap(lambda x, w, c=chunk_waits: ag_matmul.all_gather_matmul(
        x, w, "tensor", num_sms=132, _chunk_waits=c)[0],
        in_specs=(P(None, "tensor"), P()), out_specs=P())
    assert "mosaic_gpu" in _lowers_for_hopper(fn, sd((b, t, d), jnp.bfloat16),
                                              sd((d, f), jnp.bfloat16))
  fn = smap(lambda codes, mult, w: ag_matmul.all_gather_matmul_fp8(
      codes, mult, w, "tensor", group_size=128, num_sms=132)[0],
      in_specs=(P(None, "tensor"), P(None, "tensor"), P()), out_specs=P())
  assert "mosaic_gpu" in _lowers_for_hopper(fn, sd((b, t, d), jnp.float8_e4m3fn),
                                            sd((d // 128, b * t), jnp.float32),
                                            sd((d, f), jnp.bfloat16))


def test_the_layers_pull_where_a_cluster_covers_the_row():
  """The plain all-gather kernel pulls where one cluster of 2 or 4 covers an output row (the
  1.3B out-projection's backward: 1024 columns in tiles of 256 at TP=2, 512 at TP=4), and
  keeps the ring elsewhere (wider rows, one rank, widths not measured), on the narrow tiles
  where 256 does not divide the width; a grid of clusters of 4 holds only as many as the
  GPU runs at once."""
  x = (8, 1024, 2048)
  assert ag_matmul.plain_tiling(x, (2048, 1024), 2).cluster_n == 4
  assert ag_matmul.plain_tiling(x, (2048, 512), 4).cluster_n == 2
  for w, n in (((2048, 3072), 2), ((2048, 1024), 1), ((2048, 768), 2)):
    assert ag_matmul.plain_tiling(x, w, n).cluster_n == 1
  x27 = (8, 512, 2560)  # the 2.7B QKV's and out-projection backward's widths at TP=4
  for w in ((2560, 1920), (2560, 640)):
    assert ag_matmul.misfit(x27, w, ag_matmul.WIDE) is not None
    assert ag_matmul.plain_tiling(x27, w, 4) == ag_matmul.NARROW
    assert ag_matmul.misfit(x27, w, ag_matmul.NARROW) is None
  assert ag_matmul.plain_tiling(x27, (2560, 200), 4) == ag_matmul.WIDE  # neither: its why
  assert gemm.clusters(132, 4) == gemm.RESIDENT_CLUSTERS[4] < 33
  assert (gemm.clusters(132, 2), gemm.clusters(8, 4), gemm.clusters(132, 1)) == (66, 2, 132)


def test_benchmark_entries_name_their_tiles_sms_and_options():
  """bench_collective_matmul's ``--tilings`` entries: Tiling fields over a base, and the
  SMs to run on (``sms=N``), which is no Tiling field; the kernel options timed beside an
  entry are named after both."""
  from benchmarks import bench_collective_matmul as bench
  base = gemm.Tiling(cluster_n=4)
  assert bench._tiling(base, "default") is base
  assert bench._tiling(base, "cluster_n=1+sms=112") == gemm.Tiling()
  assert bench._tiling(gemm.Tiling(), "split=m+stages=3") == gemm.Tiling(split="m", stages=3)
  assert [bench._sms(e, 132) for e in ("default", "stages=3", "cluster_n=4+sms=112")] == [
      132, 132, 112]
  args = bench.parse_args(["--rs-pull-depth", "3", "--rs-probe", "sent_reads",
                           "--rs-skip", "waits+release", "--ag-skip", "copy"])
  rs, ag = bench.kernel_options(args)
  assert [(kw, name) for kw, name in bench._options(rs, "stages=3")] == [
      ({"pull_depth": 3}, "stages=3+pull=3"),
      ({"_probe": ("sent_reads",)}, "stages=3+probe=sent_reads"),
      ({"_skip": ("waits", "release")}, "stages=3+skip=waits+release")]
  assert list(bench._options(ag, "default")) == [({"_skip": ("copy",)}, "skip=copy")]
  assert bench.DIAGNOSTIC in "fused[skip=waits+release]"  # timed unchecked


def test_benchmark_counts_the_wrong_calls():
  """``--check-calls``: every call of a kernel is checked; one that is wrong on one call of
  five (as a race would be) is counted once, a right one never."""
  from benchmarks import bench_collective_matmul as bench
  want = jnp.ones((4, 8), jnp.float32)
  count = iter(range(100))

  def racy(x):
    return (jnp.where(next(count) % 5 == 2, 2.0, 1.0) * x,)
  assert bench.wrong_calls(racy, (want,), want, 5) == 1
  assert bench.wrong_calls(lambda x: (x,), (want,), want, 5) == 0
  assert bench.parse_args([]).check_calls == 1


def test_benchmark_reports_a_failed_timing_and_goes_on(monkeypatch):
  """A profiler error in one variant's timing is tried once more, then recorded in that
  variant's entry (``timing_error``) instead of ending the run."""
  from benchmarks import bench_collective_matmul as bench
  calls = []

  def flaky(fn, args, iters, n_devices, skip=frozenset()):
    calls.append(fn)
    if fn == "bad" or len(calls) == 1:
      raise RuntimeError("Kernel names are not consistent across iterations")
    return {"ms": 0.25}
  monkeypatch.setattr(bench, "device_time_ms", flaky)
  assert bench.timed_or_error("good", (), 2, 1) == {"ms": 0.25} and len(calls) == 2
  failed = bench.timed_or_error("bad", (), 2, 1)
  assert failed == {"timing_error": "RuntimeError: Kernel names are not consistent across "
                                    "iterations"} and calls[2:] == ["bad", "bad"]
  case = {"model": "1.3b", "layer": "qkv", "kind": "ag", "variants": {"fused": failed}}
  assert "fused NOT TIMED RuntimeError" in bench._line(case)


def test_benchmark_times_a_neighboured_matmul_without_its_neighbour(monkeypatch):
  """``--cold`` / ``--hot``: cuBLAS and each GEMM core run once more after a neighbour
  kernel (``*_cold``, ``*_hot``), and the timing leaves the neighbour's kernels out."""
  from jax.experimental.mosaic.gpu import profiler
  from benchmarks import bench_collective_matmul as bench
  monkeypatch.setattr(bench, "_neighbour",
                      lambda kind: (lambda x: x + 1, {"cold": 10.0, "hot": 20.0}[kind]))
  timed = {"cublas": (lambda a, w: a * w, (2.0, 3.0)),
           "core[default]": (lambda a, w: (a + w,), (2.0, 3.0)), "fused": (None, ())}
  variants = bench._neighboured_variants(timed, ["cold", "hot"])
  assert sorted(variants) == ["core[default]_cold", "core[default]_hot", "cublas_cold",
                              "cublas_hot"]
  fn, args = variants["cublas_hot"]
  assert args == (2.0, 3.0, 20.0) and fn(*args) == (6.0, 21.0)
  # --fresh: the matmul reads x as the neighbour (a traced multiply by 1) rewrote it
  monkeypatch.undo()
  timed = {"core[default]": (lambda a, w: (a + w,), (jnp.float32(2), jnp.float32(3)))}
  fn, args = bench._neighboured_variants(timed, ["fresh"])["core[default]_fresh"]
  assert [float(v) for v in args] == [2.0, 3.0, 1.0] and float(fn(*args)[0]) == 5.0
  calls = [[("flush", 9.0), ("gemm", 0.5)], [("flush", 9.0), ("gemm", 0.7)],
           [("gemm", 0.6), ("flush", 9.0)]]
  monkeypatch.setattr(profiler, "measure", lambda fn, **kw: lambda *a: (None, calls))
  got = bench.device_time_ms(None, (), 3, 1, skip=frozenset({"flush"}))
  assert got["ms"] == 0.6 and got["kernels"] == {"gemm": 0.6}
  assert bench.device_time_ms(None, (), 3, 1)["ms"] == 9.6


def test_gemm_core_in_clusters_lowers_for_hopper():
  """The GEMM core in clusters of 4 CTAs sharing each A block: the production tiles, 132
  SMs as 33 clusters, through the sm_90 lowering (the multicast loads and the cluster's
  barriers are what the interpreter does not check)."""
  fn = functools.partial(gemm.matmul, tiling=gemm.Tiling(cluster_n=4), num_sms=132)
  sd = jax.ShapeDtypeStruct
  text = _lowers_for_hopper(fn, sd((1024, 512), jnp.bfloat16), sd((512, 1024), jnp.bfloat16))
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="130 SMs do not make clusters of 4"):
    gemm.matmul(jnp.zeros((1024, 512), jnp.bfloat16), jnp.zeros((512, 1024), jnp.bfloat16),
                tiling=gemm.Tiling(cluster_n=4), num_sms=130)
  clusters = gemm.Tiling(cluster_n=2, split="m")
  with pytest.raises(ValueError, match="reduce-scatter kernels take no clusters"):
    matmul_rs.matmul_reduce_scatter(jnp.zeros((1, 256, 128), jnp.bfloat16),
                                    jnp.zeros((128, 512), jnp.bfloat16), "t", tiling=clusters,
                                    num_sms=2, rank=0, n=2, received=())
  with pytest.raises(ValueError, match="FP8 all-gather kernel does not pull"):
    ag_matmul.all_gather_matmul_fp8(jnp.zeros((1, 128, 128), jnp.float8_e4m3fn),
                                    jnp.zeros((1, 128), jnp.float32),
                                    jnp.zeros((128, 512), jnp.bfloat16), "t", group_size=128,
                                    tiling=clusters, num_sms=2)
  with pytest.raises(ValueError, match="y in float32 is staged where the gathered x"):
    ag_matmul.all_gather_matmul_fp8(jnp.zeros((1, 128, 256), jnp.float8_e4m3fn),
                                    jnp.zeros((2, 128), jnp.float32),
                                    jnp.zeros((256, 512), jnp.bfloat16), "t", group_size=128,
                                    num_sms=2, out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="3 SMs do not make clusters of 2"):
    ag_matmul.all_gather_matmul(jnp.zeros((1, 128, 128), jnp.bfloat16),
                                jnp.zeros((128, 512), jnp.bfloat16), "t", tiling=clusters,
                                num_sms=3)


def test_the_ring_narrows_its_tiles_where_a_step_leaves_a_wave_half_empty():
  """A ring that waits for whole chunks between steps (below ``ROW_WAITS_FROM`` ranks)
  takes whole waves of tiles a step: where 192 tiles of 256 columns would take two waves
  of 132 SMs for 1.45 of work (the 1.3B QKV's step at TP=4), tiles of 192 (256 tiles, two
  waves of three quarters the work); where 48 would leave two thirds of the SMs idle (TP=8),
  tiles of 128; at TP=2 the 2.7B out-projection's backward (320 tiles, 2.4 waves) takes
  128. Where the wide tiles fill their waves, or a narrower width would save less than
  ``RING_NARROWING_GAIN`` (the 2.7B QKV at TP=2), they stay; so do the pulled tiles, and
  the tiles of a ring that waits for row tiles."""
  def width(tiling):
    assert tiling.cluster_n == 1 and tiling.cta_m == ag_matmul.WIDE.cta_m
    return tiling.cta_n

  assert width(ag_matmul.ring_tiling((8, 512, 2048), (2048, 1536), 132)) == 192
  assert width(ag_matmul.ring_tiling((8, 256, 2048), (2048, 768), 132)) == 128
  assert width(ag_matmul.ring_tiling((8, 512, 2048), (2048, 1536), 96)) == 256  # 2 full waves
  assert ag_matmul.ROW_WAITS_FROM == 3
  assert width(ag_matmul.plain_tiling((8, 1024, 2560), (2560, 1280), 2, 132)) == 128
  for x, w in (((8, 1024, 2048), (2048, 3072)), ((8, 1024, 2048), (2048, 4096)),
               ((8, 1024, 2560), (2560, 3840))):
    assert width(ag_matmul.plain_tiling(x, w, 2, 132)) == 256
  assert ag_matmul.plain_tiling((8, 512, 2048), (2048, 1536), 4, 132) == ag_matmul.WIDE
  assert ag_matmul.plain_tiling((8, 512, 2048), (2048, 512), 4, 132).cluster_n == 2


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "fp8"])
def test_kernels_lower_for_hopper_inside_a_3d_mesh(compressed):
  mesh = jax.make_mesh((2, 2, 2), ("data", "pipeline", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  sd = jax.ShapeDtypeStruct
  b, t, d, f = 2, 512, 256, 512
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
  if compressed:
    # every FP8_TILINGS entry: steps of 128 decoded in halves, steps of 64 (groups of 64),
    # and the narrow tiles (a width that 256 does not divide)
    for width, g in ((f, 128), (f, 64), (3 * 128, 128)):
      for transposed in (False, True):  # w [K, N], or [N, K] as the backward pass holds it
        def ag(codes, mult, w, g=g, transposed=transposed):
          return ag_matmul.all_gather_matmul_fp8(codes, mult, w, "tensor", group_size=g,
                                                 num_sms=132, transpose_w=transposed)[0]
        fn = smap(ag, in_specs=(P(None, "tensor"), P(None, "tensor"), P()), out_specs=P())
        text = _lowers_for_hopper(fn, sd((b, t, d), jnp.float8_e4m3fn),
                                  sd((d // g, b * t), jnp.float32),
                                  sd((width, d) if transposed else (d, width), jnp.bfloat16))
    fp8 = dict(FP8, group_size=128)
  else:
    ring = ag_matmul.WIDE  # the layers' tiles: the ring, pulled, narrow, and the ring's
    #                        192 columns
    for tiling, width in ((ring, f), (dataclasses.replace(ring, cluster_n=2), f),
                          (ag_matmul.NARROW, 3 * 128),
                          (dataclasses.replace(ring, tile_n=192), 2 * 192)):
      for transposed in (False, True):
        fn = smap(lambda x, w, tiling=tiling, transposed=transposed: ag_matmul.all_gather_matmul(
            x, w, "tensor", tiling=tiling, num_sms=132, transpose_w=transposed)[0],
            in_specs=(P(None, "tensor"), P()), out_specs=P())
        text = _lowers_for_hopper(fn, sd((b, t, d), jnp.bfloat16),
                                  sd((width, d) if transposed else (d, width), jnp.bfloat16))
    fp8 = None
  assert "mosaic_gpu" in text
  # four phases, and one (the own loop waits right after sending); w [F, D] or [D, F]
  for phases, transposed in ((None, False), (1, False), (None, True)):
    fn = smap(lambda y, w, phases=phases, transposed=transposed: matmul_rs.matmul_reduce_scatter(
        y, w, "tensor", num_sms=132, fp8=fp8, phases=phases, transpose_w=transposed),
        in_specs=(P(None, None, "tensor"), P(None, "tensor") if transposed else P("tensor")),
        out_specs=P(None, "tensor"))
    w = sd((d, 2 * f) if transposed else (2 * f, d), jnp.bfloat16)
    assert "mosaic_gpu" in _lowers_for_hopper(fn, sd((b, t, 2 * f), jnp.bfloat16), w)


def test_epilogues_fit_the_all_gather_kernels_and_lower_for_hopper():
  """The all-gather kernels with the GELU epilogues, as `fused.KernelMatmuls` runs them at the
  1.3B MLP's TP=2 shapes, lower for sm_90 (shared memory included) on a (2, 1, 2) mesh:
  plain and FP8, the forward's bias + GELU on the kernels' own tiles and the backward's
  derivative, with its h tiles, on the fewer stages `GeluGrad.fit` leaves (four do not fit
  beside them, nor the FP8 kernel's steps of 128); and the QKV split's (`qkv_gemm.SplitHeads`)
  at the QKV's TP=2 shapes."""
  mesh = _dp2_tp_mesh(2)
  sd = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  b, t, d, f, g = 2, 1024, 2048, 4096, 128
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
  grad = gelu_gemm.GeluGrad(jnp.zeros((1, 1), bf16))
  assert grad.fit(ag_matmul.WIDE).stages == 3
  assert grad.fit(ag_matmul.FP8_TILINGS[0]) == dataclasses.replace(
      ag_matmul.FP8_TILINGS[0], tile_k=64, stages=3, decode_parts=1)
  assert gelu_gemm.BiasGelu(jnp.zeros(1)).fit(ag_matmul.WIDE) == ag_matmul.WIDE
  x, w_in, w_out = sd((b, t, d), bf16), sd((d, f), bf16), sd((f, d), bf16)
  h, bias = sd((b, t, f), bf16), sd((f,), jnp.float32)
  epilogues = {"gelu": lambda extra: gelu_gemm.BiasGelu(extra, True),
               "gelu_grad": lambda extra: gelu_gemm.GeluGrad(extra, True),
               "split": lambda extra: qkv_gemm.SplitHeads(extra, 128)}

  def plain(x, w, extra, kind):
    epi, fwd = epilogues[kind](extra), kind != "gelu_grad"
    tiling = epi.fit(ag_matmul.plain_tiling(x.shape, w.shape[::1 if fwd else -1], 2))
    return ag_matmul.all_gather_matmul(x, w, "tensor", tiling=tiling, num_sms=132,
                                       transpose_w=not fwd, epilogue=epi)[0]

  def fp8(codes, mult, w, extra, kind):
    epi, fwd = epilogues[kind](extra), kind != "gelu_grad"
    tiling = epi.fit(ag_matmul.fp8_tiling(codes.shape, w.shape[::1 if fwd else -1], g))
    return ag_matmul.all_gather_matmul_fp8(codes, mult, w, "tensor", group_size=g,
                                           tiling=tiling, num_sms=132, transpose_w=not fwd,
                                           epilogue=epi)[0]
  for kind, w, extra in (("gelu", w_in, bias), ("gelu_grad", w_out, h),
                         ("split", sd((d, 3 * d // 2), bf16), sd((3 * d // 2,), jnp.float32))):
    fn = smap(functools.partial(plain, kind=kind), in_specs=(P(None, "tensor"), P(), P()),
              out_specs=P())
    assert "mosaic_gpu" in _lowers_for_hopper(fn, x, w, extra)
    fn = smap(functools.partial(fp8, kind=kind), out_specs=P(),
              in_specs=(P(None, "tensor"), P(None, "tensor"), P(), P()))
    assert "mosaic_gpu" in _lowers_for_hopper(
        fn, sd((b, t, d), jnp.float8_e4m3fn), sd((d // g, b * t), jnp.float32), w, extra)


def test_reduce_scatter_lowers_at_four_ranks():
  """At 4 ranks a phase has 3 sent loops, then one signal to every peer, relayed by the SM
  dealt the phase's last tile behind one fence: the kernel lowers for sm_90."""
  sd = jax.ShapeDtypeStruct
  fn = jax.shard_map(lambda y, w: matmul_rs.matmul_reduce_scatter(y, w, "x", num_sms=132),
                     mesh=testing.mesh_1d(4), in_specs=(P(None, None, "x"), P("x")),
                     out_specs=P(None, "x"), check_vma=False)
  assert "mosaic_gpu" in _lowers_for_hopper(fn, sd((2, 1024, 1024), jnp.bfloat16),
                                            sd((1024, 256), jnp.bfloat16))


# --- the layers' custom VJPs, on the XLA path -------------------------------------------


def _vjp_program(f, n):
  """jit(shard_map) over n ranks of (x, w, ct) -> f's value and its gradients for ct."""

  @functools.partial(jax.shard_map, mesh=testing.mesh_1d(n), in_specs=(P("x"),) * 3,
                     out_specs=P("x"), check_vma=False)
  def run(x, w, ct):
    out, vjp = jax.vjp(f, x[0], w[0])
    return jax.tree.map(lambda a: a[None], (out, *vjp(ct[0])))

  return jax.jit(run)


def _value_and_grads(f, n, x, w, ct):
  return _vjp_program(f, n)(x, w, ct)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("codec", [None, CompressionConfig(group_size=32)], ids=["plain", "fp8"])
def test_custom_vjps_match_the_regions_they_replace(kind, codec, monkeypatch):
  """Values and gradients of `fused.gather_matmul` / `matmul_scatter` (the XLA path the
  kernels fall back to on CPU) equal the layers' regions + matmul, plain and compressed,
  with the backward's weight read transposed or copied transposed
  (`fused.WEIGHTS_READ_TRANSPOSED`)."""
  n, b, s, d, f = 4, 2, 4, 64, 32
  rng = np.random.default_rng(7)
  if kind == "column":
    x, w, ct = rng.normal(size=(n, b, s, d)), rng.normal(size=(n, d, f)), rng.normal(
        size=(n, b, n * s, f))
    ours = lambda x, w: fused.gather_matmul(x, w, "x", codec, codec)  # noqa: E731
    theirs = lambda x, w: jnp.einsum("btd,df->btf", mappings.gather_from_sp(  # noqa: E731
        x, "x", fwd_compression=codec, bwd_compression=codec), w)
  else:
    x, w, ct = rng.normal(size=(n, b, n * s, f)), rng.normal(size=(n, f, d)), rng.normal(
        size=(n, b, s, d))
    ours = lambda y, w: fused.matmul_scatter(y, w, "x", codec, codec)  # noqa: E731
    theirs = lambda y, w: mappings.reduce_scatter_to_sp(  # noqa: E731
        jnp.einsum("btf,fd->btd", y, w), "x", fwd_compression=codec, bwd_compression=codec)
  x, w, ct = (jnp.asarray(a, jnp.float32) for a in (x, w, ct))
  want = _value_and_grads(theirs, n, x, w, ct)
  for read_transposed in (True, False):
    monkeypatch.setattr(fused, "WEIGHTS_READ_TRANSPOSED", read_transposed)
    got = _value_and_grads(ours, n, x, w, ct)
    for name, g, e in zip(("value", "dx", "dw"), got, want, strict=True):
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)


def test_exchange_matmul_vjp_matches_the_all_to_all_and_matmul(monkeypatch):
  """`fused.exchange_matmul` (its XLA path on CPU) against ``all_to_all`` then the matmul
  by autodiff: value and gradients, however `fused.EXCHANGE_GRADIENT` sends the input's
  (the fused kernel's fallback, the two apart, XLA's) and `fused.EXCHANGE_FORWARD` the
  forward's (apart, the fused kernel's fallback)."""
  n, b, s, f, d = 4, 2, 4, 64, 32
  rng = np.random.default_rng(5)
  y, w, ct = (jnp.asarray(rng.normal(size=shape), jnp.float32)
              for shape in ((n, b, n * s, f // n), (n, f, d), (n, b, s, d)))
  want = _value_and_grads(lambda y, w: jnp.einsum("bsf,fd->bsd", collectives.all_to_all(
      y, "x", split_axis=1, concat_axis=2), w), n, y, w, ct)
  for how, forward in zip(fused.EXCHANGE_GRADIENTS, fused.EXCHANGE_FORWARDS * 2):
    monkeypatch.setattr(fused, "EXCHANGE_GRADIENT", how)
    monkeypatch.setattr(fused, "EXCHANGE_FORWARD", forward)
    got = _value_and_grads(lambda y, w: fused.exchange_matmul(y, w, "x"), n, y, w, ct)
    for name, g, e in zip(("value", "dy", "dw"), got, want, strict=True):
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=f"{how} {name}")


def test_free_communication_runs_the_exchange_gradient_on_the_gemm_core(monkeypatch):
  """Under `collectives.free_communication` (``ideal_cm``), where the matmul + exchange
  kernel would run, the input's gradient is our GEMM core's matmul and the stand-in
  all-to-all: on one rank (the interpreter runs one CPU device at a time) the value and
  gradients are the XLA path's, and the core multiplied this rank's rows once."""
  b, s, f, d = 1, 64, 128, 128
  cores = []
  monkeypatch.setattr(gemm, "matmul_epilogue", lambda *a, f=gemm.matmul_epilogue, **kw: (
      cores.append(a[0].reshape(-1, a[0].shape[-1]).shape), f(*a, **kw))[1])
  monkeypatch.setattr(matmul_all_to_all, "TILINGS", (TILING,))
  rng = np.random.default_rng(3)
  y, w, ct = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
              for shape in ((1, b, s, f), (1, f, d), (1, b, s, d)))

  def free_step(kernels: bool):
    monkeypatch.setattr(fused, "platform_problem", lambda devices: (
        None if kernels else "no GPU"))
    with collectives.free_communication("x"), _interpret():
      return jax.block_until_ready(_value_and_grads(
          lambda y, w: fused.exchange_matmul(y, w, "x"), 1, y, w, ct))
  xla, core = free_step(False), free_step(True)
  assert cores == [(b * s, d)]
  for name, g, e in zip(("value", "dy", "dw"), core, xla, strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                               rtol=2e-2, atol=2e-2, err_msg=name)


@pytest.mark.parametrize("layer", ["kernel_column", "kernel_row", "ring_column"])
@pytest.mark.parametrize("f32", [False, True], ids=["bf16_dot", "f32_dot"])
def test_weight_gradient_is_a_dot_in_the_weights_dtype(layer, f32, monkeypatch):
  """A bf16 layer's weight gradient is one dot with a bf16 output, as autodiff of the XLA
  layers' matmul gives (XLA runs it on cuBLAS); with `overlap.WEIGHT_GRADIENTS_F32`
  (bench_train's ``_dwf32``) a dot with an fp32 output, then the cast. The kernel layers'
  and the ring's all-gather matmul (whose reduce-scatter sums its chunks' products in
  fp32)."""
  monkeypatch.setattr(overlap, "WEIGHT_GRADIENTS_F32", f32)
  n, b, s, d, f = 2, 1, 4, 16, 8
  fn = dict(kernel_column=fused.gather_matmul, kernel_row=fused.matmul_scatter,
            ring_column=overlap.gather_matmul)[layer]
  x, w, ct = ((n, b, s, d), (n, d, f), (n, b, n * s, f)) if layer.endswith("column") else (
      (n, b, n * s, f), (n, f, d), (n, b, s, d))
  sd = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
  text = _vjp_program(lambda x, w: fn(x, w, "x"), n).lower(sd(x), sd(w), sd(ct)).as_text()
  w_dots = re.findall(rf"dot_general.*-> tensor<{w[1]}x{w[2]}x(\w+)>", text)
  assert w_dots == ["f32" if f32 else "bf16"], w_dots


@pytest.mark.parametrize("kind", ["column", "row"])
def test_free_communication_runs_the_kernels_matmuls_on_the_gemm_core(kind, monkeypatch):
  """Under `collectives.free_communication` (bench_train's ``ideal_cm``) a layer whose
  kernel would run (the platform check passed) takes the XLA path's stand-in collectives
  with the matmul on our GEMM core, forward and backward: traced over 2 ranks, the core
  multiplies the full sequence's rows and the outputs have the XLA path's shapes; run (on
  one rank: jax's interpreter cannot run kernels on two CPU devices at once), the values
  and gradients are the XLA path's."""
  b, s, d = 1, 64, 128
  layer = fused.gather_matmul if kind == "column" else fused.matmul_scatter
  cores = []
  monkeypatch.setattr(gemm, "matmul_epilogue", lambda *a, f=gemm.matmul_epilogue, **kw: (
      cores.append(a[0].reshape(-1, a[0].shape[-1]).shape), f(*a, **kw))[1])
  monkeypatch.setattr(ag_matmul, "plain_tiling", lambda *shapes: TILING)
  monkeypatch.setattr(matmul_rs, "TILING", TILING)

  def free_step(n, kernels: bool, run=_value_and_grads):
    monkeypatch.setattr(fused, "platform_problem", lambda devices: (
        None if kernels else "no GPU"))
    x_shape, ct_shape = ((n, b, s, d), (n, b, n * s, d)) if kind == "column" else (
        (n, b, n * s, d), (n, b, s, d))
    rng = np.random.default_rng(11)  # the same inputs for both paths
    x, w, ct = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
                for shape in (x_shape, (n, d, d), ct_shape))
    with collectives.free_communication("x"), _interpret():
      return jax.block_until_ready(run(lambda x, w: layer(x, w, "x"), n, x, w, ct))

  def shapes(f, n, *arrays):
    return jax.eval_shape(lambda *a: _value_and_grads(f, n, *a), *arrays)
  assert free_step(2, True, run=shapes) == free_step(2, False, run=shapes)
  assert cores == [(b * 2 * s, d)] * 2  # the forward's matmul and dx's, on full rows
  xla, core = free_step(1, False), free_step(1, True)
  assert len(cores) == 4
  for name, g, e in zip(("value", "dx", "dw"), core, xla, strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                               rtol=2e-2, atol=2e-2, err_msg=name)


def test_no_gpu_falls_back_to_the_collectives_and_says_so(caplog):
  common._warned.clear()
  x, w = jnp.ones((2, 2, 4, 64)), jnp.ones((2, 64, 32))
  with caplog.at_level("WARNING"):
    for _ in range(2):
      _value_and_grads(lambda x, w: fused.gather_matmul(x, w, "x"), 2, x, w,
                       jnp.ones((2, 2, 8, 32)))
  said = [r.getMessage() for r in caplog.records if "tp_overlap='kernel'" in r.getMessage()]
  assert len(said) == 1 and "no GPU" in said[0], said  # once, for every layer and direction
  assert fused.fallbacks() == [fused.platform_problem(2)]  # what a benchmark records


def test_kernels_run_only_where_measured(monkeypatch):
  """On Hopper GPUs with peer access the kernels run in programs over at most
  `fused.MEASURED_GPUS` devices; on a larger mesh (whatever its TP) the layers take XLA's
  collectives, saying why, unless the override asks for the kernels."""
  hopper = type("Device", (), dict(compute_capability="9.0", device_kind="NVIDIA H200"))()
  monkeypatch.setattr(fused.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(fused.jax, "devices", lambda: [hopper])
  monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
  monkeypatch.delenv(fused.ANY_MESH_ENV, raising=False)
  assert fused.platform_problem(fused.MEASURED_GPUS) is None
  assert fused.ANY_MESH_ENV in fused.platform_problem(fused.MEASURED_GPUS * 2)
  monkeypatch.setenv(fused.ANY_MESH_ENV, "1")
  assert fused.platform_problem(fused.MEASURED_GPUS * 2) is None
  monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
  assert "NCCL_P2P_DISABLE" in fused.platform_problem(fused.MEASURED_GPUS)


def test_the_mesh_counts_every_device_not_only_the_tp_axis():
  """DP=2 x TP=2 is a program over 4 devices: `_mesh_devices` sees the whole traced mesh."""
  mesh = jax.make_mesh((2, 1, 2), ("data", "pipeline", "tensor"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  seen = []

  def body(x):
    seen.append(fused._mesh_devices(jax.lax.axis_size("tensor")))
    return x
  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor")))(
      jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("tensor"))))
  assert seen == [4]
  assert fused._mesh_devices(2) == 2  # no mesh traced: the TP axis alone


def test_tp_overlap_config_errors():
  """`parallel.tp_overlap`: unknown values, the old `parallel.overlap` boolean and
  compression logging with collective matmuls are one-line errors naming the fields."""
  from taco_jax.configs import tiny
  from taco_jax.tp import step as step_lib
  from taco_jax.train.config import parallel_errors
  c = tiny.get_micro_config()
  c.parallel.update(tp=2, dp=1, pp=1)
  assert parallel_errors(c, 2) == []
  c.parallel.tp_overlap = "fused"
  assert any("parallel.tp_overlap='fused' must be one of ('none', 'ring', 'kernel')" in e
             for e in parallel_errors(c, 2))
  c.parallel.tp_overlap = "kernel"
  c.compression.log_errors = True
  assert any("collective matmuls do not report" in e for e in parallel_errors(c, 2))
  c = tiny.get_micro_config()
  c.parallel.overlap = True
  assert "was replaced by parallel.tp_overlap" in parallel_errors(c, 1)[0]
  with pytest.raises(ValueError, match="tp_overlap='yes' must be one of"):
    step_lib.ParallelSpec(step_lib.layout_lib.model_config(tiny.get_micro_config().model),
                          1, 1, 1, tp_overlap="yes")


def test_the_layers_decide_a_kernels_codec_by_its_size_and_work(monkeypatch):
  """On 4 GPUs over NVLink (the platform check passed, the kernels only traced), each
  layer asks `policy.pays_for` with its message and its matmul's work per message byte,
  the quantity the report derives `_measured.KERNEL_PAYS` from: at the 1.3B shapes the
  all-gathers of the out-projection's backward and of QKV both send 16 MiB, with work 2048
  and 6144; the out-projection's reduce-scatter 64 MiB, with work 512."""
  from benchmarks import report
  from taco_jax.policy import pays_for
  monkeypatch.setattr(fused, "platform_problem", lambda devices: None)
  mesh = jax.make_mesh((4,), ("t",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  codec = CompressionConfig(group_size=128, hadamard=False, link="nvlink")
  b, t, d, n = 8, 2048, 2048, 4
  sd = jax.ShapeDtypeStruct

  def decision(f, x, w, specs):
    with collectives.recording_decisions() as got:
      jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P(),
                                   check_vma=False), x, w)
    (dec,) = [dec for dec in got if dec.kernel]
    assert dec.compressed == pays_for(codec, dec.collective, dec.nbytes, n, kernel=True,
                                      work=dec.work)
    return dec.collective, dec.nbytes >> 20, dec.work

  def gather(x, w):
    return fused.all_gather_matmul(x, w, "t", codec)[0]

  def scatter(y, w):
    return fused.matmul_reduce_scatter(y, w, "t", codec)
  x, ag = sd((b, t, d), jnp.bfloat16), (P(None, "t"), P(None, "t"))
  for cols, work in ((d, 2048), (3 * d, 6144)):
    assert decision(gather, x, sd((d, cols), jnp.bfloat16), ag) == ("all_gather", 16, work)
    assert report._cm_work(dict(kind="ag", tp=n, a_shape=[b, t, d], w_shape=[d, cols])) == work
  assert decision(scatter, x, sd((d, d), jnp.bfloat16), (P(None, None, "t"), P("t"))) == (
      "reduce_scatter", 64, 512)
  assert report._cm_work(dict(kind="rs", tp=n, a_shape=[b, t, d], w_shape=[d, d])) == 512


# --- the link's yardstick (`peer_copy`) ---------------------------------------------------


@pytest.mark.parametrize("n,peers,num_sms", [(4, "all", 2), (4, "one", 3), (2, "all", 5)])
def test_peer_copy_block_loop_moves_every_block(n, peers, num_sms):
  """One rank's block loop in local mode: every block of every source lands once in its
  place, with more blocks than slots per SM (the slots refilled as their stores read them),
  SMs with unequal shares, and (5 SMs for 4 blocks) an SM with none. Under the race
  detector."""
  from taco_jax.pallas_kernels import peer_copy
  shards = _bf16(jax.random.key(n + num_sms), (n, 32, 64))
  rank = 1
  want = peer_copy.reference(shards, rank, peers)
  rows = 8 if num_sms < 5 else 16
  with _interpret(detect_races=True):
    got = peer_copy.peer_copy(shards[rank], "x", n=n, peers=peers, block_rows=rows, depth=2,
                              num_sms=num_sms, rank=rank, local_peers=want)
  assert got.shape == want.shape
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_peer_copy_lowers_for_hopper_and_refuses_bad_input():
  """Pulled and pushed, to one peer or all, the kernel lowers for sm_90 with its peer copies
  and semaphores; bad modes, depths and shapes are refused before anything is built."""
  from taco_jax.pallas_kernels import peer_copy
  mesh = testing.mesh_1d(4)
  for mode in peer_copy.MODES:
    for peers in peer_copy.PEERS:
      fn = jax.shard_map(lambda s, mode=mode, peers=peers: peer_copy.peer_copy(
          s, "x", n=4, mode=mode, peers=peers, num_sms=132)[None], mesh=mesh,
          in_specs=P("x"), out_specs=P("x"), check_vma=False)
      assert "mosaic_gpu" in _lowers_for_hopper(
          fn, jax.ShapeDtypeStruct((4 * 256, 256), jnp.bfloat16))
  shard = jnp.zeros((256, 256), jnp.bfloat16)
  for kwargs, message in ((dict(mode="poke"), "mode='poke'"), (dict(peers="two"), "peers='two'"),
                          (dict(depth=1), "depth=1"), (dict(block_rows=48), "do not divide"),
                          (dict(depth=8), "exceed shared memory"), (dict(n=1), "2 or more")):
    with pytest.raises(ValueError, match=message):
      peer_copy.peer_copy(shard, "x", **{"n": 4, "num_sms": 4, **kwargs})


# --- the exchange (`parallel.tp_exchange` with the kernel layers) ---------------------------


@pytest.mark.parametrize("n,split_axis,num_sms,cols", [(2, 1, 3, 512), (4, 1, 5, 384),
                                                       (2, 2, 2, 16), (4, 2, 3, 24)])
def test_exchange_block_loop_lands_every_chunk_in_place(n, split_axis, num_sms, cols):
  """One rank's block loop in local mode equals the tiled all-to-all, both ways (rows to
  columns, as the forward pass sends, and back), its own chunk included, with several
  batch rows and column blocks per chunk (narrower blocks where 256 columns do not tile a
  chunk: 384 and 24) and unequal shares per SM. Under the race detector."""
  rows = exchange.ROWS
  shape = (2, n * rows, cols) if split_axis == 1 else (2, rows, n * cols)
  x_all = _bf16(jax.random.key(n + split_axis), (n, *shape))
  rank = n - 1
  want = exchange.reference(x_all, rank, split_axis)
  with _interpret(detect_races=True):
    got = exchange.all_to_all(x_all[rank], "x", n=n, split_axis=split_axis, num_sms=num_sms,
                              rank=rank, local_x=x_all)
  assert got.shape == want.shape
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  lax_out = jax.jit(jax.shard_map(
      lambda x: jax.lax.all_to_all(x[0], "x", split_axis, 3 - split_axis, tiled=True)[None],
      mesh=testing.mesh_1d(n), in_specs=P("x"), out_specs=P("x")))(x_all)
  np.testing.assert_array_equal(np.asarray(lax_out[rank], np.float32),
                                np.asarray(want, np.float32))


def test_exchange_matmul_gradient_runs_as_exchange_gradient_says(monkeypatch):
  """`fused.exchange_matmul`'s value and gradients lowered for sm_90 on a (2, 1, 2) mesh,
  the platform check passed: the forward's exchange is our kernel, and the input's
  gradient one matmul + exchange kernel ("fused"), cuBLAS then our exchange kernel
  ("kernel") or cuBLAS then XLA's all-to-all ("xla", bench_train's ``_bxla``)."""
  monkeypatch.setattr(fused, "platform_problem", lambda devices: None)
  mesh = _dp2_tp_mesh(2)
  counts = {}
  for how in fused.EXCHANGE_GRADIENTS:
    monkeypatch.setattr(fused, "EXCHANGE_GRADIENT", how)
    loss = lambda y, w: jnp.sum(  # noqa: E731
        fused.exchange_matmul(y, w, "tensor").astype(jnp.float32) ** 2)
    fn = jax.shard_map(jax.grad(loss, (0, 1)), mesh=mesh, in_specs=(P("data"), P()),
                       out_specs=(P("data"), P()), check_vma=False)  # new: jit's cache
    text = _lowers_for_hopper(fn, jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
                              jax.ShapeDtypeStruct((512, 512), jnp.bfloat16))
    counts[how] = tuple(text.count(k) for k in ("taco_all_to_all", "taco_matmul_all_to_all",
                                                "stablehlo.all_to_all"))
  k = counts["xla"][0]  # the text names a kernel k times
  assert k > 0 and counts == {"fused": (k, k, 0), "kernel": (2 * k, 0, 0), "xla": (k, 0, 1)}
  monkeypatch.setattr(fused, "EXCHANGE_GRADIENT", "fused")
  monkeypatch.setattr(fused, "EXCHANGE_FORWARD", "fused")  # the forward's one kernel too
  monkeypatch.setattr(gemm, "num_sms", lambda: 132)  # an H200's: room for the movers
  fn = jax.shard_map(jax.grad(loss, (0, 1)), mesh=mesh, in_specs=(P("data"), P()),
                     out_specs=(P("data"), P()), check_vma=False)
  text = _lowers_for_hopper(fn, jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
                            jax.ShapeDtypeStruct((512, 512), jnp.bfloat16))
  assert [text.count(f"taco_{name}_2") for name in ("all_to_all", "all_to_all_matmul",
                                                    "matmul_all_to_all")] == [0, k, k]
  for forward in ("xla", None):  # asked for by the call (layers.EXCHANGE_PARTS) or the switch
    monkeypatch.setattr(fused, "EXCHANGE_FORWARD", "fused" if forward else "xla")
    loss = lambda y, w: jnp.sum(  # noqa: E731
        fused.exchange_matmul(y, w, "tensor", forward).astype(jnp.float32) ** 2)
    fn = jax.shard_map(jax.grad(loss, (0, 1)), mesh=mesh, in_specs=(P("data"), P()),
                       out_specs=(P("data"), P()), check_vma=False)
    text = _lowers_for_hopper(fn, jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
                              jax.ShapeDtypeStruct((512, 512), jnp.bfloat16))
    assert [text.count(f"taco_{name}_2") for name in ("all_to_all", "all_to_all_matmul",
                                                      "matmul_all_to_all")] == [0, 0, k]
    assert text.count("stablehlo.all_to_all") == 1, forward
  monkeypatch.setattr(fused, "EXCHANGE_GRADIENT", "nccl")
  with pytest.raises(ValueError, match="EXCHANGE_GRADIENT='nccl'"):
    fused.matmul_all_to_all(jnp.zeros((2, 64, 128), jnp.bfloat16),
                            jnp.zeros((128, 128), jnp.bfloat16), "tensor")


def test_exchange_lowers_for_hopper_and_refuses_bad_input():
  """Both ways, the kernel lowers for sm_90 with its peer reads and semaphores, on (2, 1, 2)
  and (2, 1, 4) meshes with TP as one of their axes; shapes its blocks do not tile are
  refused."""
  for tp in (2, 4):
    mesh = _dp2_tp_mesh(tp)
    for split_axis, shape in ((1, (2, 64 * tp, 512)), (2, (2, 128, 256 * tp))):
      fn = jax.shard_map(lambda x, a=split_axis, tp=tp: exchange.all_to_all(
          x, "tensor", n=tp, split_axis=a, num_sms=132), mesh=mesh,
          in_specs=P("data"), out_specs=P("data"), check_vma=False)
      assert "mosaic_gpu" in _lowers_for_hopper(fn, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
  for shape, split_axis, message in (((2, 96, 256), 1, "do not tile"),
                                     ((2, 128, 36), 2, "do not tile"),
                                     ((2, 128, 256), 3, "along 1 or 2"),
                                     ((2, 128, 255), 2, "does not divide")):
    with pytest.raises(ValueError, match=message):
      exchange.all_to_all(jnp.zeros(shape, jnp.bfloat16), "x", n=2, split_axis=split_axis,
                          num_sms=4)
  for depth, message in ((1, "depth=1"), (8, "exceed shared memory")):
    with pytest.raises(ValueError, match=message):
      exchange.all_to_all(jnp.zeros((2, 128, 512), jnp.bfloat16), "x", n=2, split_axis=1,
                          num_sms=4, depth=depth)


# --- the matmul + exchange (the exchange-matmul's input gradient) --------------------------


@pytest.mark.parametrize("n,b,sms,transpose_w,races", [(2, 2, 3, True, True),
                                                       (4, 1, 2, False, False)])
def test_matmul_all_to_all_kernel_pushes_each_tile_to_its_owner(n, b, sms, transpose_w, races):
  """One rank's part in local mode: every owner's rows of this rank's sequence shard equal
  that owner's part of the exchanged ``a @ w`` (fp32 accumulation, bf16 out), two column
  tiles per owner's chunk, with several sequences and unequal shares per SM; the weight
  ``[K, N]`` or ``[N, K]`` as the backward pass holds it (the owners' other rows are the
  peers' stores). XLA's all-to-all of the product agrees with the reference."""
  s, k = 64, 128
  chunk = 2 * TILING.cta_n
  ka, kw = jax.random.split(jax.random.key(n))
  a_all = _bf16(ka, (n, b, s, k))
  w = _bf16(kw, (n * chunk, k) if transpose_w else (k, n * chunk), k ** -0.5)
  rank = 1
  with _interpret(detect_races=races):
    got = matmul_all_to_all.matmul_all_to_all(a_all[rank], w, "x", n=n, num_sms=sms,
                                            tiling=TILING, transpose_w=transpose_w, rank=rank)
  assert got.shape == (n, b, n * s, chunk)
  own = slice(rank * s, (rank + 1) * s)
  for owner in range(n):
    want = matmul_all_to_all.reference(a_all, w, owner, transpose_w)
    np.testing.assert_allclose(np.asarray(got[owner][:, own], np.float32),
                               np.asarray(want[:, own], np.float32), rtol=1e-2, atol=1e-2)
  lax_out = jax.jit(jax.shard_map(
      lambda a: jax.lax.all_to_all(jnp.einsum("bsk,nk->bsn" if transpose_w else "bsk,kn->bsn",
                                              a[0], w), "x", 2, 1, tiled=True)[None],
      mesh=testing.mesh_1d(n), in_specs=P("x"), out_specs=P("x")))(a_all)
  np.testing.assert_allclose(np.asarray(lax_out[0], np.float32), np.asarray(
      matmul_all_to_all.reference(a_all, w, 0, transpose_w), np.float32), rtol=1e-2, atol=1e-2)


def test_matmul_all_to_all_lowers_for_hopper_and_refuses_bad_input():
  """With its peer stores and semaphores through the sm_90 lowering, on (2, 1, 2) and
  (2, 1, 4) meshes; the 256-column tiles where they tile a chunk, else 128; shapes that
  do not divide refused."""
  mx = matmul_all_to_all
  for tp in (2, 4):
    fn = jax.shard_map(lambda a, w, tp=tp: mx.matmul_all_to_all(
        a, w, "tensor", n=tp, num_sms=132, transpose_w=True), mesh=_dp2_tp_mesh(tp),
        in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False)
    sd = jax.ShapeDtypeStruct
    assert "mosaic_gpu" in _lowers_for_hopper(fn, sd((4, 256, 512), jnp.bfloat16),
                                              sd((512 * tp, 512), jnp.bfloat16))
  assert mx.default_tiling((8, 512, 2560), (2560, 2560), 4).cta_n == 128  # chunks of 640
  assert mx.default_tiling((8, 512, 2048), (2048, 2048), 4).cta_n == 256
  a = jnp.zeros((2, 128, 256), jnp.bfloat16)
  for w_shape, n, message in (((128, 512), 2, "do not contract"),
                              ((256, 770), 4, "do not divide over 4"),
                              ((256, 192), 3, "do not tile the 64-column chunk"),
                              ((256, 512), 1, "2 or more ranks")):
    with pytest.raises(ValueError, match=message):
      mx.matmul_all_to_all(a, jnp.zeros(w_shape, jnp.bfloat16), "x", n=n, num_sms=4,
                           tiling=TILING)


# --- the all-to-all + matmul (the exchange-matmul's forward, `fused.EXCHANGE_FORWARD`) -----


@pytest.mark.parametrize("n,b,sms,movers,c", [(2, 2, 4, 2, 64), (4, 1, 3, 1, 32)])
def test_all_to_all_matmul_kernel_per_rank(n, b, sms, movers, c):
  """One rank's kernel in local mode: its movers land every rank's columns of its sequence
  shard in the exchanged x, its own included, exactly (several sequences, two row tiles,
  unequal shares per mover, chunks narrower than a block), and the other SMs multiply x
  by the whole weight (fp32 accumulation, bf16 out) over tiles dealt among themselves.
  (The interpreter runs the CTAs one after the other, movers first: the row waits, which
  need the GPU's semaphores, are left to the lowering test and the GPU benchmark. Its race
  detector, which orders no CTA after another, reports the GEMM's reads of what the movers
  wrote, so it is off here.)"""
  s, d = 64, 128
  ky, kw = jax.random.split(jax.random.key(n))
  y_all = _bf16(ky, (n, b, n * s, c))
  w = _bf16(kw, (n * c, d), (n * c) ** -0.5)
  rank = n - 1
  with _interpret():
    out, x = all_to_all_matmul.all_to_all_matmul(y_all[rank], w, "x", n=n, num_sms=sms,
                                                 movers=movers, tiling=TILING, rank=rank,
                                                 local_y=y_all)
  want_out, want_x = all_to_all_matmul.reference(y_all, w, rank)
  np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                             rtol=1e-2, atol=1e-2)


def test_all_to_all_matmul_lowers_for_hopper_and_refuses_bad_input():
  """With its peer reads, row counts and release through the sm_90 lowering, on (2, 1, 2)
  and (2, 1, 4) meshes; shapes and SM splits that do not fit refused."""
  for tp in (2, 4):
    fn = jax.shard_map(lambda y, w, tp=tp: all_to_all_matmul.all_to_all_matmul(
        y, w, "tensor", n=tp, num_sms=132)[0], mesh=_dp2_tp_mesh(tp),
        in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False)
    sd = jax.ShapeDtypeStruct
    assert "mosaic_gpu" in _lowers_for_hopper(fn, sd((4, 256 * tp, 512 // tp), jnp.bfloat16),
                                              sd((512, 512), jnp.bfloat16))
  y = jnp.zeros((2, 256, 64), jnp.bfloat16)
  for w_shape, n, movers, message in (((64, 128), 2, 2, "do not contract"),
                                      ((128, 128), 1, 2, "2 or more ranks"),
                                      ((128, 128), 2, 4, "4 movers of 4 SMs"),
                                      ((192, 128), 3, 1, "does not divide")):
    with pytest.raises(ValueError, match=message):
      all_to_all_matmul.all_to_all_matmul(y, jnp.zeros(w_shape, jnp.bfloat16), "x", n=n,
                                          num_sms=4, movers=movers, tiling=TILING)
