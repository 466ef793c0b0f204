"""The 3D-parallel loss, gradients and train step: one fully manual `jax.shard_map`.

Per device (data rank d, stage s, tensor rank r), for its B/dp sequences split into m
micro-batches:

    embed:  vocab-parallel lookup -> reduce-scatter over sequence (+ positions of shard r)
    trunk:  the pipeline over "pipeline" of this stage's L/pp blocks (TP + SP linears),
            each block on `interleave` sub-batches of the micro-batch side by side
    loss:   final norm -> vocab-parallel cross-entropy, on the last stage only (the
            embedding runs on the first stage only)
    grads:  jax.grad of the above (GPipe), or accumulated tick by tick by the 1F1B and
            interleaved schedules (`one_f_one_b`), then summed over every mesh axis a
            parameter is
            replicated on: "tensor" (norms / biases / positions see only their sequence
            shard), "pipeline" (embedding, final norm: used by the first and last stage),
            and averaged over "data" (compressible by `compression.dp`).

The optimizer update runs on the global arrays outside the shard_map, in the same jit; with
`parallel.shard_optimizer` the gradients leave it reduce-scattered over "data" instead, and
`taco_jax.tp.zero` updates the chunks and all-gathers the parameters.
With `compression.log_errors` the step's metrics also hold "compression_error/<family>"
(`taco_jax.monitor`: mean relative error of the family's compressed messages, over sites,
layers, micro-batches and devices); without it the program is exactly the plain one.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from taco_jax import mappings, monitor
from taco_jax.models import attention, gelu_mlp, split_qkv
from taco_jax.tp import buckets, layers, layout as layout_lib, one_f_one_b, pipeline, zero
from taco_jax.plan import CompressionPlan
from taco_jax.tp.mesh import DATA, PIPE, TENSOR, layout_errors, sending_families

DOTS_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable  # parallel.save_dots
# and, with model.mlp_gelu='fused', the fused MLP's activations and output, with
# model.qkv_split='fused' the split QKV's q, k, v (in place of their dots' outputs)
FUSED_POLICY = jax.checkpoint_policies.save_only_these_names(gelu_mlp.MLP_GELU,
                                                            split_qkv.QKV_SPLIT)

# Unrolled layers (parallel.scan_layers=False) take their parameters from the stacked blocks
# by one unstack per leaf, whose gradient is one concatenate. Indexing the stack once per
# layer makes the gradient a sum of n padded arrays, which XLA fused with the gradients'
# norm into one slow pass (1.3B on an H200: 10.5 ms a step). False: that indexing, for
# bench_train's A/B (`_idx`).
UNSTACK_LAYERS = True
# ... and take their matmuls' weights ("kernel" leaves) already in the compute dtype, cast
# once a layer outside the layer's remat, so that the cast weight is what the backward pass
# keeps. Else each layer keeps its fp32 slices of the stacked weights, which XLA copies out
# of the stack as the backward pass starts (1.3B on an H200: 96 copies, 2.5 ms a step). The
# layers cast them the same way: the values are the same, and the gradients reach
# `parallel.overlap_grad_reduce`'s reduction in fp32 as before. False: the fp32 slices, for
# bench_train's A/B (`_f32w`).
CAST_LAYER_WEIGHTS = True

# Unrolled layers whose attention exchanges its input (`parallel.tp_exchange`) take their
# out-projection weights whole, all gathered in one all-gather before the first layer
# (`layers.gather_exchange_weights`), instead of each gathered inside its layer. XLA
# combines those per-layer gathers into NCCL all-gathers of three layers each, started
# early, that run beside the layers' kernels: at TP=2 7 of a step's 24 QKV all-gather kernels
# ran beside one, ~75 us slower each (`profile_step_nvlink_gelu_xchg_tp2`, 2026-11-29). The
# one gather has only the embedding and the weights' casts to hide behind. Off: a tie in the
# 1.3B TP=2 step, 145.23 ms against 144.95 (bench_train `_wgat`,
# bench_train_nvlink_wgat_xparts_tp2_2gpu_20261129, one process).
GATHER_EXCHANGE_WEIGHTS = False

# XLA GPU passes that can merge the interleaved sub-batches' independent work back into one
# chain: DotMerger fuses dots sharing an operand (here the weight: A's and B's projection
# become one dot over both gathered inputs, which waits for both all-gathers), and the
# all-gather / reduce-scatter combiners fuse independent collectives of the same kind (A's
# and B's become one, which waits for both producers). Thresholds of 0 switch them off
# (docs/parallel.md: when each would apply). The CPU compiler accepts and ignores them.
NO_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}
INTERLEAVE_XLA_OPTIONS = {
    **NO_DOT_MERGER,
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
}

# XLA GPU options for steps with the fused collective-matmul kernels (tp_overlap="kernel"):
# CUDA graphs for XLA's own fusions and library calls only, so that the kernels (custom
# calls) launch outside them. XLA records runs of thunks, Mosaic GPU kernels included, into
# CUDA graphs and replays a graph while this GPU's own buffers stay where they were. A
# kernel's TMA descriptors for the peer's buffers (`plgpu.remote_ref`) are built on the host
# with the peer's addresses and recorded into the graph as kernel arguments, and the peer's
# temporaries move between executions when the two GPUs' allocations differ (a batch copied
# to each GPU between queued calls): a replayed kernel then read and wrote the peer's memory
# of an earlier execution. Evaluations queued with batch copies between them returned NaN in
# 16 of 190 with every graph, none of 360 with these options or with no graph at all; the
# 1.3B TP=2 step waited for alone took 177 ms with these options, 263 with no graph (the
# host launching every fusion) and 174 with every graph (2xH200, 2026-11-26;
# docs/parallel.md, "The cause: CUDA graphs replayed with the peer's old addresses").
KERNEL_XLA_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN"}
KERNEL_NO_GRAPHS_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
# the kernel layers' CUDA graphs (`compiler_options(kernel_graphs=)`): for all but the
# kernels (the trainer's), none, or for the kernels too (XLA's default: timing only, the
# results may be wrong)
KERNEL_GRAPHS = {"fusions": KERNEL_XLA_OPTIONS, "none": KERNEL_NO_GRAPHS_OPTIONS, "all": {}}

# XLA GPU options for overlapping collectives with compute (parallel.xla_overlap): the
# latency-hiding scheduler (off by default in jax 0.11.2's XLA, unless a PGLE profile is
# given), all-gathers / reduce-scatters / all-reduces pipelined across the layer loop's
# iterations, and that loop unrolled by two so one iteration's collectives can overlap the
# next one's compute. The per-compile form of benchmarks.gspmd.XLA_OVERLAP_FLAGS, which
# benchmarks/bench_train.py sets in XLA_FLAGS for every variant (XLA 0.11.2 maps its older
# flag names, xla_gpu_enable_pipelined_*, to these; tests/test_compiler_options.py checks
# that both give the same compile options).
LATENCY_HIDING_SCHEDULER = "xla_gpu_enable_latency_hiding_scheduler"
COLLECTIVES_IN_FLIGHT = "xla_gpu_experimental_parallel_collective_overlap_limit"  # XLA: 1
XLA_OVERLAP_OPTIONS = {
    LATENCY_HIDING_SCHEDULER: True,
    "xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON",
    "xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_ON",
    "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON",
    "xla_gpu_enable_while_loop_double_buffering": True,
}


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
  """Everything static about one parallel layout of one model.

  Checked when built, as a config is (`taco_jax.train.trainer.validate`): the model config
  (`DecoderConfig.errors`) and the layout against it (`mesh.layout_errors`); the functions
  below check the mesh they are given, and the batch when they are called.
  """
  cfg: object                        # GPTConfig | QwenConfig
  dp: int                            # mesh axis "data"
  pp: int                            # mesh axis "pipeline"
  tp: int                            # mesh axis "tensor"
  microbatches: int = 1              # pipeline micro-batches per step (per data rank)
  plan: CompressionPlan = CompressionPlan()  # codec per collective
  # how the TP layers communicate (parallel.tp_overlap): "none", the collectives between
  # the matmuls; "ring", ring collective matmuls; "kernel", fused collective-matmul kernels
  tp_overlap: str = "none"
  # row-parallel layers whose local input is narrower than their output (the attention's
  # out-projection) all-to-all their input instead of reduce-scattering their output
  # (parallel.tp_exchange; `layers.exchange_matmul`)
  tp_exchange: bool = False
  # sub-batches per micro-batch whose blocks run side by side, so that one's TP collectives
  # can overlap another's matmuls (parallel.interleave; see `_trunk`)
  interleave: int = 1
  # with model.remat: keep the TP collectives' outputs for the backward pass, so recomputing
  # a block does not communicate again (parallel.save_tp_outputs; see `remat_policy`)
  save_tp_outputs: bool = False
  # with model.remat: keep the outputs of the blocks' matmuls (the weight matmuls, not the
  # attention's batched ones) as well (parallel.save_dots; see `remat_policy`)
  save_dots: bool = False
  # with model.remat: keep the attention's inputs q, k, v and (cuDNN) its output and softmax
  # statistics, so the backward pass does not run its forward again
  # (parallel.save_attention; see `remat_policy`)
  save_attention: bool = False
  # keep the loss head's softmax numerators [b, T, V / tp] (fp32) and its gathered input for
  # the backward pass, which then does not run the head's matmul (and gather) again
  # (parallel.save_head; see `_head_policy`)
  save_head: bool = False
  # pipeline schedule (parallel.schedule): "gpipe" (jax.grad of a forward over the ticks),
  # "1f1b" or "interleaved" (`taco_jax.tp.schedules`: a backward as soon as it can)
  schedule: str = "gpipe"
  virtual_stages: int = 1            # chunks per stage of the interleaved schedule (v)
  # run the stacked layers as one lax.scan (one compiled body, residuals stacked per
  # layer), or one after another (unrolled: a longer compile, no stacking copies)
  scan_layers: bool = True
  # the optimizer state (and master weights) sharded over "data" (ZeRO-1/2,
  # parallel.shard_optimizer; `taco_jax.tp.zero`): gradients reduce-scattered, parameters
  # all-gathered after the update
  shard_optimizer: bool = False
  # all-reduce each layer's gradients over "data" inside the backward pass, as soon as they
  # are made, so they travel while the earlier layers' backward runs (Megatron's
  # overlap_grad_reduce; `buckets.all_reduce_in_backward`); else all of them after it
  overlap_grad_reduce: bool = False

  def __post_init__(self):
    _raise("invalid parallel layout", self.cfg.errors() + self.layout_errors()
           + zero.errors(self.shard_optimizer, self.plan))

  def layout_errors(self, tokens_BT1=None) -> list[str]:
    """`mesh.layout_errors` of this layout; with `tokens_BT1` ([batch, seq_len + 1] token
    ids, the global batch), also of the batch."""
    batch = {}
    if tokens_BT1 is not None:
      batch = dict(batch_size=tokens_BT1.shape[0], seq_len=tokens_BT1.shape[1] - 1)
    return layout_errors(self.cfg, dp=self.dp, pp=self.pp, tp=self.tp,
                         microbatches=self.microbatches, interleave=self.interleave,
                         schedule=self.schedule, virtual_stages=self.virtual_stages,
                         log_errors=self.plan.log_errors,
                         save_tp_outputs=self.save_tp_outputs,
                         save_dots=self.save_dots, save_attention=self.save_attention,
                         tp_overlap=self.tp_overlap,
                         overlap_grad_reduce=self.overlap_grad_reduce,
                         shard_optimizer=self.shard_optimizer, **batch)

  @property
  def ctx(self) -> layers.TPContext:
    return layers.TPContext(tp=self.tp, dtype=self.cfg.compute_dtype,
                            plan=self.plan, overlap=self.tp_overlap,
                            exchange=self.tp_exchange)


def _raise(what: str, errs: list[str]) -> None:
  if errs:
    raise ValueError(f"{what}:\n  " + "\n  ".join(errs))


def _check_mesh(spec: ParallelSpec, mesh) -> None:
  """The mesh must have the layout's axes and sizes (`mesh.make_mesh(dp, pp, tp)`)."""
  want = {DATA: spec.dp, PIPE: spec.pp, TENSOR: spec.tp}
  if dict(mesh.shape) != want:
    raise ValueError(f"the mesh {dict(mesh.shape)} does not match the layout "
                     f"dp={spec.dp}, pp={spec.pp}, tp={spec.tp}: build it with "
                     f"taco_jax.tp.mesh.make_mesh({spec.dp}, {spec.pp}, {spec.tp})")


