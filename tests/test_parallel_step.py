"""The 3D-parallel step against the single-device model, and the collectives it compiles to.

One tiny fp32 GPT, one batch; per mesh the loss-and-gradients function is compiled twice
(compression off / on) and every test of that mesh reuses the two compiled programs (on
the meshes of INTERLEAVED, also with `interleave=2`).
"""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from taco_jax.models import attention, gelu_mlp, split_qkv
from taco_jax.models.decoder import loss_fn
from taco_jax.pallas_kernels import common, wire
from taco_jax import testing
from taco_jax.codec import CompressionConfig
from taco_jax.tp import layers as tp_layers, layout as layout_lib, step as step_lib
from taco_jax.testing import hlo
from taco_jax.plan import CompressionPlan
from taco_jax.tp.mesh import make_mesh

# (dp, pp, tp); (1, 2, 4) is slow: the default run compares it with the single-device model
# in test_pipeline_schedules, test_overlap_matches_single_device and the Qwen block's test;
# so is (2, 1, 4): test_kernel_layers_match_single_device compares it uncompressed (on CPU
# the kernel layers' XLA path), and (2, 2, 2) runs data and tensor axes compressed
MESHES = [(1, 1, 8), (2, 2, 2), (8, 1, 1), pytest.param((2, 1, 4), marks=pytest.mark.slow),
          pytest.param((1, 2, 4), marks=pytest.mark.slow)]
INTERLEAVED = [(2, 2, 2)]  # meshes whose run also compiles interleave=2 ("off_il2", "on_il2")
CFG = layout_lib.model_config(dict(vocab_size=256, n_layers=2, d_model=128, n_heads=8,
                                  d_ff=256, max_seq_len=32, dtype="float32"))
BATCH, SEQ, MICRO = 16, 32, 2
CODEC = CompressionConfig(format="e4m3", group_size=32)
ON = CompressionPlan(tp_forward=CODEC, tp_backward=CODEC, pp=CODEC, dp=CODEC)
# fp32 agreement: a few units of roundoff per reduction level, relative to the leaf's scale.
F32_TOL = 64 * testing.unit_roundoff(jnp.float32)
# Each compressed message has relative L2 error <= eps (one fp8 unit roundoff; see
# taco_jax.testing). To first order the loss sees the forward messages only (<= eps); a
# gradient is an activation times a cotangent (<= 2 eps), and a compressed two-shot DP
# all-reduce rounds it twice more (<= 2 eps).
EPS = testing.unit_roundoff(CODEC.fp8_dtype)
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # CPU codegen effort; same HLO


def _leaves(tree):
  return [(jax.tree_util.keystr(p), np.asarray(x, np.float64))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _tokens():
  return jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CFG.vocab_size)


def _parallel(state):
  return layout_lib.to_parallel(nnx.to_pure_dict(nnx.state(state, nnx.Param)))


@pytest.fixture(scope="module")
def reference():
  """(params, loss, grads) of the single-device model, params/grads in the parallel layout."""
  model = layout_lib.single_device_model(CFG, seed=0)
  (loss, _), grads = jax.value_and_grad(lambda m: loss_fn(m, _tokens()), has_aux=True)(model)
  return _parallel(model), float(loss), jax.device_get(_parallel(grads))


@pytest.fixture(scope="module", params=MESHES, ids=lambda m: "dp%d-pp%d-tp%d" % m)
def run(request, reference):
  dp, pp, tp = request.param
  mesh = make_mesh(dp, pp, tp)
  params = layout_lib.shard_params(CFG, reference[0], mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  out = {"mesh": mesh, "layout": request.param,
         "shard_elems": BATCH // dp // MICRO * SEQ // tp * CFG.d_model}
  variants = [("off", CompressionPlan(), 1), ("on", ON, 1)]
  if request.param in INTERLEAVED:
    variants += [("off_il2", CompressionPlan(), 2), ("on_il2", ON, 2)]
  for name, plan, k in variants:
    spec = step_lib.ParallelSpec(CFG, dp, pp, tp, MICRO, plan, interleave=k)
    out[name] = _loss_grads_collectives(spec, mesh, params, tokens)
  return out


def _loss_grads_collectives(spec, mesh, params, tokens):
  exe = jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens).compile(
      compiler_options=FAST_COMPILE)
  loss, grads = exe(params, tokens)
  return float(loss), jax.device_get(grads), hlo.collectives(exe.as_text(), mesh)


def test_uncompressed_matches_single_device(run, reference):
  _, ref_loss, ref_grads = reference
  loss, grads, _ = run["off"]
  np.testing.assert_allclose(loss, ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(grads), _leaves(ref_grads), strict=True):
    err = np.max(np.abs(g - r))
    assert err <= F32_TOL * np.max(np.abs(r)), (path, err, np.max(np.abs(r)))


def test_compressed_within_fp8_bound(run, reference):
  _, ref_loss, ref_grads = reference
  loss, grads, _ = run["on"]
  assert abs(loss - ref_loss) <= EPS * abs(ref_loss)
  bound = EPS * (2 + (2 if run["layout"][0] > 1 else 0))
  for (path, g), (_, r) in zip(_leaves(grads), _leaves(ref_grads), strict=True):
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert rel <= bound, (path, rel, bound)


def _activation_messages(colls, axis, threshold):
  """Messages over exactly `axis` of at least one activation shard's elements, other than
  all-reduces (over "tensor": the per-token softmax sums and the sequence-parallel sums of
  replicated parameters' gradients, uncompressed by design)."""
  kinds = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute")
  return [c for c in colls if c.axes == {axis} and c.kind in kinds and
          c.elements >= threshold]


def test_hlo_compressed_moves_fp8(run):
  """Every activation-sized TP / PP / DP message is u8 wire rows (FP8 codes with their
  groups' two fp32 scales inside: 8 more bytes per G code bytes); no large fp32 all-reduce
  over "data" remains."""
  dp, pp, tp = run["layout"]
  colls = run["on"][2]
  for axis, size in (("tensor", tp), ("pipeline", pp), ("data", dp)):
    msgs = _activation_messages(colls, axis, run["shard_elems"])
    assert bool(msgs) == (size > 1), (axis, msgs)
    bad = [c.line for c in msgs if not c.fp8]
    assert not bad, f"uncompressed {axis} messages:\n" + "\n".join(bad)
    for c in msgs:  # [..., D + 8 D / G]: raises unless the row is whole groups + scales
      wire.message_width(c.shape[-1], CODEC.group_size)
  assert not [c for c in colls if c.axes == {"data"} and c.kind == "all-reduce" and
              c.elements >= run["shard_elems"]]


def test_hlo_uncompressed_moves_no_fp8(run):
  dp, pp, tp = run["layout"]
  colls = run["off"][2]
  assert not [c.line for c in colls if c.fp8]
  for axis, size in (("tensor", tp), ("pipeline", pp)):
    assert bool(_activation_messages(colls, axis, run["shard_elems"])) == (size > 1)


def test_qwen_block_matches_single_device():
  """The Qwen-style block (RMSNorm, SwiGLU, rotary, GQA with 4 KV heads) on (1, 2, 4)."""
  cfg = layout_lib.model_config(dict(vocab_size=256, n_layers=2, d_model=64, n_heads=8,
                                    n_kv_heads=4, d_ff=128, max_seq_len=32, dtype="float32",
                                    block="qwen"))
  model = layout_lib.single_device_model(cfg, seed=0)
  tokens = _tokens()
  (ref_loss, _), ref = jax.value_and_grad(lambda m: loss_fn(m, tokens), has_aux=True)(model)
  mesh = make_mesh(1, 2, 4)
  spec = step_lib.ParallelSpec(cfg, 1, 2, 4, MICRO)
  loss, grads = jax.jit(step_lib.loss_and_grads_fn(spec, mesh))(
      layout_lib.shard_params(cfg, _parallel(model), mesh),
      jax.device_put(tokens, step_lib.batch_sharding(mesh)))
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(jax.device_get(grads)), _leaves(_parallel(ref)),
                               strict=True):
    assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), path


