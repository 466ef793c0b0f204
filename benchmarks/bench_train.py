"""Training-step tokens/s and MFU: TACO compression off / on, the ideal bound, and GSPMD.

Per (dp, pp, tp) layout, the --variants programs train the same GPT from the same
parameters on the same batches, their steps interleaved (the order rotates every step):

  off     our 3D-parallel shard_map step (`taco_jax.tp.step`), bf16 collectives
  on      the same with TACO compression (`--compress` families)
  ideal   `off` with every collective over "tensor" replaced, while tracing, by a local
          stand-in of the same shapes (all-gather -> broadcast of the local shard,
          reduce-scatter -> the local slice, all-reduce -> identity; pipeline / data
          collectives untouched). It computes nonsense but the same FLOPs: the step time
          with free TP communication. Done by `taco_jax.collectives.free_communication`
          around `.lower()` only; nothing else is changed.
  ring_off, ring_on  off / on with the TP layers as ring collective matmuls
          (`parallel.tp_overlap="ring"`: each chunk's transfer in flight during another's
          matmul)
  gspmd   the same model under plain `jax.jit` with Megatron NamedSharding annotations
          (`benchmarks.gspmd`) on a (dp * pp, tp) ("data", "tensor") mesh (no
          pipeline: for a pp > 1 layout this is the GSPMD run on the same devices with the
          pipeline folded into data parallelism), with XLA's collective-overlap flags
          (`gspmd.XLA_OVERLAP_FLAGS`, set in XLA_FLAGS for the whole process, so `off` and
          `on` get them too; `--no-overlap-flags` drops them).

Modifiers after the name of one of our steps, in this order (e.g. `on_il2_save_pgle`):

  _cm     (off / on / ideal) the TP layers as fused collective-matmul kernels
          (`parallel.tp_overlap="kernel"`, `taco_jax.tp.fused`): the transfers run
          inside the matmul kernels, plain (`off_cm`) or FP8-compressed (`on_cm`);
          `ideal_cm`: the ideal's stand-in collectives with those layers' matmuls on our
          GEMM core (`fused`'s free communication): what the kernel layers would take if
          their transfers cost nothing, so ceiling_<ideal_cm variant> = (off - ideal_cm) /
          (off - ideal) is the most they can recover with our matmuls
  _xchg   the attention's out-projection all-to-alls its input over "tensor" and
          all-gathers its weight instead of reduce-scattering its output
          (`parallel.tp_exchange`, `layers.exchange_matmul`): 1/tp of the bytes, sent
          between XLA's kernels and plain, with or without _cm
  _bxla   (with _cm and _xchg) the exchange's backward all-to-all by XLA (NCCL), which
          its scheduler may overlap, after cuBLAS's matmul; its forward by our kernel
          (`fused.EXCHANGE_GRADIENT` "xla")
  _bsplit (with _cm and _xchg) the backward's matmul by cuBLAS, then our exchange kernel
          (`fused.EXCHANGE_GRADIENT` "kernel"), where the layers run the two as one
          kernel (since 2026-11-28): the layers before that
  _ffused (with _cm and _xchg) the exchange and the matmul of the forward as one kernel
          (`fused.EXCHANGE_FORWARD` "fused", `pallas_kernels/all_to_all_matmul.py`), where
          the layers run our exchange kernel, then cuBLAS
  _nolink (on_ only) every collective and kernel of --compress in FP8, as without --link,
          where the run's --link picks what pays on that link (as the trainer does)
  _push   (with _cm only) every plain all-gather kernel on the ring, pushing its chunks,
          where the layers pull the peers' rows (`ag_matmul.PULL_CLUSTERS`, since
          2026-11-27): the layers' all-gather before that
  _wcopy  (with _cm only) the backward kernels take each weight transposed by XLA, a copy
          per weight and step (`fused.WEIGHTS_READ_TRANSPOSED` off), where the layers read
          it transposed inside the kernels (since 2026-11-27): the layers before that
  _rsw    (with _cm only) the plain reduce-scatter kernels on the all-gather's wide tiles
          (`ag_matmul.WIDE`, [64, 256] a warpgroup, 3 stages), where the layers' take
          [128, 128] (`matmul_rs.TILING`)
  _dwf32  (with _cm or ring_) the weight gradients of the kernel layers and of the ring's
          all-gather matmuls as fp32-output dots cast to bf16
          (`overlap.WEIGHT_GRADIENTS_F32`), which XLA fuses into Triton GEMMs, where the
          layers' are bf16 dots on cuBLAS (since 2026-11-28): the layers before that
  _1f1b   the 1F1B pipeline schedule (`parallel.schedule="1f1b"`: each stage keeps at most
          2 (pp - 1) micro-batches' activations, not all m)
  _vs2    the interleaved pipeline schedule with 2 chunks per stage
          (`parallel.schedule="interleaved"`, `parallel.virtual_stages=2`: a bubble of
          (pp - 1) / (2 m + pp - 1))
  _il2    each micro-batch split into 2 sub-batches whose blocks run side by side
          (`parallel.interleave=2`: one's TP collectives can overlap the other's matmuls),
          compiled with `step.INTERLEAVE_XLA_OPTIONS` (DotMerger and the all-gather /
          reduce-scatter combiners off, so XLA does not merge the two chains back into
          one; `--no-interleave-options` keeps XLA's defaults). Only these variants get
          those options.
  _save   the layer remat keeps the TP collectives' outputs (`parallel.save_tp_outputs`):
          the backward pass recomputes each block without communicating again
  _dots   the layer remat keeps the blocks' weight-matmul outputs too (`parallel.save_dots`):
          the backward pass recomputes only norms, activation and attention
  _attn   the layer remat keeps the attention's inputs and, with cuDNN, its outputs
          (`parallel.save_attention`): the backward pass does not run its forward again
  _head   the loss head keeps its softmax for the backward pass (`parallel.save_head`): the
          backward pass does not run the head's matmul again
  _gelu   the MLP's GELU in its GEMMs' epilogues (`model.mlp_gelu="fused"`,
          `models.gelu_mlp`; with _cm in the all-gather kernels' epilogues,
          `fused.KernelMatmuls`; not with ring_)
  _qkv    q, k, v written apart by the QKV projection's GEMM (`model.qkv_split="fused"`,
          `models.split_qkv`; with _cm by the all-gather kernel's epilogue; not with ring_)
  _dbxla  (with _gelu only) the MLP-in bias's gradient summed by XLA from dh
          (`gelu_gemm.BIAS_GRAD` off), where the GELU's backward kernel sums it in its
          epilogue (since 2026-11-29): the step before that
  _ogr    each layer's gradients all-reduced over "data" inside the backward pass
          (`parallel.overlap_grad_reduce`: they travel while the earlier layers' backward
          runs), not all of them after it; pp = 1 and no _zero
  _zero   the optimizer sharded over "data" (`parallel.shard_optimizer`, ZeRO-1/2): the
          gradients reduce-scattered, the parameters all-gathered; `on_zero` compresses them
          where --compress lists dp (gradients) and dp_params (weight differences)
  _unroll the layers unrolled instead of a scan over the stacked blocks
          (`parallel.scan_layers=False`)
  _idx    (with _unroll) the unrolled layers index the stacked parameters once a layer
          (`step.UNSTACK_LAYERS` off), where the layers unstack them (since 2026-11-28):
          the layers before that
  _f32w   (with _unroll) the unrolled layers keep their fp32 weight slices for the backward
          pass (`step.CAST_LAYER_WEIGHTS` off), where they keep the weights cast to the
          compute dtype (since 2026-11-29): the step before that
  _wgat   (with _xchg and _unroll) the exchange's weights gathered in one all-gather a
          weight family before the first layer (`step.GATHER_EXCHANGE_WEIGHTS`), where each
          layer gathers its own
  _xparts (with _xchg) each block's attention and exchanging out-projection in two halves
          of the batch, the first half's exchange XLA's asynchronous all-to-all beside the
          second half's attention (`layers.EXCHANGE_PARTS`=2), where the whole batch's
          exchange runs alone between them; `_xparts4`: in four quarters
  _noremat  (GSPMD too) no remat at all (`model.remat=False`: every activation kept), in
          the same process as the remat variants (`--no-remat` drops remat for all of them)
  _cif2   (GSPMD too) XLA's latency-hiding scheduler may keep two asynchronous collectives
          in flight at once, not one (`parallel.collectives_in_flight=2`,
          `step.compiler_options`); `_cif4`: four
  _pgle   (GSPMD too) compiled twice: the second time with the instruction times
          measured in two profiled steps of the first (`taco_jax.train.pgle`: XLA's
          profile-guided latency estimation, as `parallel.pgle` does in the trainer), so
          the scheduler overlaps collectives by measured costs rather than its guesses.
          The profiled steps run on a throwaway state; timing starts from the same
          parameters as the other variants.
  _graphs (with _cm only) the kernel layers compiled with XLA's CUDA graphs for the kernels
          too, which the trainer keeps them out of (`step.KERNEL_XLA_OPTIONS`: replayed
          graphs use the peer's addresses of an earlier execution, so results may be
          wrong): timing only, never picked as a best variant
  _fgraphs (with _cm only) CUDA graphs for XLA's fusions and library calls, the kernels
          outside them: what the trainer compiles (since 2026-11-27). Without either, the
          kernel layers compile with no CUDA graph at all (the trainer's before)
  _cublas XLA's dots on cuBLAS only (`xla_gpu_enable_triton_gemm` off), where XLA's
          autotuner may give some of them to Triton GEMMs of its own

Attention: `--attention` (auto | cudnn | xla, `model.attention`); the JSON records which ran
(`DecoderConfig.attention_backend`) and, on one random batch of the run's attention shapes,
cuDNN's error against XLA's (`benchmarks/attention_numerics.py`; on CPU: why cuDNN could
not run). Memory per variant: the parameters' and the optimizer state's bytes per device
(`params_bytes_per_device`, `opt_state_bytes_per_device`: the state's shards, so `_zero`
shows the sharded optimizer's saving); the compiled step's peak and temporaries per device
(`common.compiled_memory`: XLA's buffer assignment); the device's `peak_bytes_in_use`
(`memory_stats()`) after each variant's first step (`device_peak_bytes`; the process-wide
peak so far: every variant's state is live at once, and the attention check ran before,
so it is the variant's own peak only with one variant per run), and after the run.

Derived per layout: comm_ms = off - ideal (exposed TP communication), comm_share =
comm_ms / off, and recovered = (off - on) / (off - ideal): the share of that communication
time compression wins back (1 = compressed step as fast as free communication). The `best_*`
figures take the fastest of our bf16 and of our compressed programs (what a user would
pick); speedup_<modifiers>_<off|on> compares a modified program with the plain one.
Timing as in train_parallel.py (host wall-clock between the completions of steps
dispatched back to back, as the trainer runs them; median after --warmup). MFU two ways,
as there: `mfu` against the device's spec peak (989 TFLOP/s on H100 / H200),
`mfu_of_measured` against the bf16 matmul rate measured in the same run.

GPU, 4xH200, two calls (each < 10 minutes; NVLink multicast is off):
  python benchmarks/bench_train.py --label nvlink
  NCCL_P2P_DISABLE=1 python benchmarks/bench_train.py --label nop2p
CPU smoke test (8 fake devices, tiny model, < 1 minute):
  python benchmarks/bench_train.py --smoke
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
import traceback
from unittest import mock

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.args import (add_output_args, parse_with_smoke, results_path,  # noqa: E402
                             start_watchdog)
from benchmarks.train_parallel import (  # noqa: E402 (no JAX import)
    SMOKE, TIMING, add_run_args, bench_setup, build_step, comm_record, compression_plan,
    model_and_optimizer, step_interleaved, timing_record)

BASES = ("off", "on", "ideal", "gspmd", "ring_off", "ring_on")
# in order, e.g. off_cm_save_pgle
MODIFIERS = ("cm", "push", "wcopy", "rsw", "dwf32", "xchg", "bxla", "bsplit", "ffused", "nolink",
             "1f1b", "vs2", "il2", "save", "dots", "attn", "head", "gelu", "qkv", "dbxla", "ogr",
             "zero", "unroll", "idx", "f32w", "wgat", "xparts", "xparts4", "noremat", "cif2",
             "cif4", "pgle", "graphs", "fgraphs", "cublas")
GSPMD_MODIFIERS = ("noremat", "cif2", "cif4", "pgle")
CIF = {"cif2": 2, "cif4": 4}  # modifier -> parallel.collectives_in_flight
GRAPHS_MODIFIERS = {"graphs": "all", "fgraphs": "fusions"}  # -> the kernel layers' graphs
# a variant with these is measured against the collectives' step of its other modifiers
PAIRED_WITH_COLLECTIVES = ("cm", "push", "wcopy", "rsw", "dwf32", "xchg", "bxla", "bsplit",
                           "ffused", "nolink", "wgat", "xparts", "xparts4",
                           *GRAPHS_MODIFIERS)
COMPILE_SHARE = 0.75  # of --deadline-s: no variant starts compiling after it (all layouts)
REMAT_SAVES = ("save", "dots", "attn")  # modifiers that say what the remat keeps: not with noremat
# the `ParallelSpec` fields a variant sets (build_step's keywords), written into its results too
PARALLEL_FIELDS = ("tp_overlap", "tp_exchange", "interleave", "schedule", "virtual_stages",
                   "save_tp_outputs", "save_dots", "save_attention", "save_head",
                   "shard_optimizer", "overlap_grad_reduce", "scan_layers")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One program of the benchmark, parsed from its name (see the module docstring)."""
  name: str
  base: str                     # one of BASES
  interleave: int = 1           # _il2: parallel.interleave=2
  save_tp_outputs: bool = False  # _save: parallel.save_tp_outputs (with remat)
  save_dots: bool = False       # _dots: parallel.save_dots (with remat)
  save_attention: bool = False  # _attn: parallel.save_attention (with remat)
  save_head: bool = False       # _head: parallel.save_head
  fused_gelu: bool = False      # _gelu: model.mlp_gelu="fused"
  fused_qkv: bool = False       # _qkv: model.qkv_split="fused"
  db_xla: bool = False          # _dbxla: gelu_gemm.BIAS_GRAD off
  remat: bool = True            # False for _noremat (else model.remat as --no-remat says)
  pgle: bool = False            # _pgle: compiled again from a profile
  kernels: bool = False         # _cm: parallel.tp_overlap="kernel"
  push: bool = False            # _push: no all-gather kernel pulls (ag_matmul.PULL_CLUSTERS)
  wcopy: bool = False           # _wcopy: XLA transposes the backward kernels' weights
  rs_wide: bool = False         # _rsw: the plain reduce-scatter kernels on wide tiles
  dw_f32: bool = False          # _dwf32: overlap.WEIGHT_GRADIENTS_F32
  tp_exchange: bool = False     # _xchg: parallel.tp_exchange
  gradient_exchange: str = "fused"  # _bxla: "xla", _bsplit: "kernel" (fused.EXCHANGE_GRADIENT)
  forward_exchange: str = "kernel"  # _ffused: "fused" (fused.EXCHANGE_FORWARD)
  every_link: bool = False      # _nolink: compressed as if no --link was given
  schedule: str = "gpipe"       # _1f1b: parallel.schedule="1f1b"; _vs2: "interleaved"
  virtual_stages: int = 1       # _vs2: parallel.virtual_stages=2
  shard_optimizer: bool = False  # _zero: parallel.shard_optimizer
  overlap_grad_reduce: bool = False  # _ogr: parallel.overlap_grad_reduce
  scan_layers: bool = True      # False for _unroll: parallel.scan_layers=False
  indexed: bool = False         # _idx: step.UNSTACK_LAYERS off
  f32_weights: bool = False     # _f32w: step.CAST_LAYER_WEIGHTS off
  gather_weights: bool = False  # _wgat: step.GATHER_EXCHANGE_WEIGHTS on
  exchange_parts: int = 1       # _xparts / _xparts4: layers.EXCHANGE_PARTS=2 / 4
  collectives_in_flight: int = 1  # _cif2 / _cif4: parallel.collectives_in_flight
  graphs: str = "none"          # the kernel layers' CUDA graphs (GRAPHS_MODIFIERS)
  cublas: bool = False          # _cublas: xla_gpu_enable_triton_gemm off

  @property
  def ours(self) -> bool:  # our shard_map step (not GSPMD)
    return self.base != "gspmd"

  def parallel_fields(self) -> dict:
    """Its `PARALLEL_FIELDS`, by name."""
    return {f: getattr(self, f) for f in PARALLEL_FIELDS}

  @property
  def remat_saves(self) -> bool:  # one of REMAT_SAVES: says what the remat keeps
    return self.save_tp_outputs or self.save_dots or self.save_attention

  @property
  def compressed(self) -> bool:
    return self.base.removeprefix("ring_") == "on"

  @property
  def tp_overlap(self) -> str:
    return "kernel" if self.kernels else "ring" if self.base.startswith("ring_") else "none"


