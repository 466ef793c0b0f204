"""Shared defaults for every experiment config; each config file overrides what differs.

Override any field from the command line: `--config.optim.lr=1e-3 --config.data.path=...`.
"""
import ml_collections


def codec(**kw) -> ml_collections.ConfigDict:
  """A codec section (taco_jax.codec.CompressionConfig fields, at its defaults unless `kw`
  says otherwise) plus an on/off switch."""
  c = ml_collections.ConfigDict()
  c.enabled = True         # False: this collective family sends plain values
  c.format = 'e4m3'        # e4m3 (max 448) | e5m2 (max 57344)
  c.group_size = 128       # elements per scale group along the last (hidden) axis
  c.hadamard = False       # Walsh-Hadamard transform of each group before quantizing (off:
  #                          measured to cost accuracy; see taco_jax.codec.CompressionConfig)
  c.dual_scale = True      # RMS pre-scale before the transform
  c.min_bytes = 0          # smaller messages (per device) go uncompressed
  c.link = ml_collections.FieldReference('auto', field_type=str)  # compress only the sizes
  #                          measured to pay on this link: 'auto' (the trainer probes this
  #                          mesh, compression.link_probe; else on GPU 'p2p_disabled' if
  #                          NCCL_P2P_DISABLE=1 else 'nvlink'; none off GPU) | 'nvlink' |
  #                          'p2p_disabled' | None (every message from min_bytes on)
  c.update(kw)
  return c