def _check_batch(spec: ParallelSpec, tokens_BT1) -> None:
  """The global batch ([batch, seq_len + 1] token ids) must split over the layout."""
  if tokens_BT1.ndim != 2 or tokens_BT1.shape[1] < 2:
    raise ValueError(f"tokens_BT1 must be [batch, seq_len + 1] token ids with seq_len >= 1, "
                     f"got shape {tuple(tokens_BT1.shape)}")
  t = tokens_BT1.shape[1] - 1
  _raise(f"tokens_BT1 of shape {tuple(tokens_BT1.shape)} (batch_size={tokens_BT1.shape[0]}, "
         f"seq_len={t}) do not fit the layout",
         spec.cfg.errors(t) + spec.layout_errors(tokens_BT1))


def compiler_options(interleave: int = 1, *, xla_overlap: bool = False,
                     collectives_in_flight: int = 1, kernels: bool = False,
                     kernel_graphs: str = "fusions", exchange_parts: int | None = None
                     ) -> dict:
  """XLA options to compile a step with (`jax.jit(..., compiler_options=)` or
  `.compile(...)`): `INTERLEAVE_XLA_OPTIONS` when it interleaves sub-batches
  (`ParallelSpec.interleave` > 1), `XLA_OVERLAP_OPTIONS` with `xla_overlap`
  (parallel.xla_overlap), with `collectives_in_flight` > 1 (parallel.collectives_in_flight)
  the latency-hiding scheduler allowed that many asynchronous collectives at once (the limit
  is that scheduler's, so asking for it turns the scheduler on), and with `kernels`
  (tp_overlap="kernel") the kernel layers' CUDA graphs as `kernel_graphs` says
  (`KERNEL_GRAPHS`; the trainer's: fusions); with `exchange_parts` (None:
  `layers.EXCHANGE_PARTS`) > 1 `NO_DOT_MERGER`: XLA's DotMerger would join the batch slices'
  out-projections into one matmul that waits for every slice's exchange (seen in the
  scheduled HLO, `probe_schedule_xparts_mock_2gpu_20261129`). The one place the trainer and
  the benchmarks get a step's options from."""
  if not (isinstance(collectives_in_flight, int) and collectives_in_flight >= 1):
    raise ValueError(f"collectives_in_flight={collectives_in_flight!r} must be an integer >= 1")
  if kernel_graphs not in KERNEL_GRAPHS:
    raise ValueError(f"kernel_graphs={kernel_graphs!r} must be one of {tuple(KERNEL_GRAPHS)}")
  out = dict(INTERLEAVE_XLA_OPTIONS) if interleave > 1 else {}
  if (layers.EXCHANGE_PARTS if exchange_parts is None else exchange_parts) > 1:
    out.update(NO_DOT_MERGER)
  if kernels:
    out.update(KERNEL_GRAPHS[kernel_graphs])
  if xla_overlap:
    out.update(XLA_OVERLAP_OPTIONS)
  if collectives_in_flight > 1:
    out.update({LATENCY_HIDING_SCHEDULER: True, COLLECTIVES_IN_FLIGHT: collectives_in_flight})
  return out