def parse_variant(name: str) -> Variant:
  """`Variant` of a name like `on`, `ring_off`, `off_il2_save`, `gspmd_pgle`; ValueError
  for anything else."""
  base = next((b for b in sorted(BASES, key=len, reverse=True)
               if name == b or name.startswith(b + "_")), None)
  mods = name[len(base) + 1:].split("_") if base and name != base else []
  order = [MODIFIERS.index(m) if m in MODIFIERS else -1 for m in mods]
  if base is None or -1 in order or order != sorted(set(order)) or (
      base == "gspmd" and set(mods) - set(GSPMD_MODIFIERS)) or (
      "noremat" in mods and set(mods) & set(REMAT_SAVES)) or len(set(mods) & set(CIF)) > 1 or (
      "cm" in mods and base not in ("off", "on", "ideal")) or {"1f1b", "vs2"} <= set(mods) or (
      "zero" in mods and base == "ideal") or (
      set(GRAPHS_MODIFIERS) & set(mods) and "cm" not in mods) or (
      {"push", "wcopy", "rsw"} & set(mods) and "cm" not in mods) or (
      "dwf32" in mods and "cm" not in mods and not base.startswith("ring_")) or (
      {"bxla", "bsplit", "ffused"} & set(mods) and not {"cm", "xchg"} <= set(mods)) or (
      "nolink" in mods and base.removeprefix("ring_") != "on") or (
      {"bxla", "bsplit"} <= set(mods)) or (
      len(set(GRAPHS_MODIFIERS) & set(mods)) > 1) or (
      {"idx", "f32w"} & set(mods) and "unroll" not in mods) or (
      "wgat" in mods and not {"xchg", "unroll"} <= set(mods)) or (
      {"xparts", "xparts4"} & set(mods) and "xchg" not in mods) or (
      {"xparts", "xparts4"} <= set(mods)) or (
      {"gelu", "qkv"} & set(mods) and base.startswith("ring_")) or (
      "dbxla" in mods and "gelu" not in mods):
    raise ValueError(f"unknown variant {name!r}: one of {', '.join(BASES)}, then any of "
                     f"_{', _'.join(MODIFIERS)} in that order (GSPMD takes only "
                     f"_{', _'.join(GSPMD_MODIFIERS)}; _noremat none of _"
                     f"{', _'.join(REMAT_SAVES)}; _cm only after off / on / ideal, _push, "
                     "_wcopy, _rsw, _graphs and _fgraphs only with _cm; _dwf32 with _cm or ring_; "
                     "_bxla or _bsplit, and _ffused, only with _cm and _xchg; _nolink only "
                     "after on; _1f1b or _vs2; _cif2 or _cif4; no ideal_zero; _idx and _f32w "
                     "only with _unroll; _wgat only with _xchg and _unroll; _xparts or _xparts4 "
                     "only with _xchg; _gelu and "
                     "_qkv not with ring_; _dbxla only with _gelu)")
  return Variant(name, base, interleave=2 if "il2" in mods else 1,
                 save_tp_outputs="save" in mods, save_dots="dots" in mods,
                 save_attention="attn" in mods, save_head="head" in mods,
                 fused_gelu="gelu" in mods, fused_qkv="qkv" in mods, db_xla="dbxla" in mods,
                 remat="noremat" not in mods, pgle="pgle" in mods, kernels="cm" in mods,
                 push="push" in mods, wcopy="wcopy" in mods, rs_wide="rsw" in mods,
                 dw_f32="dwf32" in mods,
                 tp_exchange="xchg" in mods,
                 gradient_exchange=("xla" if "bxla" in mods else "kernel" if "bsplit" in mods
                                    else "fused"),
                 forward_exchange="fused" if "ffused" in mods else "kernel",
                 every_link="nolink" in mods,
                 schedule="1f1b" if "1f1b" in mods else "interleaved" if "vs2" in mods else
                 "gpipe", virtual_stages=2 if "vs2" in mods else 1,
                 shard_optimizer="zero" in mods, overlap_grad_reduce="ogr" in mods,
                 scan_layers="unroll" not in mods, indexed="idx" in mods,
                 f32_weights="f32w" in mods, gather_weights="wgat" in mods,
                 exchange_parts=2 if "xparts" in mods else 4 if "xparts4" in mods else 1,
                 collectives_in_flight=next((CIF[m] for m in mods if m in CIF), 1),
                 graphs=next((GRAPHS_MODIFIERS[m] for m in mods if m in GRAPHS_MODIFIERS),
                             "none"), cublas="cublas" in mods)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_run_args(p, model="1.3b", layouts="1,1,4;1,2,2", steps=40, warmup=3, seq=2048, batch=8)
  p.add_argument("--variants", default="off,on,ideal,gspmd",
                 help=f"comma-separated: one of {', '.join(BASES)}, then any of "
                      f"_{', _'.join(MODIFIERS)} (e.g. on_il2_pgle)")
  p.add_argument("--no-remat", action="store_true", help="keep activations (more memory)")
  p.add_argument("--link", default=None, help="'on' compresses only the collectives and sizes "
                 "measured to pay on this link (CompressionConfig.link: nvlink | p2p_disabled)")
  p.add_argument("--gspmd-activation", default="sp", choices=["sp", "replicated"],
                 help="GSPMD residual stream: sequence-parallel or replicated over tensor")
  p.add_argument("--no-overlap-flags", action="store_true",
                 help="do not add gspmd.XLA_OVERLAP_FLAGS to XLA_FLAGS")
  p.add_argument("--no-interleave-options", action="store_true",
                 help="compile the *_il2 variants without step.INTERLEAVE_XLA_OPTIONS")
  p.add_argument("--dump-hlo", default="", metavar="VARIANTS",
                 help="comma-separated variants whose optimized, scheduled HLO to write to "
                      "--out-dir (else the temp dir) as hlo_<label>_<dp><pp><tp>_<variant>.txt.gz")
  p.add_argument("--deadline-s", type=float, default=480.0,
                 help="wall-clock budget of the whole run, compiles included")
  p.add_argument("--build-timeout-s", type=float, default=0.0,
                 help="give up a variant whose build (compile) takes longer, build no "
                      "other and time the built ones (0: wait)")
  add_output_args(p, label="nvlink", smoke="CPU, 8 fake devices, tiny model")
  args = parse_with_smoke(p, argv, dict(SMOKE, layouts="2,1,4;2,2,2"))
  try:
    args._variants = [parse_variant(v) for v in args.variants.split(",")]
  except ValueError as e:
    p.error(str(e))
  if args.no_remat and any(v.remat_saves for v in args._variants):
    p.error(f"_{' / _'.join(REMAT_SAVES)} variants say what the recomputation keeps: not "
            "with --no-remat")
  return args


