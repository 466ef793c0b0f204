"""What XLA's scheduler runs beside each asynchronous collective of a training step.

For each of bench_train's variants (ours, not GSPMD) of one layout this compiles the step
as bench_train does (the same XLA flags and per-variant options) and reads its optimized,
scheduled HLO: for every asynchronous collective (``*-start`` ... ``*-done``, or
``async-start`` ... ``async-done`` around one), the work the schedule puts between its
start and its done, which the GPU may run while the collective moves its bytes: cuDNN's
attention, cuBLAS's and Triton's GEMMs, Mosaic GPU kernels (ours), XLA's other fusions,
and what XLA's CUDA graphs (``call``s of command-buffer computations) hold. Nothing runs:
the program is compiled only, from the state's shapes.

So one GPU can answer for a TP=2 program whether the scheduler overlaps a collective
with the work a layout offers it (``layers.EXCHANGE_PARTS``: one batch half's all-to-all
beside the other half's attention): with fewer GPUs than the layout, XLA's mock NCCL
stands in for the missing ones (``--mock``, jax's ``jax_mock_gpu_topology``). Where our
kernels cannot run in that process (the report's ``fallbacks``), XLA's collectives take
their place, as in the trainer.

GPU (one H200, TP=2): python benchmarks/probe_schedule.py --layouts 1,1,2 --attention cudnn \
    --variants off_xchg_save_unroll_xparts --mock 2 --out-dir $OUT
CPU smoke:            python benchmarks/probe_schedule.py --smoke   (no asynchronous collectives)

Writes probe_schedule_<label>_<devices>gpu_<date>.json (the program's devices, mock ones
included: ``local_devices`` says how many were real) and, with --out-dir, each variant's
scheduled HLO (hlo_<label>_<variant>.txt.gz).
"""
from __future__ import annotations

import collections
import os
import pathlib
import re
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never use NVLink multicast (SHARP)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import bench_train  # noqa: E402 (no JAX import)
from benchmarks.args import start_watchdog  # noqa: E402
from benchmarks.train_parallel import model_and_optimizer  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.+?) "
                          r"(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY )?%?(?P<name>[\w.\-]+) .*\{\s*$")
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter",
                "collective-permute", "ragged-all-to-all", "collective-broadcast")


def computations(hlo: str) -> tuple[dict[str, list[dict]], str | None]:
  """The module's computations, name -> its instructions in order (name, op, shape, rest of
  the line), and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    if current is None:
      if m := _COMPUTATION.match(line):
        current = comps.setdefault(m["name"], [])
        entry = m["name"] if m["entry"] else entry
      continue
    if line.strip() == "}":
      current = None
    elif m := _INSTRUCTION.match(line):
      current.append(m.groupdict())
  return comps, entry


def _attr(rest: str, key: str) -> str | None:
  m = re.search(rf'{key}=%?"?([\w.\-$]+)', rest)
  return m and m[1]


def work_labels(ins: dict, comps: dict) -> list[str]:
  """What one instruction runs on the GPU, as labels (none for bookkeeping ops): a called
  computation's work, prefixed 'graph:' where it is a command buffer (CUDA graph)."""
  op, rest = ins["op"], ins["rest"]
  if op == "custom-call":
    target = _attr(rest, "custom_call_target") or "?"
    if target.startswith("__cudnn$fmha") or "cudnn" in target.lower():
      return ["cudnn_backward" if "backward" in target.lower() else "cudnn"]
    if target.startswith("__cublas"):
      return ["cublas"]
    if target.startswith("mosaic_gpu"):
      kernel = re.search(r"(taco_[a-z0-9_]+?)(?:_\d+)?(?:_mosaic_gpu_kernel)?[\"/ ,]", rest)
      return [f"mosaic:{kernel[1]}" if kernel else "mosaic"]
    return [f"custom:{target}"]
  if op == "fusion":
    inner = [label for i in comps.get(_attr(rest, "calls"), ()) if i["op"] == "custom-call"
             for label in work_labels(i, comps)]  # e.g. a custom call on slices of its operands
    return inner or ["triton_gemm" if "gemm" in ins["name"] or "__triton_gemm" in rest
                     else "fusion"]
  if op in ("call", "while", "conditional"):
    called = [c for c in re.findall(r"(?:to_apply|body|branch_computations)=\{?%?([\w.\-]+)",
                                    rest) if c in comps]
    prefix = "graph:" if "command_buffer" in rest or any("command_buffer" in c
                                                         for c in called) else ""
    return [prefix + label for c in called for i in comps[c] for label in work_labels(i, comps)]
  return []


def _collective_kind(ins: dict, comps: dict) -> str | None:
  op = ins["op"]
  if op.endswith("-start") and op != "async-start":
    return op.removesuffix("-start")
  if op == "async-start":
    called = _attr(ins["rest"], "calls")
    ops = [i["op"] for i in comps.get(called, ())]
    return next((o for o in ops if o in _COLLECTIVES), None)
  return None


