#!/usr/bin/env bash
# The GPU measurements, in the order of their issues, for one lent machine:
#   bash benchmarks/gpu_suite.sh codec collectives   # one call (~8 min on 4xH200)
#   bash benchmarks/gpu_suite.sh train               # another (~6 min)
#   bash benchmarks/gpu_suite.sh e2e                 # bench_train, NVLink + P2P off (~9 min)
#   bash benchmarks/gpu_suite.sh link ring           # --link nvlink; ring layers (~9 min)
#   bash benchmarks/gpu_suite.sh e2e_2.7b            # 2.7B GPT at TP=4 (~8 min)
#   bash benchmarks/gpu_suite.sh accuracy            # 3 x 2000 training steps (~9 min)
#   bash benchmarks/gpu_suite.sh overlap             # bench_train, ring layers too (~9 min)
#   bash benchmarks/gpu_suite.sh profile             # device traces: on, off_il2, on_il2 (~2 min)
#   bash benchmarks/gpu_suite.sh codec codec_hadamard  # one GPU (H100 or H200; ~8 min)
#   bash benchmarks/gpu_suite.sh accuracy_seed2 collectives_2gpu  # (~6 min on 4xH200)
#   bash benchmarks/gpu_suite.sh interleave          # bench_train, parallel.interleave=2 (~9 min)
#   bash benchmarks/gpu_suite.sh xla_kernels         # bench_train, codec as jnp reference (~7 min)
#   bash benchmarks/gpu_suite.sh pgle                # bench_train, profile-guided schedules
#                                                    # (~6 min)
#   bash benchmarks/gpu_suite.sh xla_kernels pp2     # + TP=2 x PP=2 on / off (~9 min)
#   bash benchmarks/gpu_suite.sh save                # parallel.save_tp_outputs beside GSPMD
#                                                    # (~9 min)
#   bash benchmarks/gpu_suite.sh save_il2            # ... with interleave=2, NVLink + P2P off
#                                                    # (~8 min)
#   bash benchmarks/gpu_suite.sh save_2.7b save_dp2  # _save: 2.7B, and DP=2 x TP=2 (~9 min)
#   bash benchmarks/gpu_suite.sh transport           # bare transports by dtype, NCCL settings
#                                                    # (~4 min)
#   bash benchmarks/gpu_suite.sh fused_decode        # one GPU: decode folded into matmuls? (~3 min)
#   bash benchmarks/gpu_suite.sh e2e_8gpu            # issue 7, 8xH200: TP=8 and 2x2x2 (~9 min)
#   SIZES=1,4,16,64 bash benchmarks/gpu_suite.sh collectives  # on 8xH200: issue 7's 8 ranks
#   bash benchmarks/gpu_suite.sh baseline            # issue 19, 2xH200, TP=2: cuDNN attention,
#                                                    # remat policies and no remat (<= 9 min)
#   bash benchmarks/gpu_suite.sh baseline_dp2        # ... DP=2, TP=1 (<= 6 min)
#   bash benchmarks/gpu_suite.sh collective_matmul   # issue 15: fused kernels vs XLA (~3 min per
#                                                    # model)
#                                                    # (MODELS, LAYERS, TILINGS, RS_PHASES, RS_PULL,
#                                                    # RS_SKIP, AG_SKIP, RS_PROBE,
#                                                    # AG_CHUNK_WAITS=1, COLD=1, HOT=1, FRESH=1,
#                                                    # CM_TP=2
#                                                    # (TP=2 shapes on one GPU),
#                                                    # CORE_TILINGS e.g.
#                                                    # default,cluster_n=2,cluster_n=4; LABEL)
#   bash benchmarks/gpu_suite.sh peer_copy         # issue 15: in-kernel copies' link rate vs
#                                                  # NCCL, all GPUs and 2 of them (<= 7 min)
#   bash benchmarks/gpu_suite.sh exchange          # parallel.tp_exchange on all GPUs as TP:
#                                                  # its kernels vs NCCL / apart, then the
#                                                  # 1.3B steps with and without it (<= 10
#                                                  # min; TP=2 on 4 GPUs:
#                                                  # CUDA_VISIBLE_DEVICES=0,1)
#   bash benchmarks/gpu_suite.sh profile_exchange  # ... its kernel vs NCCL, then a trace of the
#                                                  # kernel layers' step with it (<= 8.5 min)
#   bash benchmarks/gpu_suite.sh cm_scan           # the kernel layers scanned vs unrolled
#                                                  # (XLA's per-call set-up), then traces
#                                                  # (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh weight_grads      # the kernel layers' weight gradients as
#                                                  # bf16 or fp32-output dots, TP = visible
#                                                  # GPUs, then a trace (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh energy            # one GPU: the GEMM core's and cuBLAS's
#                                                  # energy per call (CORE_TILINGS; <= 4 min)
#   bash benchmarks/gpu_suite.sh schedule_1gpu     # one GPU: what XLA schedules beside each
#                                                  # async collective of TP=2 programs, the
#                                                  # exchange in batch halves too (mock NCCL;
#                                                  # compiles only, <= 6 min)
#   bash benchmarks/gpu_suite.sh ring_wgrad        # the ring layers' weight gradients as bf16
#                                                  # or fp32-output dots, P2P off (<= 7.5 min)
#   bash benchmarks/gpu_suite.sh cm_1gpu pgle_1gpu   # one GPU: the kernels at TP=2 shapes, rank 0
#                                                    # alone; the trainer's PGLE on a real profile
#   bash benchmarks/gpu_suite.sh rs_1gpu             # one GPU: the reduce-scatter kernels alone,
#                                                    # ptxas's spills, the FP8 epilogue's parts
#   bash benchmarks/gpu_suite.sh trainer_1gpu        # the trainer itself, 1.3B on one GPU: XLA's
#                                                    # overlap options off / on, and with PGLE
#   bash benchmarks/gpu_suite.sh trainer_remat_1gpu  # ... as configured, save_dots, + unrolled
#   bash benchmarks/gpu_suite.sh trainer_attn_1gpu   # ... without / with save_attention
#   bash benchmarks/gpu_suite.sh trainer_head_1gpu   # ... without / with save_head
#   bash benchmarks/gpu_suite.sh trainer_gelu_1gpu   # ... XLA's GELU / model.mlp_gelu=fused
#   bash benchmarks/gpu_suite.sh gelu_curve_1gpu     # the fused GELU's numerics (1.3B MLP
#                                                  # shapes) and gpt_125m's val loss over 300
#                                                  # steps, seeds 0-2, both ways (<= 9 min)
#   bash benchmarks/gpu_suite.sh trainer_gelu_small_1gpu  # ... 125M / 350M, XLA's GELU / fused
#   bash benchmarks/gpu_suite.sh allocators_1gpu     # ... GEMM sequences and the 1.3B step under
#                                                    # each XLA allocator (<= 9 min)
#   bash benchmarks/gpu_suite.sh trainer_scan_1gpu   # ... 125M / 350M, layers scanned or unrolled
#   bash benchmarks/gpu_suite.sh cm_train            # ... end to end at TP=2 (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh cm_dots           # issues 15 + 19, TP=2: strong step, kernel
#                                                  # layers (<= 10 min)
#   bash benchmarks/gpu_suite.sh cm_dots_pipelined # ... its first three, timed back to back
#                                                  # (<= 7 min)
#   bash benchmarks/gpu_suite.sh baseline_nop2p    # issue 19, TP=2, P2P off: strong step vs
#                                                  # compressed (<= 7 min)
#   bash benchmarks/gpu_suite.sh pp_sched          # issue 17, PP=2: GPipe, 1F1B, interleaved
#                                                  # (<= 7.5 min)
#   bash benchmarks/gpu_suite.sh pp_memory         # issue 17, PP=2: schedules' memory vs m,
#                                                  # compiled only (<= 8 min)
#   bash benchmarks/gpu_suite.sh dp2_zero          # issues 18 + 19, DP=2: ZeRO, compressed
#                                                  # (<= 9.5 min)
#   SEED=0 bash benchmarks/gpu_suite.sh accuracy_dp2  # issue 18: accuracy, DP=2 ZeRO + FP8
#                                                     # (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh accuracy_cm       # issue 15, TP=2: FP8 kernels vs FP8 collectives
#                                                  # (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh accuracy_cm_evals # ... both evaluated every 4 steps (<= 5.5 min)
#   bash benchmarks/gpu_suite.sh probe_evals       # ... why the kernels' evaluations gave NaN
#                                                  # (<= 7 min)
#   bash benchmarks/gpu_suite.sh cm_graphs         # ... the kernel layers' step by its CUDA graphs
#                                                  # (<= 10 min)
#   bash benchmarks/gpu_suite.sh dp2_ogr           # issues 19 + 18, DP=2: grads reduced in backward
#                                                  # (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh dp2_leaves        # issue 19, DP=2: gradients reduced leaf by leaf
#                                                  # (<= 7 min)
#   bash benchmarks/gpu_suite.sh profile_dp2       # issue 19, DP=2: a device trace of the step
#                                                  # (<= 7 min)
#   bash benchmarks/gpu_suite.sh profile_cm        # issue 15, TP=2: a trace of the kernel layers'
#                                                  # step (<= 7 min); beside the ideal with
#                                                  # VARIANTS=off_cm_save_dots_unroll,\
#                                                  #   ideal_save_dots_unroll
#   bash benchmarks/gpu_suite.sh profile_rs        # issue 15, TP=2: inside the reduce-scatter
#                                                  # kernel (<= 5 min)
#   bash benchmarks/gpu_suite.sh cm_train_4gpu       # ... TP=4 and DP=2 x TP=2 (4xH200)
#   bash benchmarks/gpu_suite.sh cm_dots_4gpu        # issue 15, 4xH200, TP=4: strong step
#                                                    # (<= 5.5 min)
#   bash benchmarks/gpu_suite.sh cm_step_4gpu        # ... the TP=4 kernel step (<= 7.5 min)
#   MODELS=1.3b CM_LIMIT=290 bash benchmarks/gpu_suite.sh collective_matmul   # TP=4 kernels
#   bash benchmarks/gpu_suite.sh cm_dp2_4gpu         # ... DP=2 x TP=2 step (<= 7 min)
#   bash benchmarks/gpu_suite.sh cm_gelu             # issue 15, TP=2: the fused GELU in the
#                                                    # kernel layers, against the strong step's
#                                                    # (<= 5 min; cm_qkv alike; cm_levers
#                                                    # and cm_xparts <= 9 min)
#   bash benchmarks/gpu_suite.sh trainer_cm          # issue 15, TP=2: the trainer's own step,
#                                                    # kernels or not (<= 9.5 min)
#   bash benchmarks/gpu_suite.sh cm_baseline         # issues 15 + 19 at TP=2 in one run (<= 10 min)
#   bash benchmarks/gpu_suite.sh slow_links          # issue 16, 2xH200, TP=2, P2P off: the
#   bash benchmarks/gpu_suite.sh slow_links_combined # overlap levers alone, combined, and
#   bash benchmarks/gpu_suite.sh slow_links_no_lhs   # without XLA's overlap flags (<= 9.5 min each)
#   bash benchmarks/gpu_suite.sh slow_links_nccl     # ... NCCL on copy engines / fewer SMs
#                                                    # (<= 9.5 min;
#                                                    # SETTINGS="default NCCL_MAX_NCHANNELS=2")
# Runs with the image's python3 (jax 0.11.2 + CUDA); ml_collections travels as a wheel in
# .whl/. Every job writes its results (and suite.log) to $OUT (default /tmp/taco_out); copy
# them into benchmarks/results/ and run `python -m benchmarks.report`. The device tool
# returns at most 8 files a call: keep a call's jobs within that.
# A 2-GPU job runs on a 4-GPU lease under CUDA_VISIBLE_DEVICES=0,1 (2026-11-26), so one
# machine start serves both kinds of job. Jobs that share a results file name take LABEL.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0   # never NVLink multicast
# a job's second run of the same programs (e.g. NVLink, then NCCL_P2P_DISABLE=1) loads them
# from here instead of compiling them again; its compile_s is then the load (the results'
# env says so)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/taco_jax_cache}
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -8
out=${OUT:-/tmp/taco_out}; mkdir -p "$out"