def test_model_attention_reaches_the_blocks_of_both_parallel_steps():
  """`model.attention` is the blocks' own, inside the shard_map step and under GSPMD: the
  meshes above run it as `auto` (XLA on CPU) and equal the single-device model; asked for
  `cudnn`, tracing either step on CPU is the error that says cuDNN cannot run here."""
  from benchmarks import gspmd
  cfg = dataclasses.replace(CFG, attention="cudnn")
  tokens = lambda mesh: jax.ShapeDtypeStruct(  # noqa: E731
      (BATCH, SEQ + 1), jnp.int32, sharding=step_lib.batch_sharding(mesh))
  mesh = make_mesh(1, 1, 4, devices=jax.devices()[:4])
  spec = step_lib.ParallelSpec(cfg, 1, 1, 4, MICRO)
  with pytest.raises(ValueError, match=r"model.attention=cudnn: .* no GPU"):
    jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(
        layout_lib.abstract_params(cfg, mesh), tokens(mesh))
  mesh = gspmd.make_mesh(1, 4, devices=jax.devices()[:4])
  params = jax.eval_shape(lambda: gspmd.init_params(cfg, mesh))
  with pytest.raises(ValueError, match=r"model.attention=cudnn: .* no GPU"):
    jax.jit(gspmd.loss_and_grads_fn(cfg, mesh)).lower(params, tokens(mesh))


@pytest.mark.parametrize("layout", [
    # dp = 2 adds no ring path of its own: the data axis only sums the gradients after it
    pytest.param((2, 1, 4), marks=pytest.mark.slow), (1, 2, 4)],
    ids=lambda m: "dp%d-pp%d-tp%d" % m)
def test_overlap_matches_single_device(layout, reference):
  """`parallel.tp_overlap="ring"` (ring collective matmuls) computes the same loss and gradients:
  exactly to fp32 roundoff uncompressed, within the FP8 bound compressed (the ring's
  reduce-scatter rounds n - 1 running sums: sqrt(n - 1) times one message's bound)."""
  ref_params, ref_loss, ref_grads = reference
  dp, pp, tp = layout
  mesh = make_mesh(dp, pp, tp)
  params = layout_lib.shard_params(CFG, ref_params, mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  for plan in (CompressionPlan(), ON):
    spec = step_lib.ParallelSpec(CFG, dp, pp, tp, MICRO, plan, tp_overlap="ring")
    exe = jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens).compile(
        compiler_options=FAST_COMPILE)
    loss, grads = exe(params, tokens)
    assert any(c.kind == "collective-permute" for c in hlo.collectives(exe.as_text(), mesh))
    if not plan.any:
      np.testing.assert_allclose(float(loss), ref_loss, rtol=F32_TOL)
    eps = EPS * np.sqrt(tp - 1)
    assert abs(float(loss) - ref_loss) <= eps * abs(ref_loss)
    for (path, g), (_, r) in zip(_leaves(jax.device_get(grads)), _leaves(ref_grads),
                                 strict=True):
      if plan.any:
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel <= eps * (2 + (2 if dp > 1 else 0)), (path, rel)
      else:
        assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), path


@pytest.mark.parametrize("layout", [(1, 1, 8), (2, 1, 4), (2, 2, 2)],
                         ids=lambda m: "dp%d-pp%d-tp%d" % m)