def remat_policy(spec: ParallelSpec):
  """The `jax.checkpoint` policy of the layer scan under `model.remat`: recompute everything
  (None), or keep what each switch names and recompute the rest:

  * `spec.save_tp_outputs`: the TP collectives' outputs, so the recomputation sends nothing
    (and compresses nothing). Per layer and micro-batch, with sequence parallelism, two
    gathered block inputs [b, T, D] and two sequence shards [b, T / tp, D] (bf16). The ring
    layers (`parallel.tp_overlap="ring"`) gather inside their matmuls and are recomputed
    either way; the kernel layers (``"kernel"``) keep the column layers' outputs
    [b, T, 3 D / tp + d_ff / tp] as well, so that no kernel runs again.
  * `spec.save_dots`: the outputs of matmuls without batch dimensions (the block's weight
    matmuls; the attention's are batched over heads), so the recomputation is the norms,
    the activation function and the attention. Per layer and micro-batch, what the backward
    pass needs of them: the QKV and MLP-in outputs [b, T, 3 D / tp + d_ff / tp] (bf16), and
    the attention's out-projection [b, T, D] unless its reduce-scatter's output is kept.
    With `model.mlp_gelu='fused'` the MLP's pre-activation, activation and output
    (`gelu_mlp.MLP_GELU`) in place of the MLP-in's output: d_ff / tp more a token; with
    `model.qkv_split='fused'` q, k, v (`split_qkv.QKV_SPLIT`) in place of the QKV output.
    At tp > 1 the gathered inputs are not matmul outputs: add `save_tp_outputs`.
  * `spec.save_attention`: the attention's inputs q, k, v and, with cuDNN, its output and
    softmax statistics (`attention.save_attention_policy`), so the recomputation neither
    slices q, k, v out of the QKV output nor runs cuDNN's forward again. Per layer and
    micro-batch [b, T, 3 D / tp] for q, k, v (with `save_dots` in place of the QKV output,
    which the backward then does not read), [b, T, D / tp] for the output and
    [b, heads / tp, T] fp32 for the statistics.
  """
  policies = [policy for on, policy in (
      (spec.save_tp_outputs, mappings.save_tp_outputs_policy()),
      (spec.save_dots, DOTS_POLICY),
      (spec.save_dots, FUSED_POLICY),
      (spec.save_attention, attention.save_attention_policy())) if on]
  if len(policies) < 2:
    return policies[0] if policies else None
  return lambda *args, **params: any(policy(*args, **params) for policy in policies)