def variant_config(variant: Variant, cfg):
  """The model config `variant` runs: `cfg` (remat as --no-remat says), without remat for
  a _noremat variant."""
  return cfg if variant.remat else dataclasses.replace(cfg, remat=False)


def xla_options(variant: Variant, args) -> dict:
  """The per-compile XLA options of `variant`: the trainer's (`step.compiler_options`), the
  interleaving ones unless --no-interleave-options. XLA's overlap options come for every
  variant from XLA_FLAGS (`add_overlap_flags`), not from here."""
  from taco_jax.tp.step import compiler_options
  options = compiler_options(1 if args.no_interleave_options else variant.interleave,
                             collectives_in_flight=variant.collectives_in_flight,
                             kernels=variant.kernels, kernel_graphs=variant.graphs,
                             exchange_parts=variant.exchange_parts)
  return {**options, "xla_gpu_enable_triton_gemm": False} if variant.cublas else options


def build(variant: Variant, layout, args, cfg, tx):
  """(executable, (params, opt_state), batch_fn, mesh, plan, profiled) of one variant;
  `profiled`: whether a *_pgle variant's executable was scheduled from a profile."""
  step, state, batch, mesh, plan, ctx = _program(variant, layout, args, cfg, tx)
  with ctx:
    lowered = step.lower(*state, batch(args._tokens0))
  options = xla_options(variant, args)
  if not variant.pgle:
    return lowered.compile(options), state, batch, mesh, plan, False
  import jax
  from taco_jax.train import pgle
  scratch = {"state": state}
  tokens = batch(args._tokens0)

  def run(exe):
    params, opt_state, metrics = exe(*scratch["state"], tokens)
    jax.block_until_ready(metrics["loss"])
    scratch["state"] = (params, opt_state)

  exe, profiled = pgle.profile_guided_compile(lowered, run, options=options)
  state = _program(variant, layout, args, cfg, tx)[1]  # fresh: the others' start
  return exe, state, batch, mesh, plan, profiled