visible_gpus() {  # nvidia-smi lists every GPU; CUDA_VISIBLE_DEVICES may hide some
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | wc -l
  else
    nvidia-smi -L | wc -l
  fi
}

# step_then_trace <label> <variants> <traced variants>: bench_train's TP = visible GPUs 1.3B
# step (NVLink policy) on the variants in one process, then those traced back to back; the
# HLO dumps are dropped so that the traces fit in what comes back
step_then_trace() {
  local n; n=$(visible_gpus)
  BENCH_WATCHDOG_S=330 timeout 340 python3 benchmarks/bench_train.py --label "$1" \
    --layouts "1,1,$n" --attention cudnn --link nvlink --deadline-s 320 \
    --build-timeout-s 150 --out-dir "$out" --variants "$2"
  timeout 200 python3 benchmarks/profile_step.py --label "$1_tp$n" --layouts "1,1,$n" \
    --attention cudnn --link nvlink --steps 3 --warmup 2 --out-dir "$out" --variants "$3"
  rm -f "$out"/hlo_*.txt.gz
}

slug() {  # "save_dots=True scan_layers=False" -> save_dots_True_scan_layers_False
  echo "$1" | tr ' =' '__'
}

# trainer_40 <config> <name> <timeout s> <overrides...>: the trainer's own step (not
# bench_train's), 40 steps without eval or checkpoints; its summary.json goes to
# $out/<name>_summary.json and its throughput, compile time and peak memory to the log
trainer_40() {
  local cfg=$1 name=$2 limit=$3; shift 3
  timeout "$limit" python3 -m taco_jax.train --config "configs/$cfg.py" --workdir "/tmp/$name" \
    "$@" --config.train.steps=40 --config.train.log_every=10 --config.train.eval_every=0 \
    --config.train.checkpoint_every=0 --config.train.eval_batches=1 \
    --config.train.progress_bar=False 2>&1 \
    | grep -E '"(mfu|tokens_per_s|compile_s|device_peak_bytes)"|Error'
  cp "/tmp/$name/summary.json" "$out/${name}_summary.json"
  rm -rf "/tmp/$name"
}
sizes=${SIZES:-1,4,16,64,256}
for job in "$@"; do
  case $job in
    cm_train)  # issue 15: TP=2 (2xH200), the kernel layers beside the collectives and GSPMD
      timeout 560 python3 benchmarks/bench_train.py --label nvlink_cm --layouts 1,1,2 \
        --variants off_save,on_save,ideal_save,gspmd,off_cm_save,on_cm_save --deadline-s 500 \
        --out-dir "$out" ;;
    cm_1gpu)  # issue 15 on one GPU: our GEMM core, plain and FP8, and rank 0's whole kernels
      # (local mode: epilogues and copies, no peers) at the TP=2 shapes
      timeout 540 python3 -m benchmarks.bench_collective_matmul --tp 2 --label rank0 \
        --out-dir "$out" ;;
    rs_1gpu)  # issue 15 on one GPU: rank 0's reduce-scatter kernels, plain and FP8, with
      # ptxas's register and spill counts per kernel; then the FP8 epilogue taken apart
      MOSAIC_GPU_DUMP_PTXAS=1 timeout 400 python3 -m benchmarks.bench_collective_matmul \
        --tp 2 --layers proj,down --label rank0_rs --out-dir "$out" > "$out/rs_1gpu.log" 2>&1
      grep -iv "ptxas\|spill\|registers\|^$" "$out/rs_1gpu.log" | tail -30
      grep -i "ptxas\|spill\|registers\|stack frame" "$out/rs_1gpu.log" > "$out/rs_1gpu_ptxas.txt"
      rm -f "$out/rs_1gpu.log"
      grep -i "entry\|spill\|registers" "$out/rs_1gpu_ptxas.txt" | head -40
      timeout 240 python3 -m benchmarks.probe_rs_epilogue --label parts --out-dir "$out" ;;
    profile_rs)  # issue 15 on 2xH200: the reduce-scatter kernels' regions per warpgroup
      # (Mosaic GPU's on-device profiler), 1.3B proj and down, plain and FP8
      timeout 300 python3 -m benchmarks.profile_rs_kernel --out-dir "$out" ;;
    pgle_1gpu)  # issue 16: the trainer's parallel.pgle on a real profile, then resumed
      for steps in 30 40; do
        timeout 240 python3 -m taco_jax.train --config configs/tiny.py --workdir /tmp/pgle \
          --config.parallel.pgle=True --config.train.steps=$steps \
          --config.train.progress_bar=False || break
        cp /tmp/pgle/summary.json "$out/pgle_1gpu_summary_$steps.json"
      done ;;
    trainer_1gpu)  # the trainer's own step (not bench_train's): 1.3B, batch 8, 40 steps
      for v in xla_overlap=False xla_overlap=True pgle=True; do
        trainer_40 gpt_1_3b "trainer_1gpu_$(slug "$v")" 300 --config.parallel.$v \
          --config.data.batch_size=8
      done ;;
    trainer_remat_1gpu)  # issue 19: the trainer's own 1.3B step (batch $BATCH, default 8;
      # 40 steps): remat recomputing the matmuls (the old default), keeping their outputs,
      # and with the layers unrolled too (gpt_1_3b's setting now)
      for v in "save_dots=False scan_layers=True" "save_dots=True scan_layers=True" \
               "save_dots=True scan_layers=False"; do
        read -r first second <<< "$v"
        trainer_40 gpt_1_3b "trainer_1gpu_b${BATCH:-8}_$(slug "$v")" 180 \
          --config.parallel.$first --config.parallel.$second --config.data.batch_size=${BATCH:-8}
      done ;;
    trainer_attn_1gpu | trainer_head_1gpu | trainer_gelu_1gpu | trainer_qkv_1gpu)  # the
      # trainer's own 1.3B step (batch 8, 40 steps) without and with parallel.save_attention /
      # save_head (since 2026-11-28) / model.mlp_gelu=fused (since 2026-11-29) /
      # model.qkv_split=fused, gpt_1_3b's settings
      case $job in
        trainer_attn_1gpu) flags="parallel.save_attention=False parallel.save_attention=True" ;;
        trainer_head_1gpu) flags="parallel.save_head=False parallel.save_head=True" ;;
        trainer_gelu_1gpu) flags="model.mlp_gelu=xla model.mlp_gelu=fused" ;;
        trainer_qkv_1gpu) flags="model.qkv_split=xla model.qkv_split=fused" ;;
      esac
      for v in $flags; do
        trainer_40 gpt_1_3b "trainer_1gpu_b8_$(slug "${v#*.}")" 180 --config.$v \
          --config.data.batch_size=8
      done ;;
    allocators_1gpu)  # why GEMMs run slower in sequences: the same kernel sequences
      # (probe_sequences, with the SM clock stamped between GEMMs) and the trainer's 1.3B
      # step (batch 8, 40 steps) under each of XLA's device allocators
      v='alone[ours],ours>core[dep],ours>cublas[dep],alone[cublas],layers[in=cublas+out=cublas]'
      for a in default platform cuda_async vmm; do
        XLA_PYTHON_CLIENT_ALLOCATOR=$a timeout 75 python3 benchmarks/probe_sequences.py \
          --label "h200_alloc_$a" --pad-mib 0,5 --variants "$v" --out-dir "$out" 2>&1 \
          | grep -E '^round|Error' | cut -c1-200
      done
      for a in platform default cuda_async vmm; do
        XLA_PYTHON_CLIENT_ALLOCATOR=$a trainer_40 gpt_1_3b "trainer_1gpu_b8_alloc_$a" 90 \
          --config.data.batch_size=8
      done ;;
    gelu_curve_1gpu)  # model.mlp_gelu=fused: per-layer errors against fp32 beside XLA's
      # (benchmarks/gelu_numerics.py), then gpt_125m trained 300 steps with XLA's GELU and the
      # fused one, seeds 0-2 (same data and init per seed), val loss every 100 steps
      python3 benchmarks/gelu_numerics.py --out-dir "$out"
      mkdir -p "$out/gelu_curve_125m"
      for s in 0 1 2; do
        for g in xla fused; do
          timeout 150 python3 -m taco_jax.train --config configs/gpt_125m.py \
            --workdir "/tmp/curve_${g}_$s" --config.model.mlp_gelu=$g --config.seed=$s \
            --config.train.steps=300 --config.train.eval_every=100 \
            --config.train.eval_batches=8 --config.train.checkpoint_every=0 \
            --config.train.progress_bar=False --config.data.batch_size=16 \
            --config.optim.warmup_steps=50 2>&1 | grep -E "val_loss |Error"
          cp "/tmp/curve_${g}_$s/metrics.jsonl" "$out/gelu_curve_125m/${g}_seed${s}_metrics.jsonl"
          rm -rf "/tmp/curve_${g}_$s"
        done
      done ;;
    trainer_gelu_small_1gpu)  # model.mlp_gelu on the small configs: gpt_125m once, gpt_350m
      # twice, each XLA's GELU then the fused one (the configs' batch, 40 steps)
      runs=0
      for cfg in gpt_125m gpt_350m gpt_350m; do
        for g in xla fused; do
          trainer_40 $cfg "trainer_1gpu_${cfg}_mlp_gelu_$g" 150 --config.model.mlp_gelu=$g
          mv "$out/trainer_1gpu_${cfg}_mlp_gelu_${g}_summary.json" \
            "$out/trainer_1gpu_${cfg}_mlp_gelu_${g}_$((++runs))_summary.json"
        done
      done ;;
    trainer_scan_1gpu)  # issue 19: the trainer's 125M and 350M steps (no remat, the configs'
      # batch; 40 steps) with the layers scanned (with and without XLA's overlap options,
      # whose double-buffered layer loop may be what costs the scan its memory) and unrolled
      for cfg in gpt_125m gpt_350m; do
        for v in "scan_layers=True xla_overlap=True" "scan_layers=True xla_overlap=False" \
                 "scan_layers=False xla_overlap=True"; do
          read -r first second <<< "$v"
          trainer_40 $cfg "trainer_1gpu_${cfg}_$(slug "$v")" 150 \
            --config.parallel.$first --config.parallel.$second
        done
      done ;;
    trainer_cm)  # issue 15 on 2 GPUs (TP=2; TP=4 on 4): the trainer's own 1.3B step (batch 8,
      # 40 steps, metrics fetched every 10), the collectives between the matmuls against the
      # kernel layers: bench_train times steps within turns of back-to-back steps, where a
      # step of the kernel layers waited for alone took 263 ms without CUDA graphs, 177 with
      # the trainer's (2026-11-26), so this is what a user's run gets
      for v in none kernel; do
        trainer_40 gpt_1_3b "trainer_tp${TP:-2}_$v" 280 --config.parallel.tp=${TP:-2} \
          --config.parallel.tp_overlap=$v --config.parallel.save_tp_outputs=True \
          --config.data.batch_size=8
      done ;;
    cm_gelu | cm_qkv | cm_levers | cm_xparts)  # issue 15 on 2 GPUs (TP=2), the kernel layers
      # with a change against them without it, beside the bf16 step and its ideal with the fused
      # GELU: cm_gelu, the MLP's GELU in the all-gather kernels' epilogues
      # (model.mlp_gelu=fused, since 2026-11-29); cm_qkv, q, k, v written apart by the QKV
      # all-gather kernel (model.qkv_split=fused, since 2026-11-29: a tie at TP=2);
      # cm_levers, two levers alone and together: _wgat, the exchange's weights gathered
      # before the first layer (step.GATHER_EXCHANGE_WEIGHTS, 2026-11-29: XLA's per-layer
      # gathers slowed 7 of 24 QKV kernels a step), and _nolink, every kernel in FP8 where
      # the link policy picks none at TP=2 (the steps run at the power limit, the kernel
      # layers' at lower clocks: fewer bytes may pay there); cm_xparts, the attention and
      # its exchange in batch halves / quarters, all but the last slice's exchange beside the
      # next slice's attention (layers.EXCHANGE_PARTS; with _wgat, which frees the
      # scheduler's one collective in flight for them: probe_schedule_xparts_wgat_mock).
      # 2026-11-29, one process (nvlink_wgat_xparts_tp2): _wgat tied, _xparts lost 3.9 ms
      v=off_save_dots_attn_head_gelu_unroll,ideal_save_dots_attn_head_gelu_unroll
      case $job in
        cm_gelu) v=$v,on_cm_xchg_save_dots_attn_head_unroll_fgraphs
                 v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_fgraphs ;;
        cm_qkv) v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_fgraphs
                v=$v,on_cm_xchg_save_dots_attn_head_gelu_qkv_unroll_fgraphs ;;
        cm_levers) v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_fgraphs
                   v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_wgat_fgraphs
                   v=$v,on_cm_xchg_nolink_save_dots_attn_head_gelu_unroll_fgraphs
                   v=$v,on_cm_xchg_nolink_save_dots_attn_head_gelu_unroll_wgat_fgraphs ;;
        cm_xparts) v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_wgat_fgraphs
                   v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_wgat_xparts_fgraphs
                   v=$v,on_cm_xchg_save_dots_attn_head_gelu_unroll_wgat_xparts4_fgraphs ;;
      esac
      BENCH_WATCHDOG_S=530 timeout 540 python3 benchmarks/bench_train.py --label "nvlink_$job" \
        --layouts 1,1,${TP:-2} --attention cudnn --link nvlink --deadline-s 500 \
        --build-timeout-s 170 --variants $v --out-dir "$out" ;;
    cm_baseline)  # issues 15 + 19 in one run on 2xH200 (TP=2): the kernel layers, GSPMD,
      # and the bf16 step's remat policies (keep matmul outputs, no remat)
      timeout 590 python3 benchmarks/bench_train.py --label nvlink_cm --layouts 1,1,2 \
        --variants off_save,ideal_save,gspmd,off_cm_save,on_cm_save,off_save_dots,off_noremat \
        --deadline-s 540 --out-dir "$out" ;;
    slow_links)  # issue 16, 2xH200 through host memory: each overlap lever alone on the
      # compressed step that keeps the TP outputs (interleave, 2 / 4 collectives in flight, PGLE)
      NCCL_P2P_DISABLE=1 timeout 570 python3 benchmarks/bench_train.py --label nop2p_levers \
        --layouts 1,1,2 --deadline-s 520 \
        --variants off_save,on_save,on_il2_save,on_save_cif2,on_save_cif4,on_save_pgle \
        --out-dir "$out" ;;
    slow_links_dots)  # issue 16 on the strong step (cuDNN attention, matmul outputs kept,
      # layers unrolled) through host memory: compressed alone, then with each overlap lever
      v=off_save_dots_unroll,on_save_dots_unroll,on_il2_save_dots_unroll
      v=$v,on_save_dots_unroll_cif2,on_save_dots_unroll_pgle,on_il2_save_dots_unroll_cif2_pgle
      NCCL_P2P_DISABLE=1 timeout 570 python3 benchmarks/bench_train.py --attention cudnn \
        --label nop2p_levers_dots --layouts 1,1,2 --variants "$v" --deadline-s 520 \
        --out-dir "$out" ;;
    slow_links_combined)  # ... the levers together
      v=on_save,on_il2_save_cif2,on_il2_save_pgle,on_save_cif2_pgle,on_il2_save_cif2_pgle
      NCCL_P2P_DISABLE=1 timeout 570 python3 benchmarks/bench_train.py \
        --label nop2p_levers_combined --layouts 1,1,2 --variants "$v" --deadline-s 520 \
        --out-dir "$out" ;;
    slow_links_nccl)  # issue 16, 2xH200 through host memory: NCCL settings that move the
      # bytes with the copy engines instead of SMs (NCCL_SHM_USE_CUDA_MEMCPY=1) or with fewer
      # SMs (NCCL_MAX_NCHANNELS=4), so that the matmuls keep theirs while the transfers
      # overlap them: the bare transports at the TP=2 message, then the strong step, plain
      # and compressed, alone and interleaved, under the default and 4 channels (one process
      # per setting: NCCL reads its environment once). Under the copy engines the step hung
      # (a collective's rendezvous timed out, 2026-11-24): that setting stays transport-only
      NCCL_P2P_DISABLE=1 timeout 120 python3 benchmarks/bench_transport.py --label nop2p \
        --rows 8192 --samples 10 --out-dir "$out" \
        --settings "default;NCCL_SHM_USE_CUDA_MEMCPY=1;NCCL_MAX_NCHANNELS=4"
      for setting in ${SETTINGS:-default NCCL_MAX_NCHANNELS=4}; do
        case $setting in
          default) env_set=(); label=nop2p_nccl_default
                   v=off_save_dots_unroll,on_save_dots_unroll ;;
          *) env_set=("$setting"); label="nop2p_nccl_$(slug "${setting#NCCL_}" | tr A-Z a-z)"
             v=off_save_dots_unroll,on_save_dots_unroll,on_il2_save_dots_unroll ;;
        esac
        env "${env_set[@]}" NCCL_P2P_DISABLE=1 timeout 220 python3 benchmarks/bench_train.py \
          --attention cudnn --label "$label" --layouts 1,1,2 --variants "$v" \
          --deadline-s 170 --out-dir "$out"
      done ;;
    slow_links_no_lhs)  # ... without XLA_OVERLAP_FLAGS: what the trainer compiled before
      # parallel.xla_overlap (no latency-hiding scheduler), and each lever from there
      NCCL_P2P_DISABLE=1 timeout 570 python3 benchmarks/bench_train.py --no-overlap-flags \
        --label nop2p_levers_no_lhs --layouts 1,1,2 \
        --variants on_save,on_il2_save,on_save_cif2,on_save_pgle,on_il2_save_cif2_pgle \
        --deadline-s 520 --out-dir "$out" ;;
    cm_dots)  # issues 15 + 19 on 2xH200 (TP=2): the strong bf16 step (cuDNN attention,
      # matmul outputs kept, layers unrolled: gpt_1_3b's setting), its free-comm ideal, the
      # compressed step, the kernel layers and GSPMD; in that order, as many as the
      # deadline lets compile (2026-11-23: ~40 s each unrolled, 62-93 s the kernels scanned)
      v=off_save_dots_unroll,ideal_save_dots_unroll,on_save_dots_unroll
      timeout 585 python3 benchmarks/bench_train.py --label nvlink_cm_dots --layouts 1,1,2 \
        --attention cudnn --deadline-s 520 --out-dir "$out" \
        --variants "$v,off_cm_save_dots_unroll,gspmd" ;;
    cm_graphs)  # issue 15 on 2xH200 (TP=2): the kernel layers' step with no CUDA graph, with
      # graphs for all but the kernels (_fgraphs: the trainer's, step.KERNEL_XLA_OPTIONS) and
      # for the kernels too (_graphs, timing only), beside the strong step and its free-comm
      # ideal, one process (2026-11-26, 5 variants: ~5 min); VARIANTS: others on that step
      v=off_save_dots_unroll,ideal_save_dots_unroll,off_cm_save_dots_unroll
      timeout 585 python3 benchmarks/bench_train.py --label "${LABEL:-nvlink_cm_graphs}" \
        --layouts 1,1,2 --attention cudnn --deadline-s 520 --out-dir "$out" --variants \
        "${VARIANTS:-$v,off_cm_save_dots_unroll_graphs,off_cm_save_dots_unroll_fgraphs}" ;;
    cm_dots_pipelined)  # issues 15 + 19 on 2xH200 (TP=2), steps timed back to back: the
      # strong bf16 step, its free-comm ideal and the kernel layers (cm_dots' first three)
      timeout 420 python3 benchmarks/bench_train.py --label nvlink_cm_dots_pipelined \
        --layouts 1,1,2 --attention cudnn --deadline-s 380 --out-dir "$out" \
        --variants off_save_dots_unroll,ideal_save_dots_unroll,off_cm_save_dots_unroll ;;
    baseline_nop2p)  # issue 19 on 2xH200 (TP=2) through host memory: the strong bf16 step,
      # the compressed one and GSPMD, so that compression is compared with the faster step
      NCCL_P2P_DISABLE=1 timeout 400 python3 benchmarks/bench_train.py --label nop2p_dots \
        --layouts 1,1,2 --attention cudnn --deadline-s 380 --out-dir "$out" \
        --variants off_save_dots_unroll,on_save_dots_unroll,gspmd ;;
    energy)  # one GPU: the GEMM core's energy and time per call against cuBLAS, each run
      # back to back at the power cap (<= 4 min; TRANSPOSED=1: also both on the weight
      # stored [N, K], as the backward reads it)
      BENCH_WATCHDOG_S=200 timeout 220 python3 benchmarks/probe_energy.py --rounds 3 \
        --seconds 1.5 --core-tilings "${CORE_TILINGS:-default}" --label "${LABEL:-h200}" \
        ${TRANSPOSED:+--transposed} --out-dir "$out" ;;
    schedule_1gpu)  # one GPU standing in for TP=2 (XLA's mock NCCL): the kernel layers'
      # exchange program as it is, with the weights gathered before the layers, and in batch
      # halves / quarters (layers.EXCHANGE_PARTS); what the scheduler puts beside each
      # asynchronous collective
      p=off_cm_xchg_save_dots_attn_head_gelu_unroll
      v=${p}_fgraphs,${p}_wgat_fgraphs,${p}_wgat_xparts_fgraphs,${p}_xparts4_fgraphs
      BENCH_WATCHDOG_S=340 timeout 350 python3 benchmarks/probe_schedule.py --layouts 1,1,2 \
        --attention cudnn --mock 2 --label "${LABEL:-xparts_mock}" --variants "${VARIANTS:-$v}" \
        --out-dir "$out" ;;
    ring_wgrad)  # the ring layers' (parallel.tp_overlap="ring") gathered weight gradients as
      # dots in the weight's dtype (the layers) or with fp32 outputs (_dwf32), plain and
      # compressed, through host memory, TP = the visible GPUs (<= 7.5 min)
      v=ring_off_save_dots_unroll,ring_off_dwf32_save_dots_unroll
      v=$v,ring_on_save_dots_unroll,ring_on_dwf32_save_dots_unroll
      NCCL_P2P_DISABLE=1 timeout 440 python3 benchmarks/bench_train.py --label nop2p_ring_wgrad \
        --layouts "1,1,$(visible_gpus)" --attention cudnn --deadline-s 420 --out-dir "$out" \
        --variants "$v" ;;
    pp_sched)  # issue 17 on 2xH200 (PP=2, m = 8): GPipe, 1F1B, interleaved (v = 2) and 1F1B
      # with FP8 hand-offs, keeping the TP outputs (layers scanned)
      timeout 440 python3 benchmarks/bench_train.py --label nvlink_pp_sched --layouts 1,2,1 \
        --variants off_save,off_1f1b_save,off_vs2_save,on_1f1b_save --microbatches 8 \
        --deadline-s 420 --out-dir "$out" ;;
    pp_memory)  # issue 17 on 2xH200 (PP=2), compiled only: GPipe's and 1F1B's temporaries at
      # m = 2, 4, 8, 16 micro-batches of one sequence (1.3B, save_tp_outputs, cuDNN)
      timeout 480 python3 benchmarks/pipeline_memory.py --label nvlink_pp2 --layouts 1,2,1 \
        --attention cudnn --out-dir "$out" ;;
    dp2_zero)  # issues 18 + 19 on 2xH200 (DP=2): the strong step (matmul outputs kept,
      # unrolled) replicated, with the optimizer sharded, and sharded with the DP traffic
      # compressed; NVLink, then through host memory
      for link in nvlink nop2p; do
        NCCL_P2P_DISABLE=$([ $link = nop2p ] && echo 1 || echo 0) timeout 290 python3 \
          benchmarks/bench_train.py --label "${link}_dp2_zero" --layouts 2,1,1 --attention cudnn \
          --compress dp,dp_params --deadline-s 275 --out-dir "$out" \
          --variants off_dots_unroll,off_dots_zero_unroll,on_dots_zero_unroll
      done ;;
    dp2_ogr)  # issues 19 + 18 on 2xH200 (DP=2): the gradients all-reduced layer by layer
      # inside the backward pass (_ogr) against after it, keeping the matmul outputs or
      # nothing recomputed; compressed (dp); then the same through host memory
      timeout 330 python3 benchmarks/bench_train.py --label nvlink_dp2_ogr --layouts 2,1,1 \
        --attention cudnn --compress dp --deadline-s 310 --out-dir "$out" --variants \
        off_dots_unroll,off_dots_ogr_unroll,off_ogr_unroll_noremat,on_dots_ogr_unroll
      NCCL_P2P_DISABLE=1 timeout 240 python3 benchmarks/bench_train.py --label nop2p_dp2_ogr \
        --layouts 2,1,1 --attention cudnn --compress dp --deadline-s 225 --out-dir "$out" \
        --variants off_dots_unroll,off_dots_ogr_unroll,on_dots_ogr_unroll ;;
    dp2_leaves)  # issue 19 on 2xH200 (DP=2): the plain gradient reduction leaf by leaf (no
      # fp32 buffer to pack), after the backward pass and inside it, replicated and sharded
      timeout 420 python3 benchmarks/bench_train.py --label nvlink_dp2_leaves --layouts 2,1,1 \
        --attention cudnn --deadline-s 400 --out-dir "$out" --variants \
        off_dots_unroll,off_dots_ogr_unroll,off_dots_zero_unroll,off_ogr_unroll_noremat,gspmd ;;
    profile_dp2)  # issue 19 on 2xH200 (DP=2): where the step's 30 ms above half a GPU's
      # batch go (exposed NCCL vs compute), reducing after the backward pass and layer by
      # layer inside it (which was slower over NVLink)
      timeout 400 python3 benchmarks/profile_step.py --label nvlink_dp2 --layouts 2,1,1 \
        --attention cudnn --variants off_dots_unroll,off_dots_ogr_unroll --steps 2 \
        --warmup 2 --out-dir "$out" ;;
    profile_cm)  # issue 15 on 2xH200 (TP=2): where the kernel layers' 23 ms above the
      # free-communication ideal go (the reduce-scatter kernels, XLA's cross-GPU barrier
      # before each Mosaic GPU kernel, the collectives left to XLA), beside the plain step
      timeout 420 python3 benchmarks/profile_step.py --label "${LABEL:-nvlink_cm_dots}" \
        --layouts 1,1,2 --attention cudnn --link nvlink --steps 3 \
        --variants "${VARIANTS:-off_cm_save_dots_unroll,off_save_dots_unroll}" \
        --warmup 2 --out-dir "$out" ;;
    cm_train_4gpu)  # ... TP=4 and DP=2 x TP=2, whenever 4xH200 is lent
      timeout 560 python3 benchmarks/bench_train.py --label nvlink_cm --layouts "1,1,4;2,1,2" \
        --variants off_save,on_save,ideal_save,gspmd,off_cm_save,on_cm_save --deadline-s 500 \
        --out-dir "$out" ;;
    cm_dots_4gpu)  # issue 15 on 4xH200 (TP=4): the strong step, its free-comm ideal, the
      # compressed step and GSPMD (the kernel layers: cm_step_4gpu)
      timeout 330 python3 benchmarks/bench_train.py --label nvlink_dots --layouts 1,1,4 \
        --attention cudnn --deadline-s 315 --out-dir "$out" \
        --variants off_save_dots_unroll,ideal_save_dots_unroll,on_save_dots_unroll,gspmd ;;
    cm_step_4gpu)  # issue 15 on 4 GPUs, TP=4: the kernel layers' strong step beside the
      # collectives', plain and compressed (VARIANTS: others on that step). It compiles in
      # ~2.5 min (cm_hang_4gpu's stacks, 2026-11-26: the Mosaic kernels' LLVM passes, not a
      # deadlock).
      BENCH_WATCHDOG_S=${LIMIT:-420} timeout $(( ${LIMIT:-420} + 10 )) \
        python3 benchmarks/bench_train.py --label "${LABEL:-nvlink_cm_dots}" --layouts 1,1,4 \
        --attention cudnn --deadline-s "$(( ${LIMIT:-420} - 20 ))" --build-timeout-s 300 \
        --out-dir "$out" \
        --variants \
        "${VARIANTS:-off_save_dots_unroll,on_save_dots_unroll,off_cm_save_dots_unroll}" ;;
    cm_dp2_4gpu)  # ... DP=2 x TP=2 on 4xH200: the strong step, the kernel layers and GSPMD
      BENCH_WATCHDOG_S=$(( ${LIMIT:-420} - 10 )) \
        timeout "${LIMIT:-420}" python3 benchmarks/bench_train.py \
        --label "${LABEL:-nvlink_cm_dp2}" \
        --layouts 2,1,2 --attention cudnn --deadline-s "$(( ${LIMIT:-420} - 40 ))" \
        --build-timeout-s 240 --out-dir "$out" \
        --variants off_save_dots_unroll,gspmd,off_cm_save_dots_unroll ;;
    collective_matmul)
      BENCH_WATCHDOG_S=${CM_LIMIT:-420} timeout $(( ${CM_LIMIT:-420} + 30 )) \
        python3 -m benchmarks.bench_collective_matmul \
        --tilings "${TILINGS:-default}" --models "${MODELS:-1.3b,2.7b}" \
        --layers "${LAYERS:-qkv,up,proj,down,qkv_dx,proj_dx}" \
        --rs-phases "${RS_PHASES:-}" --rs-pull-depth "${RS_PULL:-}" \
        --rs-skip "${RS_SKIP:-}" --ag-skip "${AG_SKIP:-}" --rs-probe "${RS_PROBE:-}" \
        --core-tilings "${CORE_TILINGS:-default}" \
        ${AG_CHUNK_WAITS:+--ag-chunk-waits} ${COLD:+--cold} ${HOT:+--hot} ${FRESH:+--fresh} \
        ${CM_TP:+--tp "$CM_TP"} \
        --label "${LABEL:-nvlink}" --out-dir "$out" ;;
    peer_copy)  # issue 15: the in-kernel copies' rate on all GPUs (16 MiB shards), and on
      # GPUs 0 and 1 (32 MiB: the TP=2 messages) where there are more than 2
      BENCH_WATCHDOG_S=200 timeout 230 python3 benchmarks/bench_peer_copy.py \
        --shard-mib 16 --label "${LABEL:-nvlink}" --out-dir "$out"
      if [ "$(visible_gpus)" -gt 2 ]; then
        CUDA_VISIBLE_DEVICES=0,1 BENCH_WATCHDOG_S=150 timeout 180 python3 \
          benchmarks/bench_peer_copy.py --shard-mib 32 --label "${LABEL:-nvlink}" --out-dir "$out"
      fi ;;
    exchange)  # parallel.tp_exchange, TP = every visible GPU: the exchange kernel vs NCCL's
      # all-to-all and the matmul + exchange kernels vs the two apart, then the collectives'
      # step, its ideal, the kernel layers with the exchange (its forward apart, and one
      # kernel: _ffused) and without it, in one process; a cold kernel step compiled
      # in more than 80 s on 2026-11-28, so builds may take 200. At TP=4 five variants
      # outlast the deadline's compile share (2026-11-28): VARIANTS= four of them
      n=$(visible_gpus)
      BENCH_WATCHDOG_S=150 timeout 160 python3 benchmarks/bench_exchange.py \
        --label "${LABEL:-nvlink}" --out-dir "$out"
      v=off_save_dots_unroll,ideal_save_dots_unroll,on_cm_xchg_save_dots_unroll_fgraphs
      v=$v,on_cm_xchg_ffused_save_dots_unroll_fgraphs,on_cm_save_dots_unroll_fgraphs
      v=${VARIANTS:-$v}
      BENCH_WATCHDOG_S=420 timeout 430 python3 benchmarks/bench_train.py \
        --label "${LABEL:-nvlink}_xchg_kernel" --layouts "1,1,$n" --attention cudnn \
        --link nvlink --deadline-s 410 --build-timeout-s 200 --out-dir "$out" \
        --variants "$v" ;;
    profile_exchange)  # ... the exchange kernel against NCCL, then a device trace of the
      # kernel layers' step with the exchange beside its free-communication ideal
      n=$(visible_gpus)
      BENCH_WATCHDOG_S=80 timeout 90 python3 benchmarks/bench_exchange.py \
        --label "${LABEL:-nvlink}" --out-dir "$out"
      timeout 420 python3 benchmarks/profile_step.py --label "${LABEL:-nvlink}_xchg_tp$n" \
        --layouts "1,1,$n" --attention cudnn --link nvlink --steps 2 --warmup 2 --out-dir "$out" \
        --variants "${VARIANTS:-on_cm_xchg_save_dots_unroll_fgraphs,ideal_save_dots_unroll}" ;;
    weight_grads)  # the kernel layers' weight gradients as bf16 dots (cuBLAS) against fp32
      # outputs cast to bf16 (_dwf32: Triton GEMMs), with the collectives' step, its ideal and
      # the kernel layers' free-communication step; then traces
      v=off_save_dots_unroll,ideal_save_dots_unroll,on_cm_save_dots_unroll_fgraphs
      v=$v,on_cm_dwf32_save_dots_unroll_fgraphs,ideal_cm_save_dots_unroll_fgraphs
      step_then_trace "${LABEL:-nvlink}_wgrad" "$v" \
        "${VARIANTS:-on_cm_save_dots_unroll_fgraphs,ideal_save_dots_unroll}" ;;
    cm_scan)  # the kernel layers with the layers scanned (one call site per kernel for XLA's
      # per-execution set-up, Thunks::Initialize) against unrolled (one per layer), with
      # the collectives' step and its ideal; then both kernel steps traced
      v=off_save_dots_unroll,ideal_save_dots_unroll,on_cm_save_dots_unroll_fgraphs
      v=$v,on_cm_save_dots_fgraphs,off_save_dots
      step_then_trace "${LABEL:-nvlink}_scan" "$v" \
        on_cm_save_dots_unroll_fgraphs,on_cm_save_dots_fgraphs ;;
    codec) CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m benchmarks.bench_codec \
             --sweep-size-mib 64 --out-dir "$out" ;;
    codec_hadamard)  # the tile every sweep with the transform picked (Params() defaults)
      CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m benchmarks.bench_codec \
        --hadamard --no-sweep --no-wire --out-dir "$out" ;;
    collectives_2gpu)  # the NVLink run on an axis of 2 (GPUs 0 and 1)
      CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 benchmarks/bench_collectives.py \
        --label nvlink --sizes-mib "$sizes" --out-dir "$out" ;;
    collectives)
      timeout 200 python3 benchmarks/bench_collectives.py --label nvlink --sizes-mib "$sizes" \
        --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 240 python3 benchmarks/bench_collectives.py \
        --label p2p_disabled --sizes-mib "$sizes" --out-dir "$out" ;;
    train) timeout 420 python3 benchmarks/train_parallel.py --out-dir "$out" ;;
    profile)  # device trace of one step per variant: exposed NCCL time, scheduled HLO
      timeout 400 python3 benchmarks/profile_step.py --label nvlink_il2 --layouts 1,1,4 \
        --variants on,off_il2,on_il2 --steps 2 --warmup 2 --out-dir "$out" ;;
    e2e)  # results straight to $out: a run cut off by the call's limit keeps what it wrote
      timeout 290 python3 benchmarks/bench_train.py --label nvlink --deadline-s 250 \
        --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 270 python3 benchmarks/bench_train.py --label nop2p \
        --layouts 1,1,4 --deadline-s 230 --out-dir "$out" ;;
    overlap)  # ring collective matmuls (parallel.overlap) beside the plain layers and GSPMD
      timeout 290 python3 benchmarks/bench_train.py --label nvlink_ring --layouts 1,1,4 \
        --variants off,ring_off,on,ring_on,ideal,gspmd --deadline-s 260 --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 260 python3 benchmarks/bench_train.py --label nop2p_ring \
        --layouts 1,1,4 --variants off,ring_off,on,ring_on --deadline-s 220 --out-dir "$out" ;;
    link)  # 'on' compresses only what the collective benchmark measured to pay on NVLink
      timeout 280 python3 benchmarks/bench_train.py --label nvlink_link --link nvlink \
        --variants off,on --deadline-s 250 --out-dir "$out" ;;
    ring)  # the NVLink half of `overlap`, without the compressed plain step
      timeout 270 python3 benchmarks/bench_train.py --label nvlink_ring --layouts 1,1,4 \
        --variants off,ring_off,ring_on,gspmd --deadline-s 240 --out-dir "$out" ;;
    interleave)  # parallel.interleave=2 (off_il2, on_il2) beside the plain step and GSPMD
      timeout 280 python3 benchmarks/bench_train.py --label nvlink_il2 --layouts 1,1,4 \
        --variants off,off_il2,on,on_il2,gspmd --deadline-s 250 --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 260 python3 benchmarks/bench_train.py --label nop2p_il2 \
        --layouts 1,1,4 --variants off,off_il2,on,on_il2 --deadline-s 220 --out-dir "$out" ;;
    xla_kernels)  # the codec as jnp reference (XLA may fuse it into its neighbours)
      timeout 200 python3 benchmarks/bench_train.py --label nvlink_xla --layouts 1,1,4 \
        --variants off,on --implementation xla --deadline-s 180 --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 220 python3 benchmarks/bench_train.py --label nop2p_xla \
        --layouts 1,1,4 --variants off,on --implementation xla --deadline-s 200 \
        --out-dir "$out" ;;
    pgle)  # *_pgle: compiled again with measured instruction times (taco_jax.train.pgle)
      timeout 300 python3 benchmarks/bench_train.py --label nvlink_pgle --layouts 1,1,4 \
        --variants off,on,off_pgle,on_pgle,gspmd --steps 30 --dump-hlo off_pgle,on_pgle \
        --deadline-s 270 --out-dir "$out"
      timeout 200 python3 benchmarks/bench_train.py --label nvlink_il2_pgle --layouts 1,1,4 \
        --variants off,off_il2_pgle,on_il2_pgle --steps 30 --deadline-s 180 --out-dir "$out" ;;
    save)  # remat keeping the TP outputs (_save), its ideal, and GSPMD in the same run
      timeout 300 python3 benchmarks/bench_train.py --label nvlink_save_gspmd \
        --layouts "1,1,4;1,2,2" --variants off_save,on_save,ideal_save,gspmd --deadline-s 280 \
        --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 240 python3 benchmarks/bench_train.py --label nop2p_save \
        --layouts 1,1,4 --variants off_save,on_save --deadline-s 220 --out-dir "$out" ;;
    save_2.7b)  # the 2.7B GPT with _save beside GSPMD and its ideal, NVLink
      timeout 330 python3 benchmarks/bench_train.py --label nvlink_save_2.7b --model 2.7b \
        --layouts 1,1,4 --variants off_save,on_save,ideal_save,gspmd --deadline-s 310 \
        --out-dir "$out" ;;
    save_dp2)  # DP=2 x TP=2: GSPMD's own layout for the 4 GPUs of the TP=2 x PP=2 rows
      timeout 220 python3 benchmarks/bench_train.py --label nvlink_save_dp2 --layouts 2,1,2 \
        --variants off_save,on_save,ideal_save,gspmd --deadline-s 200 --out-dir "$out" ;;
    save_il2)  # with the recomputation silent, may the interleaved chains pay now?
      timeout 260 python3 benchmarks/bench_train.py --label nvlink_save_il2 --layouts 1,1,4 \
        --variants off_save,off_il2_save,on_save,on_il2_save --deadline-s 240 --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 240 python3 benchmarks/bench_train.py --label nop2p_save_il2 \
        --layouts 1,1,4 --variants off_save,off_il2_save,on_save,on_il2_save --deadline-s 220 \
        --out-dir "$out" ;;
    transport)  # bare all-gather / all-to-all of wire bytes as u8, bf16, u32; NCCL settings
      timeout 500 python3 benchmarks/bench_transport.py --label nvlink --out-dir "$out" ;;
    fused_decode)  # one GPU: can XLA fold the wire decode into the consuming matmul?
      timeout 230 python3 benchmarks/probe_fused_decode.py --label probe --out-dir "$out" ;;
    pp2)  # TP=2 x PP=2, NVLink: is the compressed step ever slower?
      timeout 170 python3 benchmarks/bench_train.py --label nvlink_pp2 --layouts 1,2,2 \
        --variants off,on --steps 30 --deadline-s 150 --out-dir "$out" ;;
    baseline)  # issue 19 on 2xH200, TP=2: the bf16 step with cuDNN flash attention keeping
      # the TP outputs, + the matmul outputs (scanned, unrolled), or no remat; free TP comm
      # for the first two; GSPMD
      timeout 540 python3 benchmarks/bench_train.py --label nvlink_baseline --layouts 1,1,2 \
        --attention cudnn --variants \
        off_save,off_save_dots,off_save_dots_unroll,off_noremat,ideal_save,ideal_save_dots,gspmd \
        --deadline-s 470 --out-dir "$out" ;;
    baseline_dp2)  # ... DP=2, TP=1: recompute all, keep the matmul outputs (scanned,
      # unrolled: gpt_1_3b's setting), no remat
      timeout 360 python3 benchmarks/bench_train.py --label nvlink_baseline_dp2 --layouts 2,1,1 \
        --attention cudnn --variants off,off_dots,off_dots_unroll,off_noremat --deadline-s 300 \
        --out-dir "$out" ;;
    e2e_8gpu)  # (1,1,8) and (dp,pp,tp) = (2,2,2), NVLink, same script and format as 4 GPUs
      timeout 540 python3 benchmarks/bench_train.py --label nvlink_8gpu --layouts "1,1,8;2,2,2" \
        --variants off,on,ideal,gspmd --deadline-s 500 --out-dir "$out" ;;
    e2e_2.7b)  # the 2.7B GPT (32 x 2560) at TP=4, NVLink and P2P off
      timeout 250 python3 benchmarks/bench_train.py --label nvlink_2.7b --model 2.7b \
        --layouts 1,1,4 --variants off,on,gspmd --deadline-s 225 --out-dir "$out"
      NCCL_P2P_DISABLE=1 timeout 230 python3 benchmarks/bench_train.py --label nop2p_2.7b \
        --model 2.7b --layouts 1,1,4 --variants off,on --deadline-s 205 --out-dir "$out" ;;
    accuracy) timeout 570 python3 benchmarks/bench_accuracy.py --label nvlink \
                --deadline-s 540 --out-dir "$out" ;;
    accuracy_cm)  # issue 15 on 2xH200 (TP=2): the compressed kernels' loss curves against
      # the compressed collectives' (every TP message in FP8 on both paths: the same codes)
      timeout 570 python3 benchmarks/bench_accuracy.py --label nvlink_cm --tp 2 \
        --variants off,on_all,on_all_cm --deadline-s 540 --out-dir "$out" ;;
    accuracy_cm_evals)  # issue 15, TP=2: accuracy_cm's kernel run ended on a NaN
      # validation loss (2026-11-26, the last of 8 evaluations; its training curve finite):
      # both paths evaluated every 4 steps for 500, to see how often and where (~4 min)
      timeout 330 python3 benchmarks/bench_accuracy.py --label "${LABEL:-nvlink_cm_evals}" \
        --tp 2 --variants on_all,on_all_cm --steps 500 --eval-every 4 --deadline-s 320 \
        --out-dir "$out" ;;
    probe_evals)  # issue 15, 2 GPUs: the kernels' NaN evaluations, one compiled evaluation
      # asked ten ways: queued right behind the training step (all at once, or one at a time),
      # after it (the trainer's order, with its batches kept or their copies waited for, back
      # to back, again, one by one, through XLA's collectives), and queued behind matmuls
      # without kernels; 50 evaluations, 25 of each behind the step; LABEL names the results;
      # STEP_CHECK=N first compares N training steps fed three ways, twice each; GRAPHS
      # fusions | none | all: the kernel layers' CUDA graphs (default: the probe's, the trainer's)
      BENCH_WATCHDOG_S=410 timeout 420 python3 -m benchmarks.probe_kernel_evals \
        --label "${LABEL:-nvlink}" \
        --steps "${STEPS:-200}" --step-check "${STEP_CHECK:-0}" ${GRAPHS:+--graphs "$GRAPHS"} \
        ${WAYS:+--ways "$WAYS"} --deadline-s "${DEADLINE:-360}" --out-dir "$out" ;;
    accuracy_dp2)  # issue 18 on 2xH200: the accuracy benchmark at DP=2, optimizer sharded,
      # off and with both DP directions in FP8 (configs/gpt_125m_dp2_zero.py), seed $SEED
      timeout 570 python3 benchmarks/bench_accuracy.py --config configs/gpt_125m_dp2_zero.py \
        --label "nvlink_dp2_zero_seed${SEED:-0}" --seed "${SEED:-0}" --variants off,on \
        --deadline-s 540 --out-dir "$out" ;;
    accuracy_seed*)  # e.g. accuracy_seed2: off and on (the default codec) from seed 2
      seed=${job#accuracy_seed}
      timeout 280 python3 benchmarks/bench_accuracy.py --label "nvlink_seed$seed" \
        --seed "$seed" --variants off,on --deadline-s 260 --out-dir "$out" ;;
    *) echo "unknown job $job" >&2 ;;
  esac 2>&1 | grep -v -E "DeprecationWarning|warnings.warn" | tee -a "$out/suite.log"
done
ls "$out"
