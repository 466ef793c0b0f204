"""Megatron tensor-parallel layers with sequence parallelism, for use inside the shard_map.

Activations between layers are the residual stream's sequence shard x_BSD (S = T / tp, on
mesh axis "tensor"). Every byte that crosses devices goes through `taco_jax.mappings`, each
region watched by `taco_jax.monitor` as its site:

  ColumnParallelLinear  x_BSD --gather_from_sp--> x_BTD @ w[:, shard] + b[shard] -> y_BTF/tp
                        (forward: all-gather over sequence; backward: reduce-scatter)
  RowParallelLinear     y_BTF/tp @ w[shard, :] --reduce_scatter_to_sp--> x_BSD + b
                        (forward: reduce-scatter over sequence; backward: all-gather);
                        with `TPContext.exchange` (``parallel.tp_exchange``), where its
                        input is the narrower: y all-to-all'd to y_BSF @ all-gathered w
                        (`exchange_matmul`)
  vocab_parallel_embed  masked lookup in the local V/tp rows --reduce_scatter_to_sp--> h_BSD
  vocab_parallel_xent   h_BSD --gather_from_sp--> local logits_BTV/tp (with the ring: one
                        ring gather_matmul, like the column layers); max / sum-exp /
                        target logit reduced over "tensor" (fp32, uncompressed, tiny)

`TPContext.overlap` (``parallel.tp_overlap``) picks how the column / row layers
communicate: ``"none"``, the regions above; ``"ring"``, ring collective matmuls
(`taco_jax.tp.overlap`); ``"kernel"``, fused collective-matmul kernels
(`taco_jax.tp.fused`; the head keeps its region there).

The factory (`TensorParallelFactory`) keeps the `models.layers.LinearFactory` contract, so
the single-device `Block` runs unchanged on local heads. Each layer records how its
parameters shard (`SPECS`), which `taco_jax.tp.layout` turns into PartitionSpecs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from taco_jax.models.gelu_mlp import LocalMatmuls
from taco_jax.models.layers import normal_init
from taco_jax import collectives, mappings, monitor
from taco_jax.codec import CompressionConfig
from taco_jax.collectives import Decided
from taco_jax.tp import fused, overlap
from taco_jax.plan import COLLECTIVES, CompressionPlan
from taco_jax.tp.mesh import TENSOR, TP_OVERLAP
from taco_jax.mappings import TP_OUTPUT
from taco_jax.tp.overlap import SEQ  # the sequence axis of [B, T, D] activations



# In how many slices of the batch a block whose out-projection exchanges its input
# (`RowParallelLinear.exchanges`) runs its attention and out-projection
# (`RowParallelLinear.in_parts`): every slice's exchange but the last is XLA's asynchronous
# all-to-all, which its scheduler runs beside the next slice's attention (in the 1.3B TP=2
# step's scheduled HLO: in 16 of 24 layers, in all 24 with the exchange weights gathered
# before the layers, `probe_schedule_*_mock_2gpu_20261129`), and the last slice's, which
# nothing is left to hide, runs as `fused.EXCHANGE_FORWARD` says (our kernel with the kernel
# layers), where the whole batch's runs alone. 1 (one slice): in halves, with the weights
# gathered before the layers, the 1.3B TP=2 step took 149.10 ms against 145.23 without the
# halves (bench_train ``_xparts``, bench_train_nvlink_wgat_xparts_tp2_2gpu_20261129, one
# process; ``_xparts4``: quarters, not timed).
EXCHANGE_PARTS = 1


@dataclasses.dataclass(frozen=True)
class TPContext:
  """What a tensor-parallel layer needs to know besides its sizes."""
  tp: int                                    # size of mesh axis "tensor"
  dtype: object = jnp.bfloat16               # compute dtype of the matmuls
  plan: CompressionPlan = CompressionPlan()  # codec per collective (default: all plain)
  overlap: str = "none"                      # parallel.tp_overlap: none | ring | kernel
  exchange: bool = False                     # parallel.tp_exchange (`RowParallelLinear`)

  def __post_init__(self):
    if self.overlap not in TP_OVERLAP:
      raise ValueError(f"parallel.tp_overlap={self.overlap!r}: choose one of {TP_OVERLAP}")

  def codecs(self, region: str) -> tuple[CompressionConfig | None, CompressionConfig | None]:
    """(forward, backward) codecs of a `taco_jax.mappings` region, e.g. "gather_from_sp"."""
    return self.plan.codec(f"{region}/fwd"), self.plan.codec(f"{region}/bwd")


def _decided(region: str, x, ctx: TPContext):
  """(forward, backward) codecs that ``mappings.<region>`` of x sends with, each decided
  once (`collectives.decide`): the forward message is x, the backward one the cotangent of
  the region's output (x with its sequence gathered, or scattered, over "tensor")."""
  n = collectives.axis_size(TENSOR, region, x.shape)
  t = x.shape[SEQ] * n if region == "gather_from_sp" else x.shape[SEQ] // n
  y = jax.ShapeDtypeStruct((*x.shape[:SEQ], t, *x.shape[SEQ + 1:]), x.dtype)
  return tuple(collectives.decide(COLLECTIVES[site], msg, ctx.plan.codec(site), n, site=site)
               for site, msg in ((f"{region}/fwd", x), (f"{region}/bwd", y)))