def _embed(spec: ParallelSpec, params, tokens_BT):
  """Token (+ position) embedding of [b, T] token ids: this rank's sequence shard h_BSD."""
  ctx = spec.ctx
  h_BSD = layers.vocab_parallel_embed(params["wte"], tokens_BT, ctx)
  if "wpe" in params:
    s = h_BSD.shape[1]
    pos_SD = jax.lax.dynamic_slice_in_dim(params["wpe"], layers.tensor_rank(ctx) * s, s)
    h_BSD = h_BSD + pos_SD.astype(ctx.dtype)
  return h_BSD


def _trunk(spec: ParallelSpec, constrain: Callable | None = None, reduce_grads_over_data=False):
  """(stacked blocks [n, ...], h_BSD) -> h_BSD: the n blocks in order (a scan, or unrolled
  without `spec.scan_layers`); `constrain`, if given, is applied to each block's output
  (GSPMD's sharding constraint on the residual stream: `stacked_loss`).
  `reduce_grads_over_data`: each block's parameter gradients leave already averaged over
  "data", reduced where the backward pass makes them (`parallel.overlap_grad_reduce`).

  With `spec.interleave` = k > 1 each micro-batch is split into k sub-batches and every
  layer of the scan runs its block on each of them: k independent chains in one loop body,
  so the TP all-gather / reduce-scatter of one sub-batch has no data dependence on the
  other sub-batches' matmuls and XLA's latency-hiding scheduler may run them side by side
  (forward and, through jax.grad of the scan, backward). Per sequence the math is that of
  k = 1; only the sums over the batch in the weight gradients change order. The output is
  the concatenated micro-batch again, so the pipeline and the loss head see what they see
  without interleaving.
  """
  cfg, k = spec.cfg, spec.interleave
  block_gd, block_state = layout_lib.block_template(cfg, spec.ctx)
  constrain = constrain or (lambda h: h)

  def layer(hs, p):  # one block on each sub-batch: k chains with no data between them
    block = nnx.merge(block_gd, p)
    return tuple(constrain(block(h)) for h in hs), None

  if cfg.remat:
    layer = jax.checkpoint(layer, policy=remat_policy(spec))

  def prepare(p):  # a layer's parameters as its block takes them, outside the remat
    if reduce_grads_over_data:
      p = buckets.all_reduce_in_backward(p, DATA, spec.plan.codec("dp"), "dp", scale=1 / spec.dp)
    if CAST_LAYER_WEIGHTS and not spec.scan_layers:  # inside the reduction
      p = _cast_weights(p, cfg.compute_dtype)
    return p

  def trunk(blocks, h_BSD):
    hs = tuple(jnp.split(h_BSD, k)) if k > 1 else (h_BSD,)
    if spec.scan_layers:
      hs = jax.lax.scan(lambda hs, p: layer(hs, prepare(p)), hs, blocks)[0]
    else:
      ps = map(prepare, _layer_params(blocks))  # lazily: each layer's just before the layer
      if GATHER_EXCHANGE_WEIGHTS and (paths := layers.exchange_kernel_paths(
          nnx.merge(block_gd, block_state))):
        ps = layers.gather_exchange_weights(list(ps), paths)
        ps, hs = jax.lax.optimization_barrier((ps, hs))  # all gathered before the first layer
      for p in ps:
        hs = layer(hs, p)[0]
    return jnp.concatenate(hs) if k > 1 else hs[0]

  return trunk