def overlaps(hlo: str) -> list[dict]:
  """Every asynchronous collective of the entry computation in schedule order: its kind,
  result shape, and the work labels (with counts) scheduled between its start and done."""
  comps, entry = computations(hlo)
  body = comps.get(entry, [])
  open_, out = {}, []
  for ins in body:
    if (kind := _collective_kind(ins, comps)) is not None:
      open_[ins["name"]] = dict(kind=kind, start=ins["name"], work=collections.Counter())
      continue
    if ins["op"].endswith("-done"):
      started = next((n for n in re.findall(r"%([\w.\-]+)", ins["rest"]) if n in open_), None)
      if started is not None:
        record = open_.pop(started)
        out.append(dict(record, shape=ins["shape"], work=dict(record["work"])))
        continue
    for label in work_labels(ins, comps):
      for record in open_.values():
        record["work"][label] += 1
  return out


def summary(collectives: list[dict]) -> dict:
  """Per collective kind: how many there are, how many have any work beside them, and
  the work beside them all."""
  kinds = collections.defaultdict(lambda: dict(count=0, with_work=0,
                                               work=collections.Counter()))
  for c in collectives:
    k = kinds[c["kind"]]
    k["count"] += 1
    k["with_work"] += bool(c["work"])
    k["work"].update(c["work"])
  return {kind: dict(v, work=dict(v["work"])) for kind, v in sorted(kinds.items())}


# the exchange program with its whole batch's exchange and in batch halves (--variants)
VARIANTS = "off_xchg_save_unroll,off_xchg_save_unroll_xparts"


def parse_args(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if not any(a.startswith("--variants") for a in argv):
    argv += ["--variants", VARIANTS]
  mock = 0
  if "--mock" in argv:  # ours, not bench_train's: taken out before its parser sees it
    i = argv.index("--mock")
    mock = int(argv[i + 1])
    del argv[i:i + 2]
  args = bench_train.parse_args(argv)
  if any(not v.ours for v in args._variants):
    raise SystemExit("probe_schedule: GSPMD's variants are compiled with their state; "
                     "ask for ours only")
  args.mock = mock
  return args


def main(argv=None):
  args = parse_args(argv)
  start_watchdog()
  if args.mock:  # the autotuner would share its work with the mock processes, which never answer
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        "--xla_gpu_shard_autotuning=false"]).strip()
  if args.smoke:
    from taco_jax.train.cli import use_cpu_devices
    use_cpu_devices(8)
  bench_train.add_overlap_flags(args)
  import jax
  if args.mock:  # before the backend starts
    jax.config.update("jax_mock_gpu_topology", f"1x{args.mock}x1")
  import numpy as np
  from benchmarks import common
  from benchmarks.args import write_results
  from taco_jax.tp import fused

  cfg, tx = model_and_optimizer(args, remat=not args.no_remat)
  layout = tuple(int(v) for v in args.layouts.split(";")[0].split(","))
  args._tokens0 = np.zeros((args.batch, args.seq + 1), np.int32)
  out_dir = pathlib.Path(args.out_dir) if args.out_dir else None
  report = dict(benchmark="probe_schedule", label=args.label,
                layout=args.layouts.split(";")[0], device=jax.devices()[0].device_kind,
                gpus=jax.device_count(), local_devices=jax.local_device_count(),
                mock_gpus=args.mock, xla_flags=os.environ.get("XLA_FLAGS", ""),
                config={k: v for k, v in vars(args).items() if not k.startswith("_")},
                variants={})
  for variant in args._variants:
    t0 = time.perf_counter()
    try:
      step, state, batch, _, _, ctx = bench_train._program(variant, layout, args, cfg, tx,
                                                           abstract=True)
      with ctx:
        lowered = step.lower(*state, batch(args._tokens0))
      exe = lowered.compile(bench_train.xla_options(variant, args))
    except Exception as e:  # noqa: BLE001 (reported, and the other variants compiled)
      report["variants"][variant.name] = dict(error=f"{type(e).__name__}: {e}"[:2000])
      print(variant.name, "failed:", report["variants"][variant.name]["error"][:500],
            flush=True)
    else:
      if out_dir is not None:
        common.write_hlo(exe, out_dir / f"hlo_{args.label}_{variant.name}.txt.gz")
      found = overlaps(exe.as_text())
      report["variants"][variant.name] = dict(
          compile_s=time.perf_counter() - t0, fallbacks=fused.fallbacks(),
          summary=summary(found), all_to_all=[c for c in found if c["kind"] == "all-to-all"])
      print(variant.name, report["variants"][variant.name]["summary"], flush=True)
    path = write_results("probe_schedule", args, report)  # after each variant: nothing lost
  print(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