def _watched(region: str, x, ctx: TPContext):
  """``mappings.<region>`` of x along the sequence over "tensor", with the plan's codecs
  decided once and given both to the region and to the active monitor, which sees the
  sites "<region>/fwd" and "<region>/bwd" (none: a plain call)."""
  fwd, bwd = _decided(region, x, ctx)
  f = lambda x: getattr(mappings, region)(x, TENSOR, axis=SEQ, fwd_compression=Decided(fwd),
                                          bwd_compression=Decided(bwd))
  return monitor.region(f, x, fwd=fwd, bwd=bwd, fwd_site=f"{region}/fwd",
                        bwd_site=f"{region}/bwd")


def gather_seq(x_BSD, ctx: TPContext):
  """Sequence shard -> full sequence. forward: all-gather, backward: reduce-scatter."""
  if ctx.tp == 1:
    return x_BSD
  return _watched("gather_from_sp", x_BSD, ctx)


def scatter_seq(x_BTD, ctx: TPContext):
  """Partial sums over the full sequence -> summed sequence shard.
  forward: reduce-scatter, backward: all-gather."""
  if ctx.tp == 1:
    return x_BTD
  return _watched("reduce_scatter_to_sp", x_BTD, ctx)


def _split(d: int, tp: int, what: str) -> int:
  if d % tp:
    raise ValueError(f"{what}={d} is not divisible by tensor-parallel size {tp}")
  return d // tp