def _layer_params(blocks) -> list:
  """The stacked blocks' parameters [n, ...] as n per-layer trees (`UNSTACK_LAYERS`)."""
  n = jax.tree.leaves(blocks)[0].shape[0]
  if not UNSTACK_LAYERS:
    return [jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(n)]
  leaves, tree = jax.tree.flatten(blocks)
  return [jax.tree.unflatten(tree, layer) for layer in zip(*map(jnp.unstack, leaves))]


def _cast_weights(p, dtype):
  """A layer's parameters with its matmuls' weights (the "kernel" leaves) in `dtype`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x.astype(dtype) if getattr(path[-1], "key", None) == "kernel" else x, p)


def _head_loss(spec: ParallelSpec, params, h_BSD, tgt_BT):
  """Mean token loss of a micro-batch: final norm, then the vocab-parallel cross-entropy."""
  norm_gd, _ = layout_lib.norm_template(spec.cfg)
  h_BSD = nnx.merge(norm_gd, params["ln_f"])(h_BSD)
  return jnp.mean(layers.vocab_parallel_xent(h_BSD, params["wte"], tgt_BT, spec.ctx))


def stacked_loss(spec: ParallelSpec, params, tokens_BT1, *,
                 constrain: Callable | None = None):
  """Mean token loss of [b, T + 1] token ids through the stacked forward (embedding,
  blocks, head) in one piece: no pipeline stages, no micro-batches. At tp = 1 nothing in it
  communicates, so it is the whole model's math and runs outside a shard_map too:
  `benchmarks.gspmd` jits it and lets XLA partition it. `constrain` is applied to the
  residual stream after the embedding and after each block (its sharding constraint)."""
  constrain = constrain or (lambda h: h)
  inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
  h_BSD = _trunk(spec, constrain)(params["blocks"], constrain(_embed(spec, params, inputs_BT)))
  return _head_loss(spec, params, h_BSD, targets_BT)


def _microbatches(spec: ParallelSpec, tokens_BT1):
  """(inputs, targets): [m, b/m, T] token ids each."""
  m, (b, t1) = spec.microbatches, tokens_BT1.shape
  return (tokens_BT1[:, :-1].reshape(m, b // m, t1 - 1),
          tokens_BT1[:, 1:].reshape(m, b // m, t1 - 1))


def _on_stage(spec: ParallelSpec, stage: int, f, zeros):
  """f() on pipeline stage `stage`, `zeros` elsewhere: a branch that a stage's whole
  tensor group takes or skips together, so its TP collectives stay matched. With
  `tp_overlap` ring or kernel every stage computes f() and keeps it or not: a
  collective-permute or a Mosaic kernel's cross-GPU barrier waits for every device, so
  inside a branch that only some stages take it would hang (it did, on CPU)."""
  if spec.pp == 1:
    return f()
  on_stage = jax.lax.axis_index(PIPE) == stage
  if spec.tp_overlap != "none":
    return jnp.where(on_stage, f(), zeros)
  return jax.lax.cond(on_stage, f, lambda: zeros)


def _local_loss(spec: ParallelSpec, params, tokens_BT1, reduce_grads_over_data=False):
  """Mean token loss of this device's batch on the last stage, 0 on the others (GPipe).

  The embedding runs on the first stage only and the head and loss on the last only
  (`_on_stage`); the stages between run their blocks only. `reduce_grads_over_data`: the
  blocks' gradients are averaged over "data" in the backward pass (`_trunk`)."""
  m = spec.microbatches
  inputs, targets = _microbatches(spec, tokens_BT1)
  b, t = inputs.shape[1:]
  h_shape = jax.eval_shape(lambda: _embed(spec, params, inputs[0]))
  zeros = jnp.zeros((m, *h_shape.shape), h_shape.dtype)
  h_MBSD = _on_stage(spec, 0, lambda: _embed(spec, params, inputs.reshape(m * b, t)).reshape(
      zeros.shape), zeros)
  trunk = _trunk(spec, reduce_grads_over_data=reduce_grads_over_data)
  out_MBSD = pipeline.gpipe(lambda h: trunk(params["blocks"], h), h_MBSD, pp=spec.pp,
                            fwd=spec.plan.codec("pp/fwd"), bwd=spec.plan.codec("pp/bwd"))
  head = jax.checkpoint(lambda h, tgt: _head_loss(spec, params, h, tgt),
                        policy=_head_policy(spec))
  return _on_stage(spec, spec.pp - 1, lambda: jnp.mean(jax.lax.map(
      lambda a: head(*a), (out_MBSD, targets))), jnp.zeros((), jnp.float32))