def test_kernel_layers_match_single_device(layout, reference):
  """`parallel.tp_overlap="kernel"`: the layers' custom VJPs (`taco_jax.tp.fused`, on
  CPU their XLA path) give the single-device loss and gradients, uncompressed."""
  ref_params, ref_loss, ref_grads = reference
  dp, pp, tp = layout
  mesh = make_mesh(dp, pp, tp)
  params = layout_lib.shard_params(CFG, ref_params, mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(CFG, dp, pp, tp, MICRO, tp_overlap="kernel")
  fn = step_lib.loss_and_grads_fn(spec, mesh)
  assert "custom_vjp_call" in str(jax.make_jaxpr(fn)(params, tokens))
  loss, grads = jax.jit(fn).lower(params, tokens).compile(compiler_options=FAST_COMPILE)(
      params, tokens)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(jax.device_get(grads)), _leaves(ref_grads), strict=True):
    assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), path
  if layout == (2, 2, 2):  # the trainer evaluates through the kernel layers too
    evaluate = jax.jit(step_lib.make_eval_step(spec, mesh)).lower(params, tokens).compile(
        compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(float(evaluate(params, tokens)), ref_loss, rtol=F32_TOL)


def test_site_overrides_reach_every_collective(reference):
  """`CompressionPlan.sites`: with every site set to plain, a fully compressed plan compiles
  to the uncompressed program's collectives and computes its loss and gradients exactly;
  with every family off, one site override alone compresses that one collective."""
  from taco_jax.plan import SITES
  mesh = make_mesh(2, 2, 2)
  params = layout_lib.shard_params(CFG, reference[0], mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))

  def compiled(plan):
    spec = step_lib.ParallelSpec(CFG, 2, 2, 2, MICRO, plan)
    exe = jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens).compile(
        compiler_options=FAST_COMPILE)
    return exe(params, tokens), hlo.collectives(exe.as_text(), mesh)

  (loss_off, grads_off), colls_off = compiled(CompressionPlan())
  all_plain = CompressionPlan(tp_forward=CODEC, tp_backward=CODEC, pp=CODEC, dp=CODEC,
                              sites=tuple((s, None) for s in SITES))
  (loss, grads), colls = compiled(all_plain)
  assert not [c.line for c in colls if c.fp8]
  assert float(loss) == float(loss_off)
  for (path, g), (_, r) in zip(_leaves(grads), _leaves(grads_off), strict=True):
    np.testing.assert_array_equal(g, r, err_msg=path)

  only_pp_fwd = CompressionPlan(sites=(("pp/fwd", CODEC),))
  _, colls = compiled(only_pp_fwd)
  fp8 = [c for c in colls if c.fp8]
  assert fp8 and all(c.axes == {"pipeline"} for c in fp8)
  # forward sends only: the backward shift's permutation (stage s+1 -> s) stays plain
  assert len({c.line for c in fp8}) < len({c.line for c in colls if c.axes == {"pipeline"}})


def _assert_f32_close(loss, grads, ref_loss, ref_grads):
  np.testing.assert_allclose(loss, ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(grads), _leaves(ref_grads), strict=True):
    assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), path


def _block_messages(colls, rows):
  """All-gathers / reduce-scatters over "tensor" of residual-stream activations of `rows`
  sequences ([rows, T, D] gathered, [rows, T/tp, D] scattered), each instruction once (the
  layer scan's bodies count once however many layers they run)."""
  return collections.Counter(
      c.kind for c in colls if c.axes == {"tensor"} and c.kind in ("all-gather",
      "reduce-scatter") and c.shape[0] == rows and c.shape[-1] == CFG.d_model)


def test_interleave_matches_one_chain_and_doubles_the_block_collectives():
  """`interleave=2` on (1, 1, 4): the loss and gradients of `interleave=1` to fp32 roundoff
  (the weight gradients sum the batch in another order), and in the compiled CPU program
  each layer body's all-gathers / reduce-scatters twice, on half the rows, next to the same
  head collectives: nothing merged the two chains back (the GPU's DotMerger and combiners,
  which could, are not in the CPU pipeline; `step.INTERLEAVE_XLA_OPTIONS`)."""
  mesh = make_mesh(1, 1, 4, devices=jax.devices()[:4])
  model = layout_lib.single_device_model(CFG, seed=0)
  params = layout_lib.shard_params(CFG, _parallel(model), mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  (loss1, grads1, colls1), (loss2, grads2, colls2) = (
      _loss_grads_collectives(step_lib.ParallelSpec(CFG, 1, 1, 4, MICRO, interleave=k),
                              mesh, params, tokens) for k in (1, 2))
  _assert_f32_close(loss2, grads2, loss1, grads1)
  rows = BATCH // MICRO
  head = _block_messages(colls2, rows)  # the LM head's gather and its transpose
  blocks = _block_messages(colls1, rows) - head
  # 2 forward + 2 backward (transposed) of each kind per block, in the forward and the
  # backward layer scan
  assert blocks == {"all-gather": 4, "reduce-scatter": 4}
  assert _block_messages(colls2, rows // 2) == {k: 2 * n for k, n in blocks.items()}


@pytest.mark.parametrize("run", INTERLEAVED, indirect=True, ids=lambda m: "dp%d-pp%d-tp%d" % m)
def test_interleave_with_pipeline_and_compression(run):
  """`interleave=2` on (2, 2, 2) (GPipe over 2 stages, each tick splitting its micro-batch):
  uncompressed, the loss and gradients of `interleave=1` to fp32 roundoff; compressed,
  within the fp8 bounds of the compressed test. Each FP8 group lies in one token, so the
  messages are those of `interleave=1` row by row, except where a matmul over fewer rows
  rounds a value across an FP8 rounding boundary (that element then moves by one step)."""
  loss, grads, _ = run["off"]
  _assert_f32_close(*run["off_il2"][:2], loss, grads)
  loss, grads, _ = run["on"]
  loss2, grads2, _ = run["on_il2"]
  assert abs(loss2 - loss) <= EPS * abs(loss)
  for (path, g), (_, r) in zip(_leaves(grads2), _leaves(grads), strict=True):
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert rel <= 2 * EPS, (path, rel)


def test_interleave_errors():
  with pytest.raises(ValueError, match=r"parallel.interleave=0 must be a positive integer"):
    step_lib.ParallelSpec(CFG, 1, 1, 8, interleave=0)
  with pytest.raises(ValueError, match=r"parallel.interleave=2.0 must be"):
    step_lib.ParallelSpec(CFG, 1, 1, 8, interleave=2.0)
  mesh = make_mesh(1, 1, 8)
  spec = step_lib.ParallelSpec(CFG, 1, 1, 8, MICRO, interleave=3)
  params = layout_lib.abstract_params(CFG, mesh)
  tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32,
                                sharding=step_lib.batch_sharding(mesh))
  with pytest.raises(ValueError, match=r"data.batch_size=16 is not divisible by parallel.dp \* "
                     r"parallel.microbatches \* parallel.interleave = 1\*2\*3 = 6"):
    jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens)
  assert step_lib.compiler_options(spec.interleave) == step_lib.INTERLEAVE_XLA_OPTIONS
  assert step_lib.compiler_options(step_lib.ParallelSpec(CFG, 1, 1, 8).interleave) == {}