def _program(variant: Variant, layout, args, cfg, tx, abstract: bool = False):
  """(jitted step, (params, opt_state), batch_fn, mesh, plan, tracing context) of
  `variant` (its first compile); parameters from seed 0; with `abstract` (ours only) the
  state and batch as shapes with their shardings (`build_step`), to compile only."""
  import jax
  from benchmarks import gspmd
  from taco_jax import collectives
  from taco_jax.pallas_kernels import ag_matmul, gelu_gemm, matmul_rs
  from taco_jax.tp import fused, layers as tp_layers, overlap, step as step_lib
  from taco_jax.tp.mesh import TENSOR
  from taco_jax.train.trainer import opt_state_target, shardings

  dp, pp, tp = layout
  cfg = variant_config(variant, cfg)
  if not variant.ours:
    if abstract:
      raise ValueError(f"{variant.name}: GSPMD's programs are built with their state")
    mesh = gspmd.make_mesh(dp * pp, tp)
    p_sh = gspmd.shardings(cfg, mesh)
    params = gspmd.init_params(cfg, mesh, seed=0)
    p_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         params)
    o_sh = shardings(opt_state_target(tx, p_abs, mesh))
    state = (params, jax.jit(tx.init, out_shardings=o_sh)(params))
    step = jax.jit(gspmd.make_train_step(cfg, mesh, tx, activation=args.gspmd_activation),
                   donate_argnums=(0, 1), out_shardings=(p_sh, o_sh, None))
    b_sh = gspmd.batch_sharding(mesh)
    batch = lambda tokens: jax.make_array_from_callback(tokens.shape, b_sh,  # noqa: E731
                                                        lambda i: tokens[i])
    plan, ctx = None, contextlib.nullcontext()
  else:
    plan = variant_plan(variant, args)
    if variant.fused_gelu:
      cfg = dataclasses.replace(cfg, mlp_gelu="fused")
    if variant.fused_qkv:
      cfg = dataclasses.replace(cfg, qkv_split="fused")
    step, state, batch, mesh = build_step(layout, args, cfg, tx, plan, abstract,
                                          **variant.parallel_fields())
    ctx = _all_of(
        [collectives.free_communication(TENSOR)] * (variant.base == "ideal")
        + [mock.patch.object(ag_matmul, "PULL_CLUSTERS", ())] * variant.push
        + [mock.patch.object(fused, "WEIGHTS_READ_TRANSPOSED", False)] * variant.wcopy
        + [mock.patch.object(matmul_rs, "TILING", dataclasses.replace(ag_matmul.WIDE, stages=3))]
        * variant.rs_wide
        + [mock.patch.object(overlap, "WEIGHT_GRADIENTS_F32", True)] * variant.dw_f32
        + [mock.patch.object(gelu_gemm, "BIAS_GRAD", False)] * variant.db_xla
        + [mock.patch.object(step_lib, "UNSTACK_LAYERS", False)] * variant.indexed
        + [mock.patch.object(step_lib, "CAST_LAYER_WEIGHTS", False)] * variant.f32_weights
        + [mock.patch.object(step_lib, "GATHER_EXCHANGE_WEIGHTS", True)] * variant.gather_weights
        + [mock.patch.object(tp_layers, "EXCHANGE_PARTS", variant.exchange_parts)]
        + [mock.patch.object(fused, "EXCHANGE_GRADIENT", variant.gradient_exchange),
           mock.patch.object(fused, "EXCHANGE_FORWARD", variant.forward_exchange)])
  return step, state, batch, mesh, plan, ctx


