"""Which codec the sharded optimizer's data-parallel traffic (or, --families pp, the
pipeline hand-offs) should use, measured (#18, #17).

SDP4Bit, the data-parallel scheme TACO pairs with, sends gradients in 8 bits and weight
differences in 4. Before choosing a bit width or group layout for `compression.dp` (the
gradient reduce-scatter) and `compression.dp_params` (the weight-difference all-gather),
this measures our FP8 codec's grid and a simulated 4-bit quantizer on a trained model's
tensors:

1. Train `configs/<--config>.py` on the embedded corpus (one CPU device) into --workdir,
   unless it holds a checkpoint already (then that run is used as it is).
2. Capture (`calibrate.capture`) --steps steps from that checkpoint, parameters and Adam
   moments, on --mesh with `parallel.shard_optimizer` and both codecs on (the config's,
   e4m3 G=128 unless overridden): what each rank sends to the gradient reduce-scatter (site
   "dp/scatter": its whole gradient, packed) and to the parameter all-gather ("dp_params":
   delta = master - its chunk of the parameters every rank holds; the master starts as the
   parameters, so the first delta is the step's update, and each later one also carries
   what the codec rounded off the step before: error feedback).
3. Measure (`calibrate.measure_all`) each site for the FP8 grid (format x G 32..256 x
   Hadamard) and for `roundtrip4`: INT4 (symmetric, levels -7..7) or FP4 E2M1 per group,
   one fp32 absmax scale per group, G 32/64/128, Hadamard on/off; simulated in plain jnp
   (no kernel); wire 4 + 32 / G bits per element.
4. Error feedback (dp_params): the per-step updates are recovered from the deltas (`updates`)
   and replayed through every quantizer with and without feedback (`feedback`): how far
   the parameters every rank holds are from the master, relative to one step's update.
5. Choose (`calibrate.choose`, its rule) per family among the FP8 settings.

    python -m benchmarks.measure_dp_codec [--config tiny] [--train-steps 400] [--steps 8]

`--families pp` measures the pipeline hand-offs instead (#17; default mesh 1,4,1, as many
micro-batches as stages, `compression.pp` on, the data-parallel codecs off): the same run
(one workdir per config, whatever the families), steps 2-3 on the sites "pp/fwd" (the
activations each stage sends on) and "pp/bwd" (their gradients, sent back), each reported
on its own (`site_table`), plus the groups run along the token axis instead of the hidden
one (`token_settings`, `roundtrip_tokens`: TAH-Quant-style tiles the other way round).

Writes benchmarks/results/measure_dp_codec_<label>_<n>cpu_<date>.json (label: the config,
"_pp" appended for --families pp; --smoke: micro model, a few steps, a temporary directory).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.args import add_output_args, parse_with_smoke, results_path
from pallas_kernels.common import hadamard_matrix
from taco_jax import collectives
from taco_jax.apps import calibrate
from taco_jax.plan import SITES, plan_from_config

FAMILIES = ("dp", "dp_params")  # the default --families
MEASURABLE = FAMILIES + ("pp",)


def grid4(formats=("int4", "fp4"), group_sizes=(32, 64, 128), hadamard=(False, True)):
  """The simulated 4-bit settings to measure."""
  return [dict(format=f, group_size=g, hadamard=h)
          for f, g, h in itertools.product(formats, group_sizes, hadamard)]


def bits4(setting: dict, width: int) -> float:
  """Wire bits per element of a 4-bit setting: 4-bit codes of `width` padded to whole
  groups plus one fp32 scale per group."""
  g = setting["group_size"]
  return -(-width // g) * (4 * g + 32) / width


def _fp4(v):
  """Rounds v (|v| <= 6) to the nearest FP4 E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to
  even, as jnp.round): the spacing is 0.5 below 2, 1 below 4 and 2 above."""
  a = jnp.abs(v)
  step = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0))
  return jnp.sign(v) * jnp.minimum(jnp.round(a / step) * step, 6.0)


def roundtrip4(x, setting: dict):
  """What a receiver would decode of x [..., width] quantized to 4 bits per `setting`
  (`grid4`), fp32: per group of G along the last axis (zero-padded to whole groups),
  optionally Walsh-Hadamard transformed (H_G / sqrt(G), orthogonal), scaled by its absmax
  onto the format's largest value (7 for INT4, 6 for FP4), rounded, scaled back."""
  g, top = setting["group_size"], {"int4": 7.0, "fp4": 6.0}[setting["format"]]
  *lead, width = x.shape
  pad = -(-width // g) * g - width
  y = jnp.pad(x.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, pad)])
  y = y.reshape(*lead, -1, g)
  h = jnp.asarray(hadamard_matrix(g)) / np.sqrt(g)
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  if setting["hadamard"]:
    y = dot(y, h)
  s = jnp.max(jnp.abs(y), -1, keepdims=True) / top
  u = y / jnp.where(s > 0, s, 1.0)
  q = (jnp.clip(jnp.round(u), -7, 7) if setting["format"] == "int4" else _fp4(u)) * s
  if setting["hadamard"]:
    q = dot(q, h)  # H is symmetric
  return q.reshape(*lead, -1)[..., :width]