def test_python_api_runs_the_config_checks():
  """ParallelSpec checks the model and the layout when built, the step functions the mesh
  they are given and the batch they are called with: the config path's checks
  (`mesh.layout_errors`, `DecoderConfig.errors`), before anything is traced or reshaped."""
  heads4 = dataclasses.replace(CFG, n_heads=4)
  with pytest.raises(ValueError, match=r"invalid parallel layout:\n  model.n_heads=4 \(attention "
                     r"heads\) is not divisible by parallel.tp=8"):
    step_lib.ParallelSpec(heads4, 1, 1, 8)
  with pytest.raises(ValueError, match=r"model.d_model=130 is not divisible by model.n_heads=8"):
    step_lib.ParallelSpec(dataclasses.replace(CFG, d_model=130), 1, 1, 2)
  with pytest.raises(ValueError, match=r"model.n_layers=2 is not divisible by parallel.pp=4"):
    step_lib.ParallelSpec(CFG, 2, 4, 1)
  with pytest.raises(ValueError, match=r"parallel.save_tp_outputs=True keeps what model.remat"):
    step_lib.ParallelSpec(CFG, 1, 1, 8, save_tp_outputs=True)

  spec = step_lib.ParallelSpec(CFG, 1, 2, 4, MICRO)
  tx = optax.sgd(0.1)
  for make in (step_lib.loss_and_grads_fn, step_lib.make_eval_step,
               lambda s, m: step_lib.make_train_step(s, m, tx)):
    with pytest.raises(ValueError, match=r"the mesh \{'data': 1, 'pipeline': 1, 'tensor': 8\} "
                       r"does not match the layout dp=1, pp=2, tp=4"):
      make(spec, make_mesh(1, 1, 8))

  mesh = make_mesh(1, 2, 4)
  params = layout_lib.abstract_params(CFG, mesh)
  opt_state = jax.eval_shape(tx.init, params)
  calls = {"loss_and_grads_fn": lambda t: step_lib.loss_and_grads_fn(spec, mesh)(params, t),
           "make_eval_step": lambda t: step_lib.make_eval_step(spec, mesh)(params, t),
           "make_train_step": lambda t: step_lib.make_train_step(spec, mesh, tx)(
               params, opt_state, t)}
  for shape, needle in (((BATCH, 31), r"data.seq_len=30 is not divisible by parallel.tp=4 "
                                      r"\(sequence parallelism shards it\)"),
                        ((BATCH, 65), r"data.seq_len=64 exceeds model.max_seq_len=32"),
                        ((5, SEQ + 1), r"data.batch_size=5 is not divisible by parallel.dp \* "
                                       r"parallel.microbatches = 1\*2 = 2")):
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32)
    for name, call in calls.items():
      with pytest.raises(ValueError, match=rf"tokens_BT1 of shape {re.escape(str(shape))}.*"
                         rf"\n  {needle}"):
        jax.eval_shape(call, tokens)


def test_init_params_are_the_single_device_ones_to_rounding():
  """What `model.init_params` promises: the single-device model's parameters to 1 ulp
  (jitted vs op-by-op initialization)."""
  ref = _parallel(layout_lib.single_device_model(CFG, seed=3))
  got = jax.device_get(layout_lib.init_params(CFG, make_mesh(2, 2, 2), seed=3))
  for (path, x), (_, r) in zip(_leaves(got), _leaves(ref), strict=True):
    np.testing.assert_array_max_ulp(x.astype(np.float32), r.astype(np.float32), maxulp=1)