def _head_policy(spec: ParallelSpec):
  """The GPipe head's `jax.checkpoint` policy: keep nothing (None), so no [b, T, V / tp]
  array lives from a micro-batch's forward pass to its backward pass, or with
  `spec.save_head` keep the softmax's numerators and sums (`layers.HEAD_SOFTMAX`) and the
  gathered input (`mappings.TP_OUTPUT`): then the backward pass runs neither the head's
  matmul nor its all-gather again. 1.3B on one H200 at batch 8: 3.3 GB."""
  if not spec.save_head:
    return None
  return jax.checkpoint_policies.save_only_these_names(layers.HEAD_SOFTMAX, mappings.TP_OUTPUT)


def _scheduled_loss_grads(spec: ParallelSpec, params, tokens_BT1):
  """(loss, gradients) of this device by the 1F1B / interleaved schedule
  (`taco_jax.tp.one_f_one_b`)."""
  parts = one_f_one_b.Parts(embed=lambda p, tok: _embed(spec, p, tok), chunk=_trunk(spec),
                            head=lambda p, h, tgt: _head_loss(spec, p, h, tgt),
                            dtype=spec.cfg.compute_dtype)
  pp, v = spec.pp, spec.virtual_stages
  blocks = one_f_one_b.to_chunks(params["blocks"], pp, v)
  inputs, targets = _microbatches(spec, tokens_BT1)
  loss, grads = one_f_one_b.loss_and_grads(
      parts, dict(params, blocks=blocks), inputs, targets, pp=pp, v=v,
      fwd=spec.plan.codec("pp/fwd"), bwd=spec.plan.codec("pp/bwd"))
  return loss, dict(grads, blocks=one_f_one_b.from_chunks(grads["blocks"], pp, v))