class ColumnParallelLinear(nnx.Module):
  """In-projection on a contiguous 1/tp of the outputs; gathers the sequence first."""
  SPECS = {"kernel": (None, TENSOR), "bias": (TENSOR,)}

  def __init__(self, d_in: int, d_out: int, *, init_std: float, ctx: TPContext,
               rngs: nnx.Rngs):
    self.ctx = ctx
    d_local = _split(d_out, ctx.tp, "column-parallel output width")
    self.kernel = nnx.Param(normal_init(init_std)(rngs.params(), (d_in, d_local), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((d_local,), jnp.float32))

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    ctx, w = self.ctx, self.kernel[...].astype(self.ctx.dtype)
    x_BSD = x_BSD.astype(ctx.dtype)
    if ctx.overlap == "ring" and ctx.tp > 1:
      y = overlap.gather_matmul(x_BSD, w, TENSOR, *ctx.codecs("gather_from_sp"))
    elif ctx.overlap == "kernel" and ctx.tp > 1:
      # named: with parallel.save_tp_outputs the recomputation must not run the kernel again
      y = checkpoint_name(fused.gather_matmul(x_BSD, w, TENSOR, *ctx.codecs("gather_from_sp")),
                          TP_OUTPUT)
    else:
      y = jnp.einsum("...i,io->...o", gather_seq(x_BSD, ctx), w)
    return y + self.bias[...].astype(ctx.dtype)

  def fused_operands(self, x_BSD: jax.Array):
    """``models.gelu_mlp``'s ``(x, w, b, matmuls)``: the x gathered by XLA and the local
    matmuls, or with the kernel layers (``parallel.tp_overlap="kernel"`` at tp > 1) x's
    sequence shard and the kernels (``fused.KernelMatmuls``); None for the ring layers."""
    ctx = self.ctx
    x_BSD, w = x_BSD.astype(ctx.dtype), self.kernel[...].astype(ctx.dtype)
    if ctx.tp == 1 or ctx.overlap == "none":
      return gather_seq(x_BSD, ctx), w, self.bias[...], LocalMatmuls()
    if ctx.overlap == "kernel":
      return x_BSD, w, self.bias[...], fused.KernelMatmuls(
          TENSOR, tuple(ctx.codecs("gather_from_sp")), tuple(ctx.codecs("reduce_scatter_to_sp")))
    return None


class RowParallelLinear(nnx.Module):
  """Out-projection from a 1/tp input shard; reduce-scatters the partial sums over sequence."""
  SPECS = {"kernel": (TENSOR, None), "bias": (None,)}

  def __init__(self, d_in: int, d_out: int, *, init_std: float, ctx: TPContext,
               rngs: nnx.Rngs):
    self.ctx = ctx
    self.d_local = _split(d_in, ctx.tp, "row-parallel input width")
    self.kernel = nnx.Param(
        normal_init(init_std)(rngs.params(), (self.d_local, d_out), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32))

  @property
  def exchanges(self) -> bool:
    """Whether this layer sends its input instead of its output (``parallel.tp_exchange``):
    where the local input is narrower than the output, an all-to-all of the input sends
    fewer bytes than the output's reduce-scatter (the attention's out-projection: 1/tp)."""
    return self.ctx.exchange and self.ctx.tp > 1 and self.d_local < self.kernel.shape[1]

  def batch_parts(self, batch: int) -> int:
    """In how many slices of its batch the block should feed this layer (`in_parts`):
    `EXCHANGE_PARTS` where it exchanges and they divide the batch, else 1."""
    parts = EXCHANGE_PARTS if self.exchanges else 1
    return parts if batch % parts == 0 else 1

  def in_parts(self, ys_BTF: list[jax.Array]) -> jax.Array:
    """This layer's output for the batch slices ``ys_BTF`` (`batch_parts` of them),
    concatenated along the batch: the weight gathered once, each slice but the last
    exchanged by XLA's asynchronous all-to-all, which may run beside the next slices' work
    (`EXCHANGE_PARTS`). Exchanging layers only."""
    if not self.exchanges:
      raise ValueError("RowParallelLinear.in_parts: only a layer that exchanges its input "
                       "(parallel.tp_exchange) takes its batch in slices")
    ctx, w = self.ctx, self._whole_weight(self.kernel[...].astype(self.ctx.dtype))
    forwards = ["xla"] * (len(ys_BTF) - 1) + [None]
    x_BSD = jnp.concatenate([exchange_matmul(y.astype(ctx.dtype), w, ctx, gathered=True,
                                             forward=f) for y, f in zip(ys_BTF, forwards)])
    return x_BSD + self.bias[...].astype(ctx.dtype)

  def _whole_weight(self, w: jax.Array) -> jax.Array:
    """The exchange's whole weight [d_in, d_out] from this layer's kernel ``w`` (cast):
    gathered here, or already before the layers (`step.GATHER_EXCHANGE_WEIGHTS`), which
    leaves this layer a kernel of d_in rows."""
    return w if w.shape[0] != self.d_local else gather_weight(w)

  def __call__(self, y_BTF: jax.Array) -> jax.Array:
    ctx, w = self.ctx, self.kernel[...].astype(self.ctx.dtype)
    y_BTF = y_BTF.astype(ctx.dtype)
    if self.exchanges:
      x_BSD = exchange_matmul(y_BTF, self._whole_weight(w), ctx, gathered=True)
    elif ctx.overlap == "ring" and ctx.tp > 1:
      x_BSD = overlap.matmul_scatter(y_BTF, w, TENSOR, *ctx.codecs("reduce_scatter_to_sp"))
    elif ctx.overlap == "kernel" and ctx.tp > 1:
      x_BSD = checkpoint_name(
          fused.matmul_scatter(y_BTF, w, TENSOR, *ctx.codecs("reduce_scatter_to_sp")),
          TP_OUTPUT)
    else:
      x_BSD = scatter_seq(jnp.einsum("...i,io->...o", y_BTF, w), ctx)
    return x_BSD + self.bias[...].astype(ctx.dtype)

  def fused_takes(self) -> bool:
    """Whether ``models.gelu_mlp`` may run this layer's matmul: where it is no exchange and,
    at tp > 1, where its reduce-scatter runs after it or in our kernel (not the ring's)."""
    return not self.exchanges and (self.ctx.tp == 1 or self.ctx.overlap != "ring")

  def fused_output(self, y_BTD: jax.Array) -> jax.Array:
    """This layer's output from its matmul's partial sums (``fused_operands``' matmuls:
    with the kernel layers, already reduce-scattered)."""
    ctx = self.ctx
    if ctx.tp > 1 and ctx.overlap == "kernel":
      y_BSD = checkpoint_name(y_BTD, TP_OUTPUT)  # not recomputed: that would communicate
    else:
      y_BSD = scatter_seq(y_BTD, ctx)
    return y_BSD + self.bias[...].astype(ctx.dtype)


def gather_weight(w_FD):
  """An exchange's whole weight from this rank's rows (all-gathered over "tensor"; its
  gradient reduce-scattered), kept through remat (``TP_OUTPUT``)."""
  return checkpoint_name(collectives.all_gather(w_FD, TENSOR, axis=0, tiled=True), TP_OUTPUT)


def exchange_matmul(y_BTF, w_FD, ctx: TPContext, gathered: bool = False,
                    forward: str | None = None):
  """The row-parallel product with sequence parallelism by an exchange of inputs: this
  rank's sequence shard of ``y @ w`` from every rank's columns of y for it (all-to-all
  over "tensor", [B, T, F/tp] -> [B, S, F]) times the whole weight (all-gathered; its
  gradient reduce-scattered). It sends (tp - 1) / tp of y's local bytes where the
  reduce-scatter of the product sends (tp - 1) / tp of ``[B, T, D]``: F / tp / D as much,
  1/tp at the attention's out-projection. With the kernel layers the exchange is a kernel
  of its own and the backward's matmul and exchange one kernel (`fused.exchange_matmul`).
  The exchanged y, the gathered weight (and with the kernel layers the product) carry
  ``TP_OUTPUT``, so that the recomputation under ``parallel.save_tp_outputs`` does not
  communicate again. ``gathered``: w_FD is the whole weight already (`gather_weight`).
  ``forward``: how the kernel layers run the forward (`fused.all_to_all_matmul`)."""
  w_full = w_FD if gathered else gather_weight(w_FD)
  if ctx.overlap == "kernel":
    return checkpoint_name(fused.exchange_matmul(y_BTF, w_full, TENSOR, forward), TP_OUTPUT)
  y_BSF = collectives.all_to_all(y_BTF, TENSOR, split_axis=SEQ, concat_axis=2)
  return jnp.einsum("...i,io->...o", checkpoint_name(y_BSF, TP_OUTPUT), w_full)


def exchange_kernel_paths(block: nnx.Module) -> list[tuple[str, ...]]:
  """Where the weights of `block`'s exchanging layers (`RowParallelLinear.exchanges`) sit in
  its parameter tree."""
  return [(*map(str, path), "kernel") for path, m in nnx.iter_modules(block)
          if isinstance(m, RowParallelLinear) and m.exchanges]


def gather_exchange_weights(layer_params: list, paths: list[tuple[str, ...]]) -> list:
  """The layers' parameter trees with the weights at `paths` whole ([d_in / tp, d_out] ->
  [d_in, d_out]): each path's in one all-gather over "tensor" of every layer's, whose
  backward reduce-scatters their gradients. The layers take a whole weight as gathered
  (`exchange_matmul`)."""
  key = lambda kp: tuple(str(getattr(k, "key", k)) for k in kp)  # noqa: E731
  shards = [{key(kp): w for kp, w in jax.tree_util.tree_leaves_with_path(p) if key(kp) in paths}
            for p in layer_params]
  whole = {path: jnp.unstack(collectives.all_gather(jnp.stack([s[path] for s in shards]),
                                                    TENSOR, axis=1, tiled=True))
           for path in paths}
  return [jax.tree_util.tree_map_with_path(
              lambda kp, x, i=i: whole[key(kp)][i] if key(kp) in whole else x, p)
          for i, p in enumerate(layer_params)]


@dataclasses.dataclass(frozen=True)
class TensorParallelFactory:
  """`models.layers.LinearFactory` of Megatron column/row-parallel layers (sizes are global)."""
  ctx: TPContext

  def column(self, d_in, d_out, *, init_std, rngs):
    return ColumnParallelLinear(d_in, d_out, init_std=init_std, ctx=self.ctx, rngs=rngs)

  def row(self, d_in, d_out, *, init_std, rngs):
    return RowParallelLinear(d_in, d_out, init_std=init_std, ctx=self.ctx, rngs=rngs)


def tensor_rank(ctx: TPContext):
  """This device's index on "tensor"; 0 at tp = 1 without asking the mesh, so that the
  layers run where no "tensor" axis is manual (under GSPMD: `benchmarks.gspmd`)."""
  return 0 if ctx.tp == 1 else jax.lax.axis_index(TENSOR)


def _local_ids(ids_BT, v_local: int, ctx: TPContext):
  """(row of each token id in this rank's vocabulary shard [r V/tp, (r+1) V/tp), clipped
  into it; whether the id lies in the shard)."""
  local_BT = ids_BT - tensor_rank(ctx) * v_local
  mine_BT = (local_BT >= 0) & (local_BT < v_local)
  return jnp.clip(local_BT, 0, v_local - 1), mine_BT


def vocab_parallel_embed(w_VD: jax.Array, tokens_BT: jax.Array, ctx: TPContext) -> jax.Array:
  """Lookup in this rank's rows [r V/tp, (r+1) V/tp) of the table, summed and scattered
  over sequence: returns the sequence shard h_BSD (compute dtype)."""
  rows_BT, mine_BT = _local_ids(tokens_BT, w_VD.shape[0], ctx)
  e_BTD = jnp.take(w_VD, rows_BT, axis=0)
  e_BTD = jnp.where(mine_BT[..., None], e_BTD, 0).astype(ctx.dtype)
  return scatter_seq(e_BTD, ctx)


def _sum_tp(x, ctx: TPContext):
  """Sum over "tensor"; forward: all-reduce (plain), backward: identity."""
  if ctx.tp == 1:
    return x
  return mappings.reduce_from_tp(x, TENSOR, fwd_compression=None)


@jax.custom_vjp
def head_logits(h_BTD: jax.Array, w_VD: jax.Array) -> jax.Array:
  """fp32 logits ``h @ w.T`` of compute-dtype operands. The backward casts the logits'
  cotangent to the operands' dtype before its two matmuls (fp32 accumulation): left to
  autodiff, an fp32 cotangent makes both fp32 (TF32) GEMMs, which took 24 of a 325 ms
  step (1.3B, one H200, vocab 50304; `profile_step`)."""
  return jnp.einsum("btd,vd->btv", h_BTD, w_VD, preferred_element_type=jnp.float32)


def _head_logits_fwd(h_BTD, w_VD):
  return head_logits(h_BTD, w_VD), (h_BTD, w_VD)


def _head_logits_bwd(res, g_BTV):
  h_BTD, w_VD = res
  g_BTV = g_BTV.astype(h_BTD.dtype)
  dh = jnp.einsum("btv,vd->btd", g_BTV, w_VD, preferred_element_type=jnp.float32)
  dw = jnp.einsum("btv,btd->vd", g_BTV, h_BTD, preferred_element_type=jnp.float32)
  return dh.astype(h_BTD.dtype), dw.astype(w_VD.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


HEAD_SOFTMAX = "taco_head_softmax"  # checkpoint name of the loss's exp(logits - max), sum


@jax.custom_vjp
def _sum_exp(z):
  """sum(exp(z)) over the last axis, whose backward pass reads exp(z) by the checkpoint name
  ``HEAD_SOFTMAX`` (autodiff's would read exp's own output, which no name reaches), so that a
  policy keeping that name spares the backward pass the logits (parallel.save_head)."""
  return jnp.sum(jnp.exp(z), axis=-1)


def _sum_exp_fwd(z):
  e = checkpoint_name(jnp.exp(z), HEAD_SOFTMAX)
  return jnp.sum(e, axis=-1), e


def _sum_exp_bwd(e, g):
  return (e * g[..., None],)


_sum_exp.defvjp(_sum_exp_fwd, _sum_exp_bwd)


def vocab_parallel_xent(h_BSD: jax.Array, w_VD: jax.Array, targets_BT: jax.Array,
                        ctx: TPContext) -> jax.Array:
  """Per-token cross-entropy (fp32) of the tied head h @ w.T, never gathering full logits.
  The softmax's numerators and their sum carry the checkpoint name ``HEAD_SOFTMAX``."""
  if ctx.overlap == "ring" and ctx.tp > 1:
    logits_BTV = overlap.gather_matmul(h_BSD.astype(ctx.dtype), w_VD.astype(ctx.dtype).T,
                                       TENSOR, *ctx.codecs("gather_from_sp"), jnp.float32)
  else:
    logits_BTV = head_logits(gather_seq(h_BSD.astype(ctx.dtype), ctx), w_VD.astype(ctx.dtype))
  m_BT = jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1))
  if ctx.tp > 1:  # any common shift >= each local max keeps exp() finite; no gradient
    m_BT = jnp.max(collectives.all_gather(m_BT, TENSOR, axis=0, tiled=False), axis=0)
  sumexp_BT = checkpoint_name(_sum_tp(_sum_exp(logits_BTV - m_BT[..., None]), ctx),
                              HEAD_SOFTMAX)
  rows_BT, mine_BT = _local_ids(targets_BT, w_VD.shape[0], ctx)
  tgt_BT = jnp.take_along_axis(logits_BTV, rows_BT[..., None], axis=-1)[..., 0]
  tgt_BT = _sum_tp(jnp.where(mine_BT, tgt_BT, 0.0), ctx)
  return jnp.log(sumexp_BT) + m_BT - tgt_BT