@contextlib.contextmanager
def _all_of(contexts):
  """Inside every one of ``contexts``."""
  with contextlib.ExitStack() as stack:
    for context in contexts:
      stack.enter_context(context)
    yield


class BuildHung(Exception):
  """A variant's build did not return within --build-timeout-s."""


def build_within(seconds: float, *args):
  """`build(*args)`, given up after ``seconds`` (0: waited for): a compile that hangs (the
  TP=4 kernel step's did, 2026-11-26) then costs its variant, not the whole run. It runs on
  a daemon thread, which is left behind if it hangs and does not hold the process at exit."""
  if not seconds:
    return build(*args)
  box = {}

  def target():
    try:
      box["out"] = build(*args)
    except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
      box["error"] = e
  thread = threading.Thread(target=target, name="bench_train build", daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    raise BuildHung(f"the build did not finish in {seconds:.0f} s (--build-timeout-s)")
  if "error" in box:
    raise box["error"]
  return box["out"]


def run_layout(layout, args, cfg, tx, corpus, until):
  from benchmarks import common
  from taco_jax import data
  from taco_jax.tp.schedules import bubble_fraction
  from taco_jax.tp.zero import bytes_per_device

  runs, failed = {}, []
  dp, pp, tp = layout
  slowest_compile, hung = 0.0, None
  for variant in args._variants:
    v, t0 = variant.name, time.perf_counter()
    if hung:  # a hung compile may hold the compiler's locks: time what was built
      failed.append(dict(layout=f"{dp},{pp},{tp}", variant=v,
                         error=f"skipped: the build of {hung} hung"))
      continue
    if t0 + slowest_compile > args._compile_by:  # leave the built ones time to step
      print(f"{dp},{pp},{tp} {v}: not compiled, the deadline's compile share is spent",
            flush=True)
      failed.append(dict(layout=f"{dp},{pp},{tp}", variant=v,
                         error="skipped: --deadline-s left no time to compile and step it"))
      continue
    try:  # one variant that does not build (e.g. out of memory) must not lose the others
      exe, state, batch, mesh, plan, profiled = build_within(
          args.build_timeout_s, variant, layout, args, cfg, tx)
    except BuildHung as e:
      print(f"{dp},{pp},{tp} {v}: {e}; no further variant is built", flush=True)
      failed.append(dict(layout=f"{dp},{pp},{tp}", variant=v, error=f"BuildHung: {e}"))
      hung = v
      continue
    except Exception as e:  # noqa: BLE001 (recorded in the results and printed)
      traceback.print_exc()
      failed.append(dict(layout=f"{dp},{pp},{tp}", variant=v, error=f"{type(e).__name__}: "
                         f"{str(e)[:2000]}"))
      continue
    if v in args.dump_hlo.split(","):
      hlo_dir = pathlib.Path(args.out_dir or tempfile.gettempdir())
      hlo_dir.mkdir(parents=True, exist_ok=True)
      dest = hlo_dir / f"hlo_{args.label}_{dp}{pp}{tp}_{v}.txt.gz"
      common.write_hlo(exe, dest)
      print(f"wrote {dest}", flush=True)
    runs[v] = dict(exe=exe, state=state, batch=batch, compile_s=time.perf_counter() - t0,
                   variant=variant, memory=common.compiled_memory(exe),
                   state_bytes=dict(params_bytes_per_device=bytes_per_device(state[0]),
                                    opt_state_bytes_per_device=bytes_per_device(state[1])),
                   plan=dataclasses.asdict(plan) if plan else None, pgle_profiled=profiled,
                   **comm_record(exe.as_text(), mesh))
    if variant.kernels:  # the reasons any kernel layer took XLA's collective so far
      from taco_jax.tp import fused
      runs[v]["kernel_fallbacks"] = fused.fallbacks()
    slowest_compile = max(slowest_compile, runs[v]["compile_s"])
    print(f"{dp},{pp},{tp} {v}: compiled in {runs[v]['compile_s']:.1f} s", flush=True)
  tokens_at = lambda i: data.batch_at(corpus, i, seed=0, batch_size=args.batch,  # noqa: E731
                                     seq_len=args.seq)
  stepped = step_interleaved(runs, tokens_at, args,
                             until(sum(r["compile_s"] for r in runs.values())))
  failed += [dict(layout=f"{dp},{pp},{tp}", variant=v, error=e) for v, e in stepped.items()]
  out = []
  for name, r in runs.items():
    out.append(dict(layout=f"{dp},{pp},{tp}", dp=dp, pp=pp, tp=tp, variant=name,
                    mesh=(f"data={dp},pipeline={pp},tensor={tp}" if r["variant"].ours else
                          f"data={dp * pp},tensor={tp}"),
                    plan=r["plan"], xla_options=xla_options(r["variant"], args),
                    remat=cfg.remat and r["variant"].remat, **r["variant"].parallel_fields(),
                    fused_gelu=r["variant"].fused_gelu, fused_qkv=r["variant"].fused_qkv,
                    **r["memory"], **r["state_bytes"],
                    pgle_profiled=r["pgle_profiled"],
                    # the schedule's idle share in theory (backward = 2 forwards), beside
                    # the measured step; None without a pipeline
                    bubble_fraction=(bubble_fraction(r["variant"].schedule, pp, args.microbatches,
                                                     r["variant"].virtual_stages)
                                     if pp > 1 and r["variant"].ours else None),
                    device_peak_bytes=r["device_peak_bytes"],
                    kernel_fallbacks=r.get("kernel_fallbacks"),
                    **timing_record(r, args)))
    del r["exe"], r["state"]
  return out, failed


COLUMNS = ("off", "on", "ideal", "gspmd", "ring_off", "ring_on", "off_il2", "on_il2",
           "off_pgle", "on_pgle")  # summary keys <v>_ms, None when not measured


def summarize(rows) -> list[dict]:
  """Per layout: every variant's step time, the communication share, and what compression,
  interleaving and PGLE buy."""
  out = []
  for lay in dict.fromkeys(r["layout"] for r in rows):
    t = {r["variant"]: r["step_ms"] for r in rows if r["layout"] == lay}
    s = dict(layout=lay, **{f"{v}_ms": t.get(v) for v in dict.fromkeys((*COLUMNS, *t))})
    if "off" in t and "ideal" in t:
      s["comm_ms"] = t["off"] - t["ideal"]
      s["comm_share"] = s["comm_ms"] / t["off"]
      if "on" in t:
        s["recovered"] = ((t["off"] - t["on"]) / s["comm_ms"]) if s["comm_ms"] > 0 else None
    if "on" in t and "off" in t:
      s["speedup_on_vs_off"] = t["off"] / t["on"]
    if "gspmd" in t and "off" in t:
      s["off_vs_gspmd"] = t["gspmd"] / t["off"]  # > 1: our bf16 step is faster
    ours = [parse_variant(v) for v in t]
    for v in ours:  # > 1: the modifiers (_il2, _save, _pgle) pay against the plain program
      mods = v.name.removeprefix(v.base)  # "" or "_il2_save", ...
      if v.base in ("off", "on") and mods and v.base in t:
        s[f"speedup{mods}_{v.base}"] = t[v.base] / t[v.name]
      if v.base == "off" and mods and "gspmd" in t:
        s[f"{v.name}_vs_gspmd"] = t["gspmd"] / t[v.name]
      on, ideal = f"on{mods}", f"ideal{mods}"
      exposed = v.base == "off" and mods and ideal in t and t[v.name] > t[ideal]
      if exposed:  # the same figures for a modified pair
        s[f"comm_share{mods}"] = (t[v.name] - t[ideal]) / t[v.name]
      if v.base == "off" and mods and on in t:
        s[f"speedup_on_vs_off{mods}"] = t[v.name] / t[on]
        if exposed:
          s[f"recovered{mods}"] = (t[v.name] - t[on]) / (t[v.name] - t[ideal])
      # a kernel or exchange variant against the collectives-between-matmuls pair of its
      # other modifiers
      off, ideal = f"off{_pair(v)}", f"ideal{_pair(v)}"
      if (v.kernels or v.tp_exchange) and off in t and ideal in t and t[off] > t[ideal]:
        name = "ceiling" if v.base == "ideal" else "recovered"
        s[f"{name}_{v.name}"] = (t[off] - t[v.name]) / (t[off] - t[ideal])
      if v.kernels and v.base != "ideal" and "gspmd" in t:
        s[f"{v.name}_vs_gspmd"] = t["gspmd"] / t[v.name]
    pickable = [v for v in ours if v.graphs != "all"]  # as the trainer may compile them
    offs = [v.name for v in pickable if v.base in ("off", "ring_off")]
    ons = [v.name for v in pickable if v.compressed]
    if len(offs) > 1 or len(ons) > 1:  # a choice of programs: what a user would pick
      best_off = min(offs, key=t.get, default=None)
      best_on = min(ons, key=t.get, default=None)
      s.update(best_off=best_off, best_on=best_on, best_off_ms=t.get(best_off),
               best_on_ms=t.get(best_on))
      if best_off and best_on:
        s["speedup_best"] = t[best_off] / t[best_on]
        ideal = t.get(f"ideal{_pair(parse_variant(best_off))}", t.get("ideal"))
        if ideal is not None and t[best_off] > ideal:
          s["recovered_best"] = (t[best_off] - t[best_on]) / (t[best_off] - ideal)
      if best_off and "gspmd" in t:
        s["best_off_vs_gspmd"] = t["gspmd"] / t[best_off]
    out.append(s)
  return out


def variant_plan(variant: Variant, args):
  """The codecs a variant of ours compresses with: none for off / ideal; --compress's, on
  what pays on --link (everything without it or with _nolink); dp_params only with ZeRO."""
  from taco_jax.plan import CompressionPlan
  if not variant.compressed:
    return CompressionPlan()
  plan = compression_plan(args, link=None if variant.every_link else args.link)
  return plan if variant.shard_optimizer else dataclasses.replace(plan, dp_params=None)


def _pair(v: Variant) -> str:
  """The modifiers of `v`'s pair among the collectives between the matmuls ('_save_dots' for
  on_cm_xchg_save_dots_fgraphs): its own, less those of the kernel layers and the exchange."""
  mods = v.name.removeprefix(v.base).split("_")[1:]
  return "".join(f"_{m}" for m in mods if m not in PAIRED_WITH_COLLECTIVES)


def add_overlap_flags(args) -> None:
  """XLA's collective-overlap flags into XLA_FLAGS (before the backend starts), unless
  --no-overlap-flags; a flag already set there is kept as it is."""
  from benchmarks.gspmd import XLA_OVERLAP_FLAGS  # imports jax; no backend yet
  if not args.no_overlap_flags:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([flags, *(f for f in XLA_OVERLAP_FLAGS
                                                  if f.split("=")[0] not in flags)]).strip()


def link_note(args) -> str | None:
  """What to say when a compressed variant runs without --link: every collective and kernel
  is then compressed, where the trainer compresses only what pays on its link."""
  compressed = [v.name for v in args._variants if v.compressed]
  if compressed and args.link is None:
    return (f"note: no --link, so {', '.join(compressed)} compress every collective and "
            "kernel (--link nvlink: only what pays on NVLink, as the trainer does)")
  return None


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if note := link_note(args):
    print(note, flush=True)
  start_watchdog()
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  add_overlap_flags(args)
  import jax
  from benchmarks import attention_numerics, common
  from taco_jax.models.decoder import flops_per_token
  from taco_jax import data
  from taco_jax.train.metrics import device_peak_bytes

  cfg, tx = model_and_optimizer(args, remat=not args.no_remat)
  try:
    attention = dict(requested=args.attention, backend=cfg.attention_backend(args.seq))
  except ValueError as e:  # e.g. --attention cudnn where cuDNN cannot run
    raise SystemExit(f"--attention {args.attention}: {e}") from e
  t0 = time.perf_counter()
  args._compile_by = t0 + COMPILE_SHARE * args.deadline_s
  layouts, corpus, ceiling, until = bench_setup(args)
  attention["numerics"] = attention_numerics.compare(cfg, args.batch, args.seq)
  print(f"{attention['backend']} attention; "
        + attention_numerics.summary_line(attention["numerics"]), flush=True)
  n = jax.device_count()
  args._tokens0 = data.batch_at(corpus, 0, seed=0, batch_size=args.batch, seq_len=args.seq)
  fpt = flops_per_token(cfg, args.seq)
  env = common.environment()
  path = results_path("bench_train", args, num_devices=n, platform=env["platform"],
                      date=env["date"])
  rows, failed = [], []
  for k, lay in enumerate(layouts):
    done, bad = run_layout(lay, args, cfg, tx, corpus,
                           lambda c, k=k: until(len(layouts) - k - 1, c))
    failed += bad
    for r in done:
      r["mfu"] = common.mfu(r["tokens_per_s"], fpt, n, env["device_kind"])
      r["mfu_of_measured"] = r["tokens_per_s"] * fpt / (n * ceiling["tflops"] * 1e12)
      rows.append(r)
      print(f"{r['layout']:>7s} {r['variant']:>14s}: {r['step_ms']:9.2f} ms/step "
            f"{r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu'] or 0:.3f} (spec peak) "
            f"{r['mfu_of_measured']:.3f} (measured matmul)  loss {r['final_loss']:.4f}"
            f"  (compile {r['compile_s']:.1f} s)", flush=True)
    summary = summarize(rows)
    report = dict(benchmark="bench_train", label=args.label, device=env["device_kind"],
                  num_devices=n, jax_version=jax.__version__, date=env["date"],
                  timing=TIMING,
                  ideal="off with collectives over 'tensor' replaced by local stand-ins of "
                        "the same shapes (collectives.free_communication); its loss is "
                        "meaningless",
                  gspmd="plain jax.jit + NamedSharding (benchmarks.gspmd) on a "
                        "(dp*pp, tp) data x tensor mesh; activation=" + args.gspmd_activation,
                  env=common.run_env(),
                  config=dict({k: v for k, v in vars(args).items() if not k.startswith("_")},
                              model_cfg=dataclasses.asdict(cfg), flops_per_token=fpt),
                  environment=env, ceilings=dict(matmul_bf16=ceiling), attention=attention,
                  device_peak_bytes=device_peak_bytes(), summary=summary,
                  failed=failed, results=rows, complete=k == len(layouts) - 1,
                  wall_s=time.perf_counter() - t0)
    path.write_text(json.dumps(report, indent=1))  # after every layout: nothing lost
  print(f"{args.model} GPT, seq {args.seq}, batch {args.batch}, {n}x {env['device_kind']}, "
        f"{attention['backend']} attention, bf16 matmul ceiling {ceiling['tflops']:.0f} TFLOP/s, "
        f"NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE')}")
  print(f"mfu: against the spec peak ({common.peak_tflops(env['device_kind'])} "
        f"TFLOP/s); mfu_of_measured: against the bf16 matmul ceiling measured above; "
        f"opt_gib: the optimizer state per device; "
        f"peak_gib, temp_gib: the compiled step's peak memory and temporaries per device; "
        f"dev_peak_gib: the device's peak bytes in use (memory_stats) after the variant's "
        f"first step, process-wide")
  gib = lambda b: None if b is None else b / 2**30  # noqa: E731
  print(common.table([dict(r, peak_gib=gib(r["memory_peak_bytes"]),
                           temp_gib=gib(r["memory_temp_bytes"]),
                           dev_peak_gib=gib(r["device_peak_bytes"]),
                           opt_gib=gib(r["opt_state_bytes_per_device"])) for r in rows],
                     ["layout", "variant", "steps", "compile_s", "step_ms", "step_ms_synced",
                      "tokens_per_s", "mfu", "mfu_of_measured", "opt_gib", "peak_gib",
                      "temp_gib", "dev_peak_gib", "final_loss"]))
  print(common.table(summary, ["layout", "off_ms", "on_ms", "ideal_ms", "gspmd_ms", "comm_ms",
                               "comm_share", "recovered", "speedup_on_vs_off",
                               "off_vs_gspmd"]))
  if any(s["off_il2_ms"] or s["on_il2_ms"] for s in summary):
    print(common.table(summary, ["layout", "off_ms", "off_il2_ms", "on_ms", "on_il2_ms",
                                 "speedup_il2_off", "speedup_il2_on", "off_il2_vs_gspmd"]))
  if any("best_off_ms" in s for s in summary):
    print(common.table(summary, ["layout", "ring_off_ms", "ring_on_ms", "off_pgle_ms",
                                 "on_pgle_ms", "best_off", "best_on", "speedup_best",
                                 "recovered_best", "best_off_vs_gspmd"]))
  print(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