def test_exchange_matches_single_device_and_sends_the_attention_input(reference):
  """`parallel.tp_exchange`: the attention's out-projection all-to-alls its input and
  all-gathers its weight instead of reduce-scattering its output (`layers.exchange_matmul`).
  The loss and gradients are the single-device ones to fp32 roundoff, between XLA's
  collectives and with the kernel layers (on CPU their XLA path: `fused.exchange_matmul`'s custom
  VJP), under remat with the TP outputs saved; the attention's
  reduce-scatter of the residual stream is gone from every block, its input's all-to-all
  in its place."""
  ref_params, ref_loss, ref_grads = reference
  cfg = dataclasses.replace(CFG, remat=True)
  mesh = make_mesh(1, 1, 4, devices=jax.devices()[:4])
  params = layout_lib.shard_params(CFG, ref_params, mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  x_bsd = (BATCH // MICRO, SEQ // 4, CFG.d_model)
  tensor = lambda colls, kind: [c for c in colls  # noqa: E731
                                if c.kind == kind and c.axes == {"tensor"}]
  got = {}
  for overlap, exchange in (("kernel", False), ("kernel", True), ("none", True)):
    spec = step_lib.ParallelSpec(cfg, 1, 1, 4, MICRO, save_tp_outputs=True, tp_overlap=overlap,
                                 tp_exchange=exchange, scan_layers=False)
    got[overlap, exchange] = loss, grads, colls = _loss_grads_collectives(spec, mesh, params,
                                                                          tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=F32_TOL)
    for (path, g), (_, r) in zip(_leaves(grads), _leaves(ref_grads), strict=True):
      assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), (exchange, path)
  plain_rs, exchanged_rs = (sum(c.shape == x_bsd for c in tensor(got["kernel", e][2],
                                                                 "reduce-scatter"))
                            for e in (False, True))
  assert plain_rs - exchanged_rs == CFG.n_layers * MICRO, (plain_rs, exchanged_rs)
  # what the attention sends instead: its input, d_model / tp wide (the CPU compiler
  # lowers other collectives to all-to-alls too, of other widths)
  attention_input = lambda *k: [c for c in tensor(got[k][2], "all-to-all")  # noqa: E731
                                if c.shape[-1] == CFG.d_model // 4]
  assert attention_input("kernel", True) and attention_input("none", True)
  assert not attention_input("kernel", False)
  # the kernel layers' backward (`fused.exchange_matmul`) sends as many: no more remat
  assert len(attention_input("kernel", True)) == len(attention_input("none", True))


@pytest.mark.parametrize("layout, overlap", [((1, 1, 4), "kernel"), ((2, 1, 2), "none")])
def test_exchange_weights_gathered_before_the_layers(monkeypatch, reference, layout, overlap):
  """`step.GATHER_EXCHANGE_WEIGHTS`: the unrolled layers' exchange weights are gathered in one
  all-gather a weight family (here the out-projection's, and at tp = 4 the MLP-out's too: its
  input is narrower than its output) before the first layer, none in a layer; the loss and
  gradients are the single-device ones (and with `overlap_grad_reduce` at dp > 1, whose
  reduction the gather follows)."""
  ref_params, ref_loss, ref_grads = reference
  cfg = dataclasses.replace(CFG, remat=True)
  dp, pp, tp = layout
  mesh = make_mesh(*layout, devices=jax.devices()[:dp * pp * tp])
  params = layout_lib.shard_params(CFG, ref_params, mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(cfg, dp, pp, tp, 1, save_tp_outputs=True, tp_overlap=overlap,
                               tp_exchange=True, scan_layers=False, overlap_grad_reduce=dp > 1)
  weights = [(CFG.d_model // tp, CFG.d_model)]  # one layer's shard of each exchange weight
  if CFG.d_ff // tp < CFG.d_model:
    weights.append((CFG.d_ff // tp, CFG.d_model))
  gathers = {}
  for gather in (False, True):
    monkeypatch.setattr(step_lib, "GATHER_EXCHANGE_WEIGHTS", gather)
    jaxpr = jax.make_jaxpr(step_lib.loss_and_grads_fn(spec, mesh))(params, tokens).jaxpr
    gathers[gather] = collections.Counter(
        e.invars[0].aval.shape for e in _eqns(jaxpr) if e.primitive.name == "all_gather"
        and e.invars[0].aval.shape[-2:] in weights)
  assert gathers[False] == {w: CFG.n_layers for w in weights}, gathers[False]
  assert gathers[True] == {(CFG.n_layers, *w): 1 for w in weights}, gathers[True]
  loss, grads, _ = _loss_grads_collectives(spec, mesh, params, tokens)
  np.testing.assert_allclose(loss, ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(grads), _leaves(ref_grads), strict=True):
    assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), path


@pytest.mark.parametrize("overlap, gather_before, parts", [("kernel", False, 2),
                                                            ("none", True, 4)])
def test_exchange_in_batch_slices_matches_single_device(monkeypatch, reference, overlap,
                                                        gather_before, parts):
  """`layers.EXCHANGE_PARTS`: each block runs its attention and exchanging out-projection
  per slice of the batch, each slice's exchange its own all-to-all (with the kernel layers
  XLA's, `fused.all_to_all_matmul`'s "xla", but the last slice's, which is the kernel's
  and on CPU XLA's too) and the weight gathered once a layer (or before the layers); the
  loss and gradients are the single-device ones."""
  ref_params, ref_loss, ref_grads = reference
  cfg = dataclasses.replace(CFG, remat=True)
  mesh = make_mesh(1, 1, 4, devices=jax.devices()[:4])
  params = layout_lib.shard_params(CFG, ref_params, mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(cfg, 1, 1, 4, 1, save_tp_outputs=True, tp_overlap=overlap,
                               tp_exchange=True, scan_layers=False)
  monkeypatch.setattr(tp_layers, "EXCHANGE_PARTS", parts)
  monkeypatch.setattr(step_lib, "GATHER_EXCHANGE_WEIGHTS", gather_before)
  jaxpr = jax.make_jaxpr(step_lib.loss_and_grads_fn(spec, mesh))(params, tokens).jaxpr
  shapes = collections.Counter(e.invars[0].aval.shape for e in _eqns(jaxpr)
                               if e.primitive.name in ("all_to_all", "all_gather"))
  y = (BATCH, SEQ, CFG.d_model // 4)  # one rank's attention output, the whole batch
  slice_y = (BATCH // parts, *y[1:])
  assert shapes[slice_y] == parts * CFG.n_layers and not shapes[y], shapes  # a2a per slice
  weight = (CFG.d_model // 4, CFG.d_model)
  assert shapes[(CFG.n_layers, *weight) if gather_before else weight] == (
      1 if gather_before else CFG.n_layers), shapes
  loss, grads, _ = _loss_grads_collectives(spec, mesh, params, tokens)
  np.testing.assert_allclose(loss, ref_loss, rtol=F32_TOL)
  for (path, g), (_, r) in zip(_leaves(grads), _leaves(ref_grads), strict=True):
    assert np.max(np.abs(g - r)) <= F32_TOL * np.max(np.abs(r)), path


def test_save_tp_outputs_keeps_the_recomputation_from_communicating():
  """With `model.remat` the backward layer scan recomputes each block, its TP collectives
  included; `save_tp_outputs=True` keeps their outputs instead (`step.remat_policy`), so
  the compiled program has the block collectives of a step without remat, and the same
  loss and gradients (compressed too: the saved messages are the ones the forward sent)."""
  cfg = dataclasses.replace(CFG, remat=True)
  mesh = make_mesh(1, 1, 4, devices=jax.devices()[:4])
  params = layout_lib.shard_params(CFG, _parallel(layout_lib.single_device_model(CFG, seed=0)),
                                  mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  rows = BATCH // MICRO
  got = {}
  for name, c, plan, save, dots, scan in (
      ("plain", CFG, CompressionPlan(), False, False, True),
      ("remat", cfg, CompressionPlan(), False, False, True),
      ("saved", cfg, CompressionPlan(), True, False, True),
      ("saved_dots", cfg, CompressionPlan(), True, True, True),  # and the attention's
      ("dots_unrolled", cfg, CompressionPlan(), False, True, False),  # gpt_1_3b's setting
      ("remat_on", cfg, ON, False, False, True),
      ("saved_on", cfg, ON, True, False, True)):
    spec = step_lib.ParallelSpec(c, 1, 1, 4, MICRO, plan, save_tp_outputs=save, save_dots=dots,
                                 save_attention=name == "saved_dots", scan_layers=scan)
    got[name] = _loss_grads_collectives(spec, mesh, params, tokens)
  plain, remat, saved, saved_dots = (_block_messages(got[k][2], rows)
                                     for k in ("plain", "remat", "saved", "saved_dots"))
  assert saved == plain and saved_dots == plain
  # recomputed: both gathers of the block and the reduce-scatter its MLP input needs
  assert remat == plain + collections.Counter({"all-gather": 2, "reduce-scatter": 1}), remat
  wire = lambda k: collections.Counter(c.kind for c in got[k][2]  # noqa: E731
                                       if c.axes == {"tensor"} and c.dtype == "u8")
  # compressed: the recomputation's two gathers of wire rows, and the all-to-all(s) of its
  # reduce-scatter (which the CPU compiler may split), are gone too
  spared = wire("remat_on") - wire("saved_on")
  assert not wire("saved_on") - wire("remat_on")
  assert spared["all-gather"] == 2 and spared["all-to-all"] > 0, spared
  _assert_f32_close(*got["saved"][:2], *got["remat"][:2])
  # parallel.save_dots and save_attention too
  _assert_f32_close(*got["saved_dots"][:2], *got["remat"][:2])
  _assert_f32_close(*got["dots_unrolled"][:2], *got["remat"][:2])  # parallel.scan_layers
  _assert_f32_close(*got["saved_on"][:2], *got["remat_on"][:2])
  assert step_lib.remat_policy(step_lib.ParallelSpec(cfg, 1, 1, 4)) is None


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of every jaxpr inside it (scan bodies, remat, shard_map)."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _eqns(sub)


def _dot_counts(jaxpr) -> collections.Counter:
  """dot_generals in `jaxpr` and every jaxpr inside it: "batched" (batch dimensions: the
  attention's) or "weight" (none: the linear layers')."""
  return collections.Counter(
      "batched" if e.params["dimension_numbers"][1][0] else "weight"
      for e in _eqns(jaxpr) if e.primitive.name == "dot_general")


def _step_jaxpr(cfg, tp: int, **spec_fields):
  """The jaxpr of the loss and gradients of `cfg` on a (1, 1, tp) mesh, abstract inputs."""
  mesh = make_mesh(1, 1, tp, devices=jax.devices()[:tp])
  tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32,
                                sharding=step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(cfg, 1, 1, tp, MICRO, **spec_fields)
  return jax.make_jaxpr(step_lib.loss_and_grads_fn(spec, mesh))(
      layout_lib.abstract_params(cfg, mesh), tokens).jaxpr


def _count(jaxpr, primitive: str, name: str | None = None) -> int:
  """How many `primitive` equations `jaxpr` (and every jaxpr inside it) has; with `name`,
  how many values it gives that checkpoint name (`primitive` "name")."""
  return sum(e.primitive.name == primitive and (name is None or e.params["name"] == name)
             for e in _eqns(jaxpr))


@pytest.mark.parametrize("tp", [2, 1])
def test_save_dots_keeps_the_recomputation_from_redoing_the_matmuls(tp):
  """`save_dots` (`step.remat_policy`) keeps the outputs of the blocks' weight matmuls: the
  step's program (jaxpr, per scan body) has the weight matmuls of a step without remat,
  where the plain remat has 3 more (QKV, attention-out, MLP-in recomputed); with or without
  `save_tp_outputs`, on a TP and a data-parallel mesh. The attention's batched matmuls are
  still recomputed (2 more than without remat)."""
  cfg = dataclasses.replace(CFG, remat=True)
  counts = lambda c, **saves: _dot_counts(_step_jaxpr(c, tp, **saves))  # noqa: E731

  none, remat = counts(CFG), counts(cfg)
  assert remat == none + collections.Counter(weight=3, batched=2), (remat, none)
  for saves in (dict(save_dots=True), dict(save_dots=True, save_tp_outputs=True)):
    assert counts(cfg, **saves) == none + collections.Counter(batched=2), saves


@pytest.mark.parametrize("block", ["gpt", "qwen"])
def test_save_attention_keeps_the_recomputation_from_redoing_the_attention_inputs(block):
  """`save_attention` keeps q, k, v: the step's program makes them (slices of the QKV output,
  rotary embedding for Qwen) once per block as without remat, where the plain remat and
  `save_dots` make them again in the backward pass. With `save_dots` as well, the weight
  matmuls are not recomputed either."""
  base = CFG if block == "gpt" else layout_lib.model_config(dict(
      block="qwen", vocab_size=256, n_layers=2, d_model=128, n_heads=8, n_kv_heads=2,
      d_ff=256, max_seq_len=SEQ))
  cfg = dataclasses.replace(base, remat=True)
  program = lambda c, **saves: _step_jaxpr(c, 2, **saves)  # noqa: E731
  names = lambda jaxpr: _count(jaxpr, "name", attention.ATTENTION_INPUTS)  # noqa: E731
  once = names(program(base))
  assert once == 3, once  # q, k, v in the one body of the layers' scan
  assert names(program(cfg)) == names(program(cfg, save_dots=True)) == 2 * once
  assert names(program(cfg, save_attention=True)) == once
  both = program(cfg, save_dots=True, save_attention=True)
  assert names(both) == once
  if block == "gpt":
    assert _dot_counts(both) == _dot_counts(program(base)) + collections.Counter(batched=2)


def test_cudnn_forward_primitive_is_the_one_jax_binds():
  """`attention.save_attention_policy` keeps cuDNN's forward outputs by its primitive's name:
  the name of the primitive jax's cuDNN attention binds (a jax internal; pinned version)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  assert cudnn_attention._dot_product_attention_fwd_p_wrapper.name == attention.CUDNN_FORWARD
  policy = attention.save_attention_policy()
  assert policy(cudnn_attention._dot_product_attention_fwd_p_wrapper)
  assert not policy(jax.lax.exp_p)


def test_unrolled_layers_unstack_their_parameters(monkeypatch):
  """With `scan_layers=False` each stacked leaf is unstacked once, so its gradient is one
  concatenate, not a sum of n padded arrays, one per layer (which XLA fused with the
  gradients' norm into one slow pass: `step.UNSTACK_LAYERS`). Loss and gradients are the
  per-layer indexing's, bit for bit."""
  mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
  params = layout_lib.shard_params(CFG, _parallel(layout_lib.single_device_model(CFG, seed=0)),
                                  mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(CFG, 1, 1, 2, MICRO, scan_layers=False)
  leaves = len(jax.tree.leaves(params["blocks"]))
  got = {}
  for unstack in (True, False):
    monkeypatch.setattr(step_lib, "UNSTACK_LAYERS", unstack)
    fn = step_lib.loss_and_grads_fn(spec, mesh)
    jaxpr = jax.make_jaxpr(fn)(params, tokens).jaxpr
    got[unstack] = (_count(jaxpr, "unstack"), _count(jaxpr, "pad"),
                    jax.device_get(jax.jit(fn)(params, tokens)))
  assert got[True][0] == leaves and got[False][0] == 0
  assert got[False][1] - got[True][1] == leaves * CFG.n_layers
  for a, b in zip(jax.tree.leaves(got[True][2]), jax.tree.leaves(got[False][2])):
    np.testing.assert_array_equal(a, b)


def test_unrolled_layers_keep_their_weights_cast(monkeypatch):
  """With `scan_layers=False` and remat each layer takes its matmuls' weights already in the
  compute dtype (`step.CAST_LAYER_WEIGHTS`): its remat keeps bf16 weights
  for the backward pass, not fp32 slices of the stacked ones (which XLA copies out of the
  stack). Loss and gradients are the fp32 slices', bit for bit."""
  cfg = dataclasses.replace(CFG, dtype="bfloat16", remat=True)
  mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
  params = layout_lib.shard_params(cfg, _parallel(layout_lib.single_device_model(cfg, seed=0)),
                                  mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  spec = step_lib.ParallelSpec(cfg, 1, 1, 2, MICRO, scan_layers=False, save_dots=True)
  shapes = {tuple(w.sharding.shard_shape(w.shape)[1:])  # one device's [in, out] of each
            for path, w in jax.tree_util.tree_flatten_with_path(params["blocks"])[0]
            if path[-1].key == "kernel"}
  got = {}
  for cast in (True, False):
    monkeypatch.setattr(step_lib, "CAST_LAYER_WEIGHTS", cast)
    fn = step_lib.loss_and_grads_fn(spec, mesh)
    weights = collections.Counter(  # what the backward's remats take of the weights
        str(v.aval.dtype) for e in _eqns(jax.make_jaxpr(fn)(params, tokens).jaxpr)
        if e.primitive.name in ("checkpoint", "remat2") for v in e.invars
        if v.aval.shape in shapes)
    got[cast] = weights, jax.device_get(jax.jit(fn)(params, tokens))
  (cast, _), (f32, _) = got[True], got[False]  # (an fp32 activation may share a shape)
  assert cast["bfloat16"] == 4 * cfg.n_layers and f32["bfloat16"] == 0
  assert f32["float32"] - cast["float32"] == 4 * cfg.n_layers
  for a, b in zip(jax.tree.leaves(got[True][1]), jax.tree.leaves(got[False][1])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tp", [2, 1])
def test_save_head_keeps_the_backward_from_redoing_the_head(tp):
  """`save_head` keeps the loss head's softmax (`layers.HEAD_SOFTMAX`) and gathered input: the
  step's program has one weight matmul fewer (the head's recomputed logits) and, at tp > 1,
  two all-gathers fewer (the head's input and the logits' maxima, gathered again); loss and
  gradients are the same."""
  mesh = make_mesh(1, 1, tp, devices=jax.devices()[:tp])
  params = layout_lib.shard_params(CFG, _parallel(layout_lib.single_device_model(CFG, seed=0)),
                                  mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  got = {}
  for save in (False, True):
    spec = step_lib.ParallelSpec(CFG, 1, 1, tp, MICRO, save_head=save)
    fn = step_lib.loss_and_grads_fn(spec, mesh)
    jaxpr = jax.make_jaxpr(fn)(params, tokens).jaxpr
    got[save] = (_dot_counts(jaxpr)["weight"], _count(jaxpr, "all_gather"),
                 jax.device_get(jax.jit(fn)(params, tokens)))
  assert got[False][0] - got[True][0] == 1
  assert got[False][1] - got[True][1] == (2 if tp > 1 else 0), (got[False][1], got[True][1])
  _assert_f32_close(*got[True][2], *got[False][2])


def _fused_and_xlas(fused, tp: int, tp_overlap: str):
  """The loss and gradients of config ``fused`` with ``tp_overlap``, then those of XLA's GELU
  and QKV slices on the plain layers (`CFG`), on a (1, 1, tp) mesh from the same parameters
  and batch."""
  mesh = make_mesh(1, 1, tp, devices=jax.devices()[:tp])
  params = layout_lib.shard_params(CFG, _parallel(layout_lib.single_device_model(CFG, seed=0)),
                                  mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  return [x for c, overlap in ((fused, tp_overlap), (CFG, "none"))
          for x in jax.device_get(jax.jit(step_lib.loss_and_grads_fn(
              step_lib.ParallelSpec(c, 1, 1, tp, MICRO, tp_overlap=overlap), mesh))(
                  params, tokens))]


# The block with both fused paths: the MLP's GELU and the QKV split in their GEMMs
FUSED = dataclasses.replace(CFG, mlp_gelu="fused", qkv_split="fused")


def _stand_ins(monkeypatch, on: bool = True):
  for module in (gelu_mlp, split_qkv):
    monkeypatch.setattr(module, "STAND_IN", on)


def test_fused_blocks_match_xlas_and_save_dots_keeps_their_outputs(monkeypatch):
  """`model.mlp_gelu='fused'` (`models.gelu_mlp`) and `model.qkv_split='fused'`
  (`models.split_qkv`), their jnp stand-ins on CPU, give the loss and gradients of XLA's
  GELU and QKV slices on a (1, 1, 2) mesh (at tp = 1 the same layers skip their
  collectives). Their outputs are named (`gelu_mlp.MLP_GELU`, `split_qkv.QKV_SPLIT`): under
  remat the backward computes the GELU again (a tanh more in the program, besides the
  derivative's), with `save_dots` it keeps them, and recomputes no weight matmul, as it
  keeps XLA's matmul outputs."""
  _stand_ins(monkeypatch)
  tp = 2
  _assert_f32_close(*_fused_and_xlas(FUSED, tp, "none"))
  assert _count(_step_jaxpr(FUSED, tp), "name", split_qkv.QKV_SPLIT) == 3  # the layer scan's
  tanhs = lambda c, **saves: _count(_step_jaxpr(c, tp, **saves), "tanh")  # noqa: E731
  remat = dataclasses.replace(FUSED, remat=True)
  assert (tanhs(FUSED), tanhs(remat), tanhs(remat, save_dots=True)) == (2, 3, 2)
  assert _dot_counts(_step_jaxpr(remat, tp, save_dots=True)) == _dot_counts(
      _step_jaxpr(FUSED, tp)) + collections.Counter(batched=2)


def test_fused_blocks_in_the_kernel_layers_match_and_communicate_once(monkeypatch):
  """With the kernel layers (`tp_overlap="kernel"`; on CPU their collectives fall back to
  XLA's and the epilogues to their references) the fused MLP and QKV split run their
  collectives inside their own matmuls (`fused.KernelMatmuls`): the loss and gradients of
  XLA's GELU and slices on the plain layers, on a (1, 1, 2) mesh. Under remat with
  `save_tp_outputs` the backward gathers and scatters no more than without remat: the
  kernels' outputs are kept, as the layers' are, so the recomputation does not communicate
  again."""
  _stand_ins(monkeypatch)
  tp = 2
  _assert_f32_close(*_fused_and_xlas(FUSED, tp, "kernel"))
  jaxpr = _step_jaxpr(FUSED, tp, tp_overlap="kernel")
  assert _count(jaxpr, "name", gelu_mlp.MLP_GELU) > 0
  assert _count(jaxpr, "name", split_qkv.QKV_SPLIT) > 0
  remat = _step_jaxpr(dataclasses.replace(FUSED, remat=True), tp, tp_overlap="kernel",
                      save_tp_outputs=True)
  for collective in ("all_gather", "reduce_scatter"):
    assert _count(remat, collective) == _count(jaxpr, collective) > 0, collective


@pytest.mark.parametrize("why", ["no GPU", "collectives run inside their matmuls"])
def test_fused_blocks_fall_back_to_xlas_and_say_so(why, monkeypatch, caplog):
  """Where the fused GEMMs cannot run (here: no GPU) or the layers have no local matmul to
  fuse (the TP layers' collectives inside their matmuls, `parallel.tp_overlap="ring"` at
  tp > 1), the MLP runs XLA's GELU and XLA slices q, k, v, and the run says why, for
  each."""
  _stand_ins(monkeypatch, why != "no GPU")
  monkeypatch.setattr(common, "_warned", set())  # said once a process: said here
  with caplog.at_level("WARNING"):
    jaxpr = _step_jaxpr(FUSED, 2, **({} if why == "no GPU" else dict(tp_overlap="ring")))
  assert _count(jaxpr, "name", gelu_mlp.MLP_GELU) == 0
  assert _count(jaxpr, "name", split_qkv.QKV_SPLIT) == 0
  for flag in ("model.mlp_gelu='fused'", "model.qkv_split='fused'"):
    assert re.search(re.escape(flag) + ".*" + why, caplog.text), caplog.text


def test_save_head_with_a_pipeline_matches():
  """`save_head` on a (1, 2, 2) mesh (the head under `_on_stage`, two micro-batches' softmax
  kept at once): the same loss and gradients as without it."""
  mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
  params = layout_lib.shard_params(CFG, _parallel(layout_lib.single_device_model(CFG, seed=0)),
                                  mesh)
  tokens = jax.device_put(_tokens(), step_lib.batch_sharding(mesh))
  got = [_loss_grads_collectives(step_lib.ParallelSpec(CFG, 1, 2, 2, MICRO, save_head=save),
                                 mesh, params, tokens)[:2] for save in (True, False)]
  _assert_f32_close(*got[0], *got[1])