def reduce_grads(spec: ParallelSpec, grads, specs, blocks_reduced_over_data=False):
  """Sums each gradient over the axes its parameter is replicated on; means over "data"
  (with `spec.shard_optimizer`, each rank keeping its chunk: `zero.scatter_mean`), except
  the blocks' with `blocks_reduced_over_data` (done in the backward pass: `_trunk`)."""
  leaves, treedef = jax.tree.flatten(grads)
  spec_leaves = treedef.flatten_up_to(specs)
  for axis, size in ((TENSOR, spec.tp), (PIPE, spec.pp)):
    if size == 1:
      continue
    idx = [i for i, s in enumerate(spec_leaves) if axis not in jax.tree.leaves(tuple(s))]
    for i, g in zip(idx, buckets.all_reduce([leaves[i] for i in idx], axis, None)):
      leaves[i] = g
  if spec.shard_optimizer:
    leaves = zero.scatter_mean(spec, leaves)
  elif spec.dp > 1:
    blocks = set(_block_leaf_indices(grads)) if blocks_reduced_over_data else set()
    idx = [i for i in range(len(leaves)) if i not in blocks]
    reduced = buckets.all_reduce([leaves[i] for i in idx], DATA, spec.plan.codec("dp"), "dp")
    for i, g in zip(idx, reduced):
      leaves[i] = g / spec.dp
  return treedef.unflatten(leaves)