def base_config(name: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = name                  # experiment name; default workdir is ./workdir/<name>
  c.seed = 0                     # seeds parameter init and the batch sampler

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 256             # 256 = byte tokenizer; raise it for pre-tokenized uint16 data
  m.n_layers = 4                 # transformer blocks
  m.d_model = 128                # residual width; must be divisible by n_heads
  m.n_heads = 4                  # attention heads
  m.d_ff = 512                   # MLP hidden width (4 * d_model for GPT-2)
  m.max_seq_len = 128            # position-table size; data.seq_len must not exceed it
  m.dtype = 'bfloat16'           # compute dtype: float32 | bfloat16 | float16 (params are fp32)
  m.ln_eps = 1e-5                # LayerNorm epsilon
  m.init_std = 0.02              # init std; out-projections use init_std / sqrt(2 n_layers)
  m.remat = False                # recompute blocks in the backward pass to save memory
  m.attention = 'auto'           # auto (cuDNN flash attention where it takes the shapes, else
  #                                XLA) | cudnn (an error where it cannot) | xla
  m.block = 'gpt'                # decoder block: 'gpt' (models.gpt) | 'qwen' (models.qwen)
  m.mlp_gelu = 'xla'             # GPT's MLP activation: xla | fused (in its GEMMs' epilogues,
  #                                Hopper GPUs: models.gelu_mlp; XLA's elsewhere); Qwen: ignored
  m.qkv_split = 'xla'            # GPT's q, k, v: xla (sliced from the QKV output) | fused (apart
  #                                from its GEMM's epilogue, Hopper GPUs: models.split_qkv; XLA's
  #                                elsewhere); Qwen: ignored

  c.data = d = ml_collections.ConfigDict()
  d.path = ''                    # '' = embedded corpus (this interpreter's stdlib *.py); or a
                                 # text file, a directory of text files, or a .npy/.bin token array
  d.include = '*'                # for a directory: the files (glob, recursive) to read, e.g. '*.py'
  d.bin_dtype = 'uint16'         # element type of a raw .bin token file: uint8 | uint16
  d.val_fraction = 0.05          # share of files (or of the tail of one file/array) held out
  d.max_corpus_bytes = 32_000_000  # cap on the embedded corpus size
  d.cache_dir = ''               # where the embedded corpus .npy is cached; '' = once per user
  #                                ($TACO_JAX_CACHE, else ~/.cache/taco_jax: data.default_cache_dir)
  d.seq_len = 128                # tokens per training sequence (the model sees seq_len inputs)
  d.batch_size = 32              # sequences per step

  c.optim = o = ml_collections.ConfigDict()
  o.lr = 3e-4                    # peak learning rate (AdamW)
  o.min_lr_ratio = 0.1           # cosine decays to lr * min_lr_ratio at train.steps
  o.warmup_steps = 100           # linear warmup from 0 to lr
  o.weight_decay = 0.1           # decoupled weight decay on matrices/embeddings (not biases/norms)
  o.b1 = 0.9                     # Adam beta1
  o.b2 = 0.95                    # Adam beta2
  o.eps = 1e-8                   # Adam epsilon
  o.grad_clip = 1.0              # global-norm gradient clipping; 0 disables it

  c.train = t = ml_collections.ConfigDict()
  t.steps = 1000                 # total optimizer steps (the LR schedule spans them)
  t.log_every = 10               # metrics are fetched, checked and written every N steps
  t.eval_every = 200             # validation every N steps (and at the end); 0 = only at the end
  t.eval_batches = 8             # validation batches per evaluation (a fixed set)
  t.checkpoint_every = 500       # checkpoint every N steps (and at the end); 0 = only at the end
  t.keep_checkpoints = 2         # how many recent checkpoints to keep
  t.peak_flops = 0.0             # per-device peak FLOP/s for MFU; 0 = the dense bf16 peak of the
  #                                device kind (known GPUs; no MFU on CPU or an unlisted device)
  t.progress_bar = True          # show a tqdm progress bar

  c.parallel = p = ml_collections.ConfigDict()
  p.dp = 1                       # data-parallel degree (mesh axis "data")
  p.pp = 1                       # pipeline-parallel degree (mesh axis "pipeline")
  p.tp = 1                       # tensor-parallel degree (mesh axis "tensor")
  p.microbatches = 1             # pipeline micro-batches per step (per data rank)
  p.distributed = False          # True: jax.distributed.initialize() first (multi-host)
  p.schedule = 'gpipe'           # pipeline schedule: 'gpipe' | '1f1b' (each stage keeps at most
  #                                2 (pp - 1) micro-batches' activations, not m) | 'interleaved'
  #                                (virtual_stages chunks per stage: a bubble v times smaller)
  p.virtual_stages = 1           # chunks of layers per stage ('interleaved' only, >= 2)
  p.tp_overlap = "none"           # how TP layers communicate: "none" (collectives between the
  #                                matmuls), "ring" (ring collective matmuls,
  #                                taco_jax.tp.overlap) or "kernel" (fused collective-
  #                                matmul kernels on Hopper GPUs, taco_jax.tp.fused)
  p.tp_exchange = False          # the attention's out-projection all-to-alls its input (1/tp
  #                                of the bytes) and all-gathers its weight, instead of
  #                                reduce-scattering its output (taco_jax.tp.layers.
  #                                exchange_matmul; plain; with tp_overlap='kernel' a
  #                                kernel of ours, its backward one matmul + exchange
  #                                kernel): 1.013x (TP=2) and 1.037x (TP=4) a 1.3B step
  #                                with the collectives; beside the kernel layers 1.018x at
  #                                TP=4 (before that backward kernel) and 1.005x at TP=2:
  #                                on with tp_overlap='kernel' on NVLink; 0.989x beside the
  #                                FP8 collectives with P2P off
  p.interleave = 1               # sub-batches per micro-batch whose blocks run side by side, so
  #                                one's TP collectives can overlap another's matmuls; 1 = off
  p.save_tp_outputs = False      # with model.remat: keep the TP collectives' outputs, so the
  #                                backward pass's recomputation does not communicate again
  p.save_dots = False            # with model.remat: keep the blocks' matmul outputs too, so the
  #                                backward recomputes only norms, activations and attention
  p.save_attention = False       # with model.remat: keep the attention's inputs and (cuDNN)
  #                                outputs too, so the backward does not run its forward again
  p.save_head = False            # keep the loss head's softmax [b, T, V / tp] (fp32) for the
  #                                backward pass, which then does not run the head's matmul again
  p.scan_layers = True           # run the layers as one lax.scan (fast to compile); False
  #                                unrolls them: no per-layer stacking of saved activations,
  #                                faster and with less memory on CPU and GPU (the one-GPU
  #                                model configs set it: 1.06x at 1.3B with save_dots, 1.48x
  #                                and half the peak at 125M), compiles about twice as long
  p.shard_optimizer = False      # ZeRO-1/2: Adam moments (and master weights) sharded over
  #                                "data"; gradients reduce-scattered, params all-gathered
  #                                (taco_jax.tp.zero); at dp=1 nothing is sharded or sent
  p.overlap_grad_reduce = False  # all-reduce each layer's gradients over "data" inside the
  #                                backward pass, while the earlier layers' backward runs
  #                                (Megatron's option of that name); needs pp=1,
  #                                microbatches=1, shard_optimizer=False. Off: after the
  #                                backward pass, leaf by leaf (XLA starts each as soon as
  #                                its gradient exists; compressed: one bucketed all-reduce)
  p.pgle = False                 # profile-guided scheduling (XLA's PGLE): steps 2-3 of the
  #                                run (after one warm-up step) run under the profiler, then
  #                                the step is compiled again with their measured instruction
  #                                times; the profile is cached in <workdir>/pgle for a resumed
  #                                run. GPU only (elsewhere it says so and changes nothing)
  p.xla_overlap = True           # compile the step with XLA's collective-overlap options, as
  #                                benchmarks/bench_train.py measured every step
  #                                (step.XLA_OVERLAP_OPTIONS: the latency-hiding scheduler,
  #                                pipelined collectives, the layer loop double-buffered);
  #                                False: XLA's defaults (no such scheduler)
  p.collectives_in_flight = 1    # > 1: the latency-hiding scheduler (on, whatever
  #                                xla_overlap says) may keep this many asynchronous
  #                                collectives in flight at once (XLA's default: 1)

  c.compression = z = ml_collections.ConfigDict()  # taco_jax.plan: one codec per family
  z.enabled = False              # one switch for the families below; a family whose mesh axis
  #                                has size 1 sends nothing either way
  z.tp_forward = codec()         # TP+SP all-gather / reduce-scatter of activations
  z.tp_backward = codec()        # their transposes (activation gradients)
  z.pp = codec(enabled=False)    # pipeline ppermute of activations, both directions
  # pp keeps the codec's defaults (e4m3, G=128 along the hidden axis, no Hadamard; 8.5 bits)
  # in both directions, measured on a trained model's hand-offs (benchmarks/measure_dp_codec.py
  # --families pp: benchmarks/results/measure_dp_codec_tiny_pp_4cpu_20261123.json): rel_l2
  # 0.026 (pp/fwd) / 0.026 (pp/bwd); e5m2 doubles it for the gradients too (0.048); groups
  # along the token axis are 11% / 4% lower at the same bytes (not built). One direction
  # differently: compression.sites.pp_bwd = codec(format='e5m2') (see taco_jax.plan).
  z.dp = codec(enabled=False)    # data-parallel gradients: all-reduce, or with
  #                                parallel.shard_optimizer reduce-scatter (off: fp32)
  z.dp_params = codec(enabled=False)  # shard_optimizer's parameter all-gather, as weight
  #                                differences (off: the fp32 parameters)
  # dp and dp_params keep the codec's defaults (e4m3, G=128, no Hadamard; 8.5 bits), measured
  # on a trained model's gradients and weight differences (benchmarks/measure_dp_codec.py:
  # benchmarks/results/measure_dp_codec_tiny_8cpu_20261123.json): calibrate's rule picks them
  # for both (rel_l2 0.025 / 0.026); G=32 is 6% lower for 18% more bytes; the transform puts
  # 13-17% / 11-13% of the elements off by > 1/8. A simulated 4-bit quantizer (int4 G=32, 5
  # bits) has 4.1x / 3.4x FP8's rel_l2, but on weight differences error feedback keeps the
  # parameters one step's rounding from the master (8.7% of one step's update): a candidate
  # for dp_params (SDP4Bit's choice) to try in training; the gradients have no feedback.
  z.sites = ml_collections.ConfigDict()  # sites.<site>: one collective's own codec section
  #                                (taco_jax.plan.SITES; written by taco_jax.apps.calibrate)
  z.log_errors = False           # log each family's round-trip error of what it sent (metrics)
  z.link_probe = True            # link='auto' codecs: at start-up on a GPU mesh, time each
  #                                message plain and compressed and compress where that was
  #                                faster (taco_jax.train.link_policy; cached in the workdir);
  #                                False, or off GPU: the measured tables (taco_jax/_measured.py)
  return c