# --- pipeline hand-offs: groups along the token axis ---------------------------------------


def token_settings(settings: list[dict], tokens: int) -> list[dict]:
  """`settings` (FP8, `calibrate.grid`'s) with groups along the token axis of messages of
  `tokens` tokens: each gets axis="tokens" and tokens=`tokens` (for `roundtrip_tokens`)."""
  return [dict(s, axis="tokens", tokens=tokens) for s in settings]


def _codec_setting(setting: dict) -> dict:
  return {k: setting[k] for k in calibrate.SETTING_FIELDS}


def roundtrip_tokens(x, setting: dict):
  """x [rows, hidden] (whole messages of `setting["tokens"]` tokens each, in order) as the
  FP8 codec with `setting` delivers it when its groups run along the token axis: each
  message's [tokens, hidden] transposed, sent through the codec (groups of G consecutive
  tokens of one hidden unit), transposed back; fp32."""
  t = setting["tokens"]
  rows, width = x.shape
  if rows % t:
    raise ValueError(f"{rows} rows are not whole messages of {t} tokens")
  y = jnp.swapaxes(x.reshape(rows // t, t, width), 1, 2).reshape(-1, t)
  y = calibrate.codec_roundtrip(y, _codec_setting(setting))
  return jnp.swapaxes(y.reshape(rows // t, width, t), 1, 2).reshape(rows, width)


def bits_tokens(setting: dict, width: int) -> float:
  """Wire bits per element with groups along the token axis: the codec's on rows of
  `setting["tokens"]` elements (the hidden width does not matter)."""
  del width
  return calibrate.bits_per_element(_codec_setting(setting), setting["tokens"])


def whole_messages(cap, sites, max_rows: int = 1 << 16):
  """A `monitor.Capture` of `cap`'s messages at `sites`, at most `max_rows` rows per site:
  evenly spaced whole messages (so that tokens stay in order for `roundtrip_tokens`)."""
  from taco_jax import monitor
  out = monitor.Capture(cap.rows_per_call)
  for site in sites:
    msgs = cap.tensors[site]
    keep = max(1, min(len(msgs), max_rows // msgs[0].shape[0]))
    out.tensors[site] = [msgs[i] for i in np.linspace(0, len(msgs) - 1, keep).astype(int)]
    out.shapes[site] = set(cap.shapes[site])
  return out


def tokens_of(cap, site) -> int:
  """The token count of `site`'s messages ([..., tokens, hidden], one shape, sent whole)."""
  shapes = cap.shapes[site]
  if len(shapes) != 1:
    raise ValueError(f"{site}: messages of several shapes {sorted(shapes)}")
  (shape,) = shapes
  if int(np.prod(shape[:-1])) != cap.tensors[site][0].shape[0]:
    raise ValueError(f"{site}: messages were captured in part (raise rows_per_call)")
  return int(shape[-2])


# --- weight differences: ranks, updates, error feedback --------------------------------------


def by_rank(messages: list, dp: int) -> tuple:
  """The dp_params messages as captured (each step's dp messages, one per rank, in no fixed
  order) -> ([steps, dp, rows, width], the lowest correlation of a message with its rank's
  message the step before, the highest with another rank's). A rank's consecutive updates
  are strongly correlated (Adam's momentum), other ranks' chunks are other parameters."""
  steps = len(messages) // dp
  if steps * dp != len(messages) or steps < 2:
    raise ValueError(f"{len(messages)} dp_params messages are not >= 2 steps of {dp} ranks")
  seq = [list(messages[:dp])]
  same, other = 1.0, -1.0
  for t in range(1, steps):
    now = messages[t * dp:(t + 1) * dp]
    c = np.corrcoef([m.ravel() for m in seq[-1] + list(now)])[:dp, dp:]  # [before, now]
    pick = c.argmax(1)  # rank i's message now
    mask = np.zeros((dp, dp), bool)
    mask[np.arange(dp), pick] = True
    if sorted(pick) != list(range(dp)) or c[mask].min() <= c[~mask].max():
      raise ValueError(f"step {t}: the dp_params messages do not pair up with the step "
                       "before's")
    same, other = min(same, c[mask].min()), max(other, c[~mask].max())
    seq.append([now[j] for j in pick])
  return np.stack([np.stack(s) for s in seq]), float(same), float(other)


def updates(deltas, codec):
  """The per-step updates of the master from the deltas the run sent ([steps, ...], from a
  master that started as the parameters): u_0 = delta_0, u_t = delta_t - r_{t-1}, where
  r = delta - codec(delta) is what the run's codec rounded off (its error feedback)."""
  d = jnp.asarray(deltas, jnp.float32)
  sent = collectives.roundtrip(d, codec)
  return d - jnp.concatenate([jnp.zeros_like(d[:1]), (d - sent)[:-1]])


@functools.partial(jax.jit, static_argnames=("roundtrip", "setting"))
def _replay(u, roundtrip, setting):
  q = lambda x: roundtrip(x, dict(setting))  # noqa: E731

  def step(carry, u_t):
    r, e = carry  # master - parameters, with / without feedback
    d = u_t + r
    e = e + u_t - q(u_t)
    r = d - q(d)
    norm = lambda v: jnp.sqrt(jnp.sum(jnp.square(v)))  # noqa: E731
    return (r, e), jnp.stack([norm(r), norm(e), norm(u_t)])

  zero = jnp.zeros_like(u[0])
  _, n = jax.lax.scan(step, (zero, zero), u)
  return n, jnp.sqrt(jnp.sum(jnp.square(jnp.sum(u, 0))))


def feedback(u, settings: list[dict], roundtrip) -> list[dict]:
  """Per setting: the updates u [steps, ...] applied through `roundtrip` with error
  feedback (what the rank sends is the master minus the parameters) and without it (it sends
  the update; the rounding errors add up): ||master - parameters|| after each step relative
  to that step's update, and after the last relative to the whole window's change."""
  out = []
  for s in settings:
    n, total = _replay(u, roundtrip, tuple(sorted(s.items())))
    n, total = np.asarray(n, np.float64), float(total)
    out.append(dict(s, with_feedback=(n[:, 0] / n[:, 2]).tolist(),
                    without_feedback=(n[:, 1] / n[:, 2]).tolist(),
                    last_over_window_with=n[-1, 0] / total,
                    last_over_window_without=n[-1, 1] / total))
  return out


# --- measure and choose -------------------------------------------------------------------


def family_table(results: dict, family: str) -> list[dict]:
  """Per setting, the means over the family's sites of rel_l2, share_off_by_8th,
  max_abs_over_absmax, `calibrate.score` and bits per element, best score first."""
  sites = [s for s in results if SITES[s] == family]
  if not sites:
    return []
  rows = []
  for i, r in enumerate(results[sites[0]]):
    mine = [results[s][i] for s in sites]
    mean = lambda k: float(np.mean([m[k] for m in mine]))  # noqa: E731
    rows.append({**{k: r[k] for k in calibrate.SETTING_FIELDS}, "rel_l2": mean("rel_l2"),
                 "share_off_by_8th": mean("share_off_by_8th"),
                 "max_abs_over_absmax": mean("max_abs_over_absmax"),
                 "score": float(np.mean([calibrate.score(m) for m in mine])),
                 "bits_per_element": mean("bits_per_element")})
  return sorted(rows, key=lambda r: (r["score"], r["bits_per_element"]))


def site_table(rows: list[dict]) -> list[dict]:
  """One site's measurements (`measure_all`'s list) with their `calibrate.score`, best
  score first (ties: fewer bits)."""
  out = [dict(r, score=calibrate.score(r)) for r in rows]
  return sorted(out, key=lambda r: (r["score"], r["bits_per_element"]))


def measure(cap, plan, dp: int, fp8=None, four=None, families=FAMILIES) -> dict:
  """Steps 3-5 of the module docstring on a capture of the step's sites of `families`
  (others captured are left out) at `dp` ranks, whose codecs `plan` (a CompressionPlan)
  has; `fp8`, `four`: the settings (default `calibrate.grid()`, `grid4()`). With "pp":
  its sites' whole messages (`whole_messages`), each site's tables (`sites`), and the
  FP8 settings with groups along the token axis (`results_tokens`)."""
  fp8 = calibrate.with_configured(fp8 or calibrate.grid(), plan, families)
  four = four or grid4()
  sites = sorted(s for s in cap.tensors if SITES[s] in families)
  if "pp" in families:
    cap = whole_messages(cap, sites)
  else:
    cap = _only(cap, sites)
  res8 = calibrate.measure_all(cap, fp8)
  res4 = calibrate.measure_all(cap, four, roundtrip=roundtrip4, bits=bits4)
  out = dict(results_fp8=res8, results_4bit=res4, choice=calibrate.choose(res8, plan),
             families={f: dict(fp8=family_table(res8, f), four_bit=family_table(res4, f))
                       for f in families})
  pp_sites = [s for s in sites if SITES[s] == "pp"]
  if pp_sites:
    res_t = {}
    for s in pp_sites:  # one measure per site: token counts may differ
      one = _only(cap, [s])
      res_t |= calibrate.measure_all(one, token_settings(fp8, tokens_of(one, s)),
                                     roundtrip=roundtrip_tokens, bits=bits_tokens)
    out["results_tokens"] = res_t
    out["sites"] = {s: dict(fp8=site_table(res8[s]), four_bit=site_table(res4[s]),
                            tokens=site_table(res_t[s])) for s in pp_sites}
  if "dp_params" in cap.tensors:
    seq, same, other = by_rank(cap.tensors["dp_params"], dp)
    u = updates(seq, plan.dp_params)
    out["feedback"] = dict(
        steps=int(seq.shape[0]), pairing=dict(lowest_same_rank=same, highest_other_rank=other),
        update_norm=[float(np.linalg.norm(x)) for x in np.asarray(u)],  # all ranks' chunks
        fp8=feedback(u, fp8, calibrate.codec_roundtrip),
        four_bit=feedback(u, four, roundtrip4))
  return out


def _only(cap, sites):
  """`cap` restricted to `sites` (a new Capture sharing the arrays)."""
  from taco_jax import monitor
  out = monitor.Capture(cap.rows_per_call)
  out.tensors = {s: cap.tensors[s] for s in sites}
  out.shapes = {s: cap.shapes[s] for s in sites}
  return out


# --- the run ------------------------------------------------------------------------------


def configs(args):
  """(the config trained, the config captured) for `args`."""
  from taco_jax.configs import tiny
  base = tiny.get_micro_config if args.smoke else importlib.import_module(
      f"taco_jax.configs.{args.config}").get_config
  train = base()
  train.train.update(steps=args.train_steps, progress_bar=False)
  cap = base()
  cap.train.update(steps=args.train_steps, progress_bar=False)
  dp, pp, tp = args.mesh
  sharded = bool({"dp", "dp_params"} & set(args.families))
  cap.parallel.update(dp=dp, pp=pp, tp=tp, shard_optimizer=sharded)
  if "pp" in args.families:
    cap.parallel.microbatches = max(cap.parallel.microbatches, pp)
  z = cap.compression  # the other families as the config has them (tp = pp = 1: unsent)
  z.enabled = True
  for fam in MEASURABLE:
    z[fam].enabled = fam in args.families
  return train, cap


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny", help="a module of configs/")
  p.add_argument("--train-steps", type=int, default=400, help="steps to train first")
  p.add_argument("--steps", type=int, default=8, help="steps to capture")
  p.add_argument("--families", type=lambda s: tuple(s.split(",")), default=FAMILIES,
                 help=f"the families to measure, of {','.join(MEASURABLE)}")
  p.add_argument("--mesh", type=lambda s: tuple(map(int, s.split(","))), default=None,
                 help="dp,pp,tp of the capture, on dp*pp*tp fake CPU devices (default "
                      "8,1,1; with --families pp 1,4,1)")
  p.add_argument("--workdir", default=None, help="the trained run (default: "
                 "workdir/measure_dp_codec_<config>); trained there if it has no checkpoint")
  add_output_args(p, label="", smoke="micro model, 8 training steps, 3 captured")
  args = parse_with_smoke(p, argv, dict(train_steps=8, steps=3))
  if bad := set(args.families) - set(MEASURABLE):
    p.error(f"--families: {sorted(bad)} not of {MEASURABLE}")
  pp_only = "pp" in args.families
  if pp_only and set(args.families) != {"pp"}:
    p.error("--families: pp is measured on its own (its mesh has no data axis)")
  args.mesh = args.mesh or ((1, 2, 1) if pp_only and args.smoke else
                            (1, 4, 1) if pp_only else (8, 1, 1))
  args.label = args.label or ("micro" if args.smoke else args.config) + ("_pp" if pp_only
                                                                         else "")
  return args


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  from taco_jax.train import checkpoint, cli, trainer
  cli.use_cpu_devices(int(np.prod(args.mesh)))
  clock = time.perf_counter()
  train_cfg, cap_cfg = configs(args)
  workdir = pathlib.Path(args.workdir or (
      tempfile.mkdtemp() if args.smoke else f"workdir/measure_dp_codec_{train_cfg.name}"))
  ckpt = checkpoint.Checkpoints(workdir)
  train_here = ckpt.latest_step() is None
  ckpt.close()
  if train_here:
    trainer.train(train_cfg, workdir)
  train_s = time.perf_counter() - clock
  d = cap_cfg.data  # pp: whole messages (a micro-batch's tokens, in order)
  cap = calibrate.capture(cap_cfg, args.steps, workdir, rows_per_call=max(
      1024, d.batch_size * d.seq_len) if "pp" in args.families else 1024)
  plan = plan_from_config(cap_cfg.compression)
  report = measure(cap, plan, args.mesh[0], families=args.families)
  if "feedback" in report:  # what one step's update is against the weights
    report["feedback"]["weight_norm"] = weight_norm(train_cfg, workdir)
  env = common.environment()
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  report = dict(
      benchmark="measure_dp_codec", date=env["date"], platform=env["platform"],
      num_devices=int(np.prod(args.mesh)), environment=env, args=vars(args) | dict(
          mesh=list(args.mesh)), workdir=str(workdir), trained_here=train_here,
      train_config=train_cfg.to_dict(), capture_config=cap_cfg.to_dict(),
      model=dict(cap_cfg.model.to_dict(), params=n_params(cap_cfg)),
      trained=dict(steps=max(m["step"] for m in metrics),
                   last=[m for m in metrics if "loss" in m][-1],
                   val=[m for m in metrics if "val_loss" in m][-1:]),
      captured=dict(steps=args.steps, rows={s: int(cap.rows(s).shape[0]) for s in cap.tensors},
                    shapes={s: sorted(map(list, v)) for s, v in cap.shapes.items()},
                    what=WHAT["pp" if "pp" in args.families else "dp"]),
      wall_s=dict(train=train_s, total=time.perf_counter() - clock), **report)
  return write(args, report)


WHAT = dict(  # what the captured messages are, per kind of run
    dp="dp/scatter: each rank's whole gradient (packed [dp * rows, 2048] fp32) as it enters "
       "the reduce-scatter; dp_params: each rank's delta = master - its chunk of the gathered "
       "parameters, with the run's codec's error feedback (master started as the parameters)",
    pp="pp/fwd: each stage's output activations [micro-batch, tokens, hidden] as they enter "
       "the shift to the next stage (every tick, GPipe); pp/bwd: their gradients as they "
       "enter the shift back; all-zero messages (the bubble's gradients) are skipped")


def weight_norm(config, workdir) -> float:
  """||parameters|| of the latest checkpoint in `workdir` (a run of `config`)."""
  from taco_jax.tp import layout, mesh as mesh_lib
  from taco_jax.train import checkpoint
  from taco_jax.train.config import parallel_spec
  cfg, mesh = parallel_spec(config).cfg, mesh_lib.make_mesh(1, 1, 1, jax.devices()[:1])
  ckpt = checkpoint.Checkpoints(workdir)
  params, _ = checkpoint.restore_state(ckpt, ckpt.latest_step(), cfg,
                                       layout.abstract_params(cfg, mesh))
  ckpt.close()
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(params))))


def n_params(config) -> int:
  """The number of parameters of `config`'s model."""
  from taco_jax.tp import layout
  from taco_jax.train.config import parallel_spec
  return sum(x.size for x in jax.tree.leaves(layout.param_shapes(parallel_spec(config).cfg)))


def summary(report: dict) -> str:
  """Per family: the best FP8 settings and the best 4-bit ones, and the choice."""
  cols = ["format", "group_size", "hadamard", "rel_l2", "share_off_by_8th", "score",
          "bits_per_element"]
  out = []
  for fam, t in report["families"].items():
    for kind in ("fp8", "four_bit"):
      out += [f"{fam} {kind} (best 6 by score)", common.table(t[kind][:6], cols, "{:.4g}")]
    if fam in report["choice"]:
      out.append(f"{fam} choice: {calibrate.describe(report['choice'][fam])}")
  cols_t = cols[:3] + ["axis"] + cols[3:]
  for site, t in report.get("sites", {}).items():
    for kind in ("fp8", "tokens", "four_bit"):
      out += [f"{site} {kind} (best 6 by score)",
              common.table([dict(r, axis=r.get("axis", "hidden")) for r in t[kind][:6]],
                           cols_t, "{:.4g}")]
  if "feedback" in report:
    fb = report["feedback"]
    w = fb.get("weight_norm") or float("nan")
    ratio = fb["update_norm"][-1] / w
    rows = [dict(format=r["format"], group_size=r["group_size"], hadamard=r["hadamard"],
                 with_feedback=r["with_feedback"][-1], without=r["without_feedback"][-1],
                 with_over_weights=r["with_feedback"][-1] * ratio,
                 without_over_weights=r["without_feedback"][-1] * ratio)
            for r in fb["fp8"] + fb["four_bit"] if not r["hadamard"]]
    out += [f"dp_params: ||master - parameters|| / ||that step's update|| after step "
            f"{fb['steps']} (one step's update / weights: {ratio:.3g})",
            common.table(rows, list(rows[0]), "{:.4g}")]
  return "\n".join(out)


def write(args, report: dict) -> pathlib.Path:
  path = results_path("measure_dp_codec", args, num_devices=report["num_devices"],
                      platform=report["platform"], date=report["date"])
  path.write_text(json.dumps(report, indent=1, default=common._jsonable))
  print(summary(report))
  print(f"wrote {path} ({report['wall_s']['total']:.0f} s)")
  return path


if __name__ == "__main__":
  main()