def _block_leaf_indices(grads) -> list[int]:
  """Positions of grads["blocks"]'s leaves in `jax.tree.leaves(grads)`."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  return [i for i, path in enumerate(paths) if path[0] == jax.tree_util.DictKey("blocks")]


def logged_families(spec: ParallelSpec) -> tuple[str, ...]:
  """The families whose errors `compression.log_errors` reports: compressed and present."""
  return tuple(f for f in sending_families(dp=spec.dp, pp=spec.pp, tp=spec.tp,
                                           shard_optimizer=spec.shard_optimizer)
               if spec.plan.compresses(f))


def _loss_grads_metrics(spec: ParallelSpec, mesh, capture=None) -> Callable:
  """(params, tokens_BT1) -> (loss, grads, metrics): metrics are the compression errors
  (empty unless `spec.plan.log_errors`); `capture` (a `monitor.Capture`) records what each
  compressed collective sends instead."""
  _check_mesh(spec, mesh)
  specs = layout_lib.param_specs(spec.cfg)
  grad_specs = zero.state_specs(spec) if spec.shard_optimizer else specs
  if spec.tp_overlap != "none" and spec.tp > 1 and (spec.plan.log_errors
                                                    or capture is not None):
    raise ValueError(f"parallel.tp_overlap={spec.tp_overlap!r}: the collective matmuls do not "
                     "report their messages; set parallel.tp_overlap='none' to log "
                     "compression errors (compression.log_errors) or to calibrate")
  log = spec.plan.log_errors and capture is None

  if spec.schedule != "gpipe" and capture is not None:
    raise ValueError(f"parallel.schedule={spec.schedule!r}: calibration captures the "
                     "messages of the GPipe step; calibrate with parallel.schedule='gpipe'")

  def local(params, tokens_BT1):
    if spec.schedule != "gpipe":
      loss, grads = _scheduled_loss_grads(spec, params, tokens_BT1)
      return loss.reshape(1, 1), reduce_grads(spec, grads, specs)
    # the plain program may reduce the blocks' gradients in the backward pass; a watched one
    # reduces them after it, where the monitor sees the message
    in_backward = spec.overlap_grad_reduce and spec.dp > 1 and not log and capture is None
    loss_fn = lambda p: _local_loss(spec, p, tokens_BT1, reduce_grads_over_data=in_backward)
    if not log and capture is None:  # the plain program
      loss, grads = jax.value_and_grad(loss_fn)(params)
      return loss.reshape(1, 1), reduce_grads(spec, grads, specs, in_backward)
    watcher = monitor.ErrorLog() if log else capture
    loss, grads, probe_ct = monitor.value_and_grad(loss_fn, params, watcher)
    with monitor.watching(watcher):
      grads = reduce_grads(spec, grads, specs)
    if not log:
      return loss.reshape(1, 1), grads
    stats = jax.lax.psum(watcher.stats(probe_ct), (DATA, PIPE, TENSOR))
    return loss.reshape(1, 1), grads, stats

  f = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(DATA, None)),
                    out_specs=(P(DATA, PIPE), grad_specs) + ((P(),) if log else ()),
                    check_vma=False)

  def loss_and_grads(params, tokens_BT1):
    _check_batch(spec, tokens_BT1)
    loss_DP, grads, *stats = f(params, tokens_BT1)
    families = [f for f in logged_families(spec) if f != "dp_params"]  # the update's
    metrics = monitor.family_metrics(stats[0], families) if log else {}
    # the last stage's loss, mean over data
    return jnp.mean(jnp.sum(loss_DP, axis=1)), grads, metrics

  return loss_and_grads


def loss_and_grads_fn(spec: ParallelSpec, mesh) -> Callable:
  """(params, tokens_BT1) -> (loss, grads): global arrays in, global arrays out (with
  `spec.shard_optimizer` the gradients are sharded over "data" too: `zero.state_specs`)."""
  f = _loss_grads_metrics(spec, mesh)

  def loss_and_grads(params, tokens_BT1):
    return f(params, tokens_BT1)[:2]

  return loss_and_grads


def make_train_step(spec: ParallelSpec, mesh, tx: optax.GradientTransformation, *,
                    capture=None) -> Callable:
  """(params, opt_state, tokens_BT1) -> (params, opt_state, metrics); jit it with donation.
  `capture`: a `monitor.Capture` that records what the compressed collectives send."""
  loss_and_grads = _loss_grads_metrics(spec, mesh, capture)
  sharded_update = zero.make_update(spec, mesh, tx, capture) if spec.shard_optimizer else None

  def train_step(params, opt_state, tokens_BT1):
    loss, grads, errors = loss_and_grads(params, tokens_BT1)
    if sharded_update is not None:
      params, opt_state, more = sharded_update(params, opt_state, grads)
      errors = {**errors, **more}
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **errors}

  return train_step


def make_eval_step(spec: ParallelSpec, mesh) -> Callable:
  """(params, tokens_BT1) -> mean loss (no gradients; same layout and collectives)."""
  _check_mesh(spec, mesh)
  specs = layout_lib.param_specs(spec.cfg)

  def local(params, tokens_BT1):
    return _local_loss(spec, params, tokens_BT1).reshape(1, 1)

  f = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(DATA, None)),
                    out_specs=P(DATA, PIPE), check_vma=False)

  def eval_step(params, tokens_BT1):
    _check_batch(spec, tokens_BT1)
    return jnp.mean(jnp.sum(f(params, tokens_BT1), axis=1))

  return eval_step


def batch_sharding(mesh):
  return jax.sharding.NamedSharding(mesh, P(DATA, None))
