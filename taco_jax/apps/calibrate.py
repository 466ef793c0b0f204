"""Data-driven codec choice: `python -m taco_jax.apps.calibrate --config=<file> --workdir=<run>
--steps=N [--out=<py>]`.

1. Capture: run N training steps of the config (from the latest checkpoint of the trained
   run in --workdir, read only, its parameters and optimizer state; without it from init,
   which the run warns about: an untrained model's tensors are not the ones that matter)
   with a `monitor.Capture` watching: every message a compressed collective sends (forward
   activations and, in the backward pass, their gradients; the pipeline shift; the DP
   gradient buffer; with `parallel.shard_optimizer`, the weight differences gathered) is
   copied to the host per site (`taco_jax.plan.SITES`).
2. Measure: every codec setting of the grid (format x group size x Hadamard on/off) is
   applied to each site's tensors (encode -> u8 wire -> decode); per site: relative L2 error
   ||x_hat - x|| / ||x|| over all its tensors (rel_l2), max |x_hat - x|, that max / max |x|,
   and the share of non-zero elements off by more than 1/8 of themselves (share_off_by_8th).
   `dual_scale` is not in the grid: the pre-scale alpha multiplies a whole group before the
   (linear) transform and the post-scale is recomputed from the scaled group's absmax, so
   the codes are the same with or without it, except for groups so small (max |Hx| / sqrt(G)
   below ~448e-12) that the post-scale's lower clip binds: there alpha keeps precision
   (tiny gradients can be that small; kept as the config has it).
3. Choose, per family (and, for the report, per site): among the settings whose wire cost
   (8 + 64 / group_size bits per element, more where a group overhangs the message's last
   dimension and is padded; a family's: the mean over its sites) is at most that of the
   config's own setting, the one with the lowest score; a site's score is rel_l2 +
   share_off_by_8th (`score`: the share weighs how the error is spread, which rel_l2
   misses), a family's the mean over its sites (each site counts once, however many bytes
   it sends). Ties go to fewer bytes, then to the config's own setting, which is always a
   candidate, so the choice is never worse than the config on the captured data. The same
   rule on one site's scores and wire cost gives that collective's own choice.
4. Write a config file (default ./calibrated_<name>.py; `get_config()`: the base config,
   the command-line overrides given here, the chosen `compression.<family>` sections,
   `compression.sites.<site>` for each collective whose own choice differs from its
   family's, and `name` = the file's stem, so that it trains in its own workdir) that
   `python -m taco_jax.train --config=<out>` runs, and a JSON report beside it (every
   measurement, the choices). Every collective is compared against its family's codec;
   site overrides already in the config are replaced.

Families the config leaves uncompressed are not measured and stay uncompressed.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import pathlib
import pprint
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import collectives, monitor
from taco_jax.codec import CompressionConfig
from taco_jax.plan import FAMILIES, SITES, site_key

SETTING_FIELDS = ("format", "group_size", "hadamard")  # what the grid varies


def grid(formats=("e4m3", "e5m2"), group_sizes=(32, 64, 128, 256),
         hadamard=(True, False)) -> list[dict]:
  """The codec settings to measure, as dicts of `SETTING_FIELDS`."""
  return [dict(format=f, group_size=g, hadamard=h)
          for f, g, h in itertools.product(formats, group_sizes, hadamard)]


def with_configured(settings: list[dict], plan, families=FAMILIES) -> list[dict]:
  """A copy of `settings` plus the setting of each of `families` that `plan` compresses and
  `settings` lacks: the config's own choice is always a candidate."""
  out = list(settings)
  for fam in families:
    cfg = getattr(plan, fam)
    if cfg is not None and (s := {k: getattr(cfg, k) for k in SETTING_FIELDS}) not in out:
      out.append(s)
  return out


def bits_per_element(setting: dict, width: int) -> float:
  """Wire bits per element of `setting` on messages of last dimension `width` (padding to
  whole groups included)."""
  return CompressionConfig(**setting).wire_bits(width)


# --- 1. capture --------------------------------------------------------------------------


def capture_config(config):
  """The config whose steps `capture` runs: `config` itself, or where its TP collectives run
  inside the matmuls (``parallel.tp_overlap`` ring or kernel at tp > 1), which report no
  messages, a copy with XLA's collectives (``tp_overlap='none'``): they compress the same
  tensors. The written config keeps the user's ``tp_overlap``. Returns (config, what to say
  or None)."""
  p = config.parallel
  if p.tp_overlap == 'none' or p.tp == 1:
    return config, None
  config = config.copy_and_resolve_references()
  config.parallel.tp_overlap = 'none'
  return config, (f"note: parallel.tp_overlap={p.tp_overlap!r} sends its messages from inside "
                  "the matmuls, which report none: the capture runs XLA's collectives "
                  "(tp_overlap='none'), which compress the same tensors")


def capture(config, steps: int, workdir=None, rows_per_call: int = 1024,
            compiler_options=None) -> monitor.Capture:
  """Runs `steps` training steps of `config` (`capture_config`'s) and returns what each
  compressed site sent."""
  from taco_jax.tp import step as step_lib
  from taco_jax.train import trainer as ptrain
  from taco_jax.train import checkpoint
  from taco_jax.train.config import validate
  from taco_jax.train.trainer import load_data

  validate(config)
  config, note = capture_config(config)
  if note:
    print(note, file=sys.stderr)
  mesh, spec, tx, p_abs, o_abs = ptrain.run_parts(config)
  if not spec.plan.any:
    raise ValueError("compression is off in this config: there is nothing to calibrate")
  corpus = load_data(config)
  start = 0
  if workdir:
    ckpt = checkpoint.Checkpoints(workdir)
    start = ckpt.latest_step()
    if start is None:
      ckpt.close()
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory}: --workdir must be a "
                              "trained run of this config")
    params, opt_state = _restore(ckpt, start, spec, tx, p_abs, o_abs)
    ckpt.close()
  else:
    print("warning: no --workdir: capturing from an untrained model, whose tensors differ "
          "from a trained one's; pass the workdir of a finished run", file=sys.stderr)
    params, opt_state = ptrain.fresh_state(spec, mesh, tx, o_abs, config.seed)
  cap = monitor.Capture(rows_per_call)
  batch = ptrain.batches(config, corpus, mesh)
  step = jax.jit(step_lib.make_train_step(spec, mesh, tx, capture=cap)).lower(
      params, opt_state, batch(start)).compile(compiler_options=compiler_options)
  for i in range(start, start + steps):
    params, opt_state, _ = step(params, opt_state, batch(i))
  jax.block_until_ready(params)
  jax.effects_barrier()  # every callback has delivered its tensor
  return cap


def _restore(ckpt, step: int, spec, tx, p_abs, o_abs) -> tuple:
  """(params, optimizer state) of checkpoint `step`, laid out for `spec`'s step (targets
  `p_abs`, `o_abs`). The Adam moments are restored too, so the captured steps continue the
  trained run: fresh moments would make the first updates lr * sign(g), which is not what
  the sharded optimizer's weight differences are later on. A master that the step keeps
  (`zero.keeps_master`) and the checkpoint lacks starts as the parameters (as a new run's
  does); one the checkpoint has and the step does not keep is dropped."""
  from taco_jax.tp import zero
  from taco_jax.train import checkpoint
  from taco_jax.train.trainer import shardings
  keeps = zero.keeps_master(spec)
  stored = ckpt.stored_shapes(step, "opt_state")
  has = isinstance(stored, dict) and "master" in stored
  tx_abs = o_abs["tx"] if keeps else o_abs
  target = dict(master=o_abs["master"] if keeps else p_abs, tx=tx_abs) if has else tx_abs
  params, state = checkpoint.restore_state(ckpt, step, spec.cfg, p_abs, target, tx)
  if has:
    master, state = state["master"], state["tx"]
  else:
    master = params
  if keeps:
    master = jax.device_put(master, shardings(o_abs["master"]))
  return params, zero.opt_state(spec, state, master)


# --- 2. measure ---------------------------------------------------------------------------


def codec_roundtrip(x, setting: dict):
  """x as the FP8 codec with `setting` delivers it (encode -> u8 wire -> decode), fp32."""
  return collectives.roundtrip(x, CompressionConfig(**setting))


@functools.partial(jax.jit, static_argnames=("settings", "n_seg", "roundtrip"))
def _errors(x, seg, settings, n_seg, roundtrip=codec_roundtrip):
  """Per setting and segment: (sum err^2, sum x^2, max |err|, max |x|, number of non-zero
  elements off by more than 1/8 of themselves, number of non-zero elements), fp32."""
  xf = x.astype(jnp.float32)
  x2 = jax.ops.segment_sum(jnp.sum(xf * xf, -1), seg, n_seg)
  amax = jax.ops.segment_max(jnp.max(jnp.abs(xf), -1), seg, n_seg)
  nonzero = xf != 0
  n_nonzero = jax.ops.segment_sum(jnp.sum(nonzero, -1, dtype=jnp.float32), seg, n_seg)
  out = []
  for s in settings:
    err = roundtrip(x, dict(s)) - xf
    far = nonzero & (8 * jnp.abs(err) > jnp.abs(xf))
    out.append(jnp.stack([jax.ops.segment_sum(jnp.sum(err * err, -1), seg, n_seg), x2,
                          jax.ops.segment_max(jnp.max(jnp.abs(err), -1), seg, n_seg), amax,
                          jax.ops.segment_sum(jnp.sum(far, -1, dtype=jnp.float32), seg, n_seg),
                          n_nonzero]))
  return jnp.stack(out)  # [settings, 6, n_seg]


def measure_all(cap: monitor.Capture, settings: list[dict], max_rows: int = 1 << 16,
                roundtrip=codec_roundtrip, bits=bits_per_element) -> dict:
  """{site: [setting + errors, ...]} for every captured site: rel_l2 = ||x_hat - x|| / ||x||
  over all its captured rows (at most `max_rows`, evenly spaced), max_abs = max |x_hat - x|,
  max_abs_over_absmax = max_abs / max |x|, share_off_by_8th = the share of non-zero
  elements whose own relative error exceeds 1/8 (twice E4M3's rounding bound: elements the
  codec does not keep to FP8 precision, e.g. small ones after a Hadamard transform spread
  a large neighbour's error over them). Sites with the same last dimension are measured
  in one program. Another quantizer: `roundtrip(x, setting)` (jittable, x [rows, width] ->
  what the receiver gets, fp32; hashable) and `bits(setting, width)`, its wire bits per
  element."""
  frozen = tuple(tuple(sorted(s.items())) for s in settings)
  by_width: dict[int, list] = {}
  for site in sorted(cap.tensors):
    rows = cap.rows(site)
    if rows.shape[0] > max_rows:
      rows = rows[np.linspace(0, rows.shape[0] - 1, max_rows).astype(int)]
    by_width.setdefault(rows.shape[-1], []).append((site, rows))
  out = {}
  for width, group in by_width.items():
    x = np.concatenate([r for _, r in group])
    seg = np.concatenate([np.full(len(r), i) for i, (_, r) in enumerate(group)])
    e = np.asarray(_errors(jnp.asarray(x), jnp.asarray(seg), frozen, len(group), roundtrip),
                   np.float64)
    for i, (site, _) in enumerate(group):
      out[site] = [dict(s, rel_l2=float(np.sqrt(e[j, 0, i] / e[j, 1, i])),
                        max_abs=float(e[j, 2, i]),
                        max_abs_over_absmax=float(e[j, 2, i] / e[j, 3, i]),
                        share_off_by_8th=float(e[j, 4, i] / max(e[j, 5, i], 1.0)),
                        bits_per_element=bits(s, width))
                   for j, s in enumerate(settings)]
  return out


# --- 3. choose ---------------------------------------------------------------------------


def _key(setting: dict) -> tuple:
  return tuple(setting[k] for k in SETTING_FIELDS)


def _pick(scores: dict, bits: dict, base: dict) -> tuple:
  """The setting key with the lowest score among those no costlier (`bits`: key -> wire
  bits per element) than `base`."""
  ok = [k for k in scores if bits[k] <= bits[_key(base)]]
  return min(ok, key=lambda k: (scores[k], bits[k], k != _key(base)))


def score(r: dict) -> float:
  """What calibration minimizes for one site and setting: the relative L2 error plus the
  share of elements off by more than 1/8 of themselves. The share is there because rel_l2
  alone misses how the error is spread: on the trained 86M model the Hadamard transform
  left rel_l2 at 0.025 but put 14% of the elements beyond 1/8 (0.002% without it), and
  trained 3% worse; with the share added it scores 0.16 against 0.025."""
  return r["rel_l2"] + r["share_off_by_8th"]


def choose(results: dict, plan) -> dict:
  """{family: {"setting", "score", "error", "share", "base_setting", "base_score",
  "base_error", "sites": {site: ...}}} for each family of `plan` (a CompressionPlan) with
  measured sites: `score` is the mean over the family's sites of `score()`, `error` and
  `share` the means of its two parts; see the module docstring."""
  out = {}
  for fam in FAMILIES:
    cfg = getattr(plan, fam)
    sites = [s for s in results if SITES[s] == fam]
    if cfg is None or not sites:
      continue
    base = {k: getattr(cfg, k) for k in SETTING_FIELDS}
    rows = {s: {_key(r): r for r in results[s]} for s in sites}
    keys = set.intersection(*(set(v) for v in rows.values()))
    if _key(base) not in keys:
      raise ValueError(f"{fam}: the config's own setting {base} is not in the measured grid")
    mean = lambda f, k: float(np.mean([f(rows[s][k]) for s in sites]))  # noqa: E731
    family = {k: mean(score, k) for k in keys}
    family_bits = {k: mean(lambda r: r["bits_per_element"], k) for k in keys}
    best = _pick(family, family_bits, base)
    site_choice = {}
    for s in sites:
      scores = {k: score(r) for k, r in rows[s].items()}
      b = _pick(scores, {k: r["bits_per_element"] for k, r in rows[s].items()}, base)
      site_choice[s] = dict(setting=dict(zip(SETTING_FIELDS, b)), score=scores[b],
                            base_score=scores[_key(base)])
    out[fam] = dict(
        setting=dict(zip(SETTING_FIELDS, best)), score=family[best],
        error=mean(lambda r: r["rel_l2"], best), share=mean(lambda r: r["share_off_by_8th"], best),
        base_setting=base, base_score=family[_key(base)],
        base_error=mean(lambda r: r["rel_l2"], _key(base)), sites=site_choice)
  return out


# --- 4. write -------------------------------------------------------------------------------


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _section(cfg: CompressionConfig, setting: dict) -> dict:
  """A full codec section (dict): `cfg` with `setting`, the non-default fields spelled out."""
  default = CompressionConfig()
  cfg = dataclasses.replace(cfg, **setting)
  return dict(enabled=True, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                               if f.name in SETTING_FIELDS + ("dual_scale", "min_bytes")
                               or getattr(cfg, f.name) != getattr(default, f.name)})


def calibrated_sections(plan, choices: dict) -> dict:
  """{family: full codec section (dict)}: the config's codec with the chosen setting."""
  return {fam: _section(getattr(plan, fam), c["setting"]) for fam, c in choices.items()}


def site_sections(plan, choices: dict) -> dict:
  """{site_key: codec section} for each collective whose own best setting differs from
  its family's choice (`compression.sites`; the others follow their family)."""
  return {site_key(site): _section(plan.codec(site), c["setting"])
          for fam, choice in choices.items() for site, c in choice["sites"].items()
          if c["setting"] != choice["setting"]}


def config_source(config, sections: dict, base_module: str | None, header: str,
                  sites: dict | None = None, name: str | None = None) -> str:
  """Python source of a config file: `base_module`'s get_config() plus the fields where
  `config` differs from it, then the family `sections`, the per-collective `sites` and the
  config's new `name` (if given); a full literal of `config` if there is no importable
  base or it lacks some of config's fields."""
  lines = [f'"""{header}\n"""', "import ml_collections", ""]
  body = None
  if base_module:
    import importlib
    base = _flat(importlib.import_module(base_module).get_config().to_dict())
    mine = _flat(config.to_dict())
    if set(mine) == set(base):
      diff = {k: v for k, v in mine.items() if v != base[k]}
      lines.insert(2, f"from {base_module} import get_config as base_config")
      body = ["  c = base_config()"]
      if diff:
        body.append("  # overrides given at calibration time")
        body += ["  c.update_from_flattened_dict({"]
        body += [f"      {k!r}: {v!r}," for k, v in sorted(diff.items())] + ["  })"]
  if body is None:
    body = ["  c = ml_collections.ConfigDict(" + pprint.pformat(config.to_dict()) + ")"]
  if name is not None:
    body.append(f"  c.name = {name!r}  # trains in its own workdir, ./workdir/{name}")
  body.append("  # calibrated codec per collective family (taco_jax.apps.calibrate)")
  for fam, sec in sections.items():
    body.append(f"  c.compression.{fam} = ml_collections.ConfigDict({sec!r})")
  if sites or config.compression.sites:  # new ones, or none instead of the config's
    body.append("  # collectives whose own best setting differs from their family's")
    body.append(f"  c.compression.sites = ml_collections.ConfigDict({sites!r})")
  body.append("  return c")
  return "\n".join(lines + ["", "def get_config():"] + body) + "\n"


def base_module_of(config_path: str | None) -> str | None:
  """`taco_jax.configs.<name>` for a file configs/<name>.py of this package, else None."""
  from taco_jax import configs
  if not config_path or ":" in config_path:
    return None
  p = pathlib.Path(config_path).resolve()
  if (p.parent == pathlib.Path(configs.__file__).resolve().parent and p.suffix == ".py"
      and p.stem.isidentifier()):
    return f"taco_jax.configs.{p.stem}"
  return None


def calibrate(config, *, steps: int, out, settings: list[dict] | None = None,
              config_path: str | None = None, workdir=None, rows_per_call: int = 1024,
              report=None, compiler_options=None, cap: monitor.Capture | None = None) -> dict:
  """Steps 1-4 (module docstring); returns the report (also written to `report`, default
  <out>.json). `cap`: tensors already captured from this config (step 1 is skipped)."""
  from taco_jax.plan import plan_from_config
  plan = plan_from_config(config.compression)
  settings = with_configured(settings or grid(), plan)
  if cap is None:
    cap = capture(config, steps, workdir, rows_per_call, compiler_options)
  results = measure_all(cap, settings)
  choices = choose(results, plan)
  out = pathlib.Path(out)
  table = "\n".join(f"  {fam}: {describe(c)}" for fam, c in choices.items())
  source = f"the trained run {workdir}" if workdir else "an untrained model"
  header = textwrap.fill(
      f"{out.stem}: {config.name} calibrated by `python -m taco_jax.apps.calibrate` on {steps} "
      f"steps of {source} ({datetime.date.today()}); report: {out.with_suffix('.json').name}."
      " Chosen per family: the lowest mean score (rel_l2 + share of elements off by > 1/8)"
      " at <= the config's wire bytes:", 90) + f"\n{table}"
  out.parent.mkdir(parents=True, exist_ok=True)
  sites = site_sections(plan, choices)
  out.write_text(config_source(config, calibrated_sections(plan, choices),
                               base_module_of(config_path), header, sites, name=out.stem))
  rep = dict(config=config.name, config_path=config_path, workdir=workdir and str(workdir),
             steps=steps, out=str(out),
             rule="per family: min over settings with bits/element <= the config's of the "
                  "mean over the family's sites of rel_l2 + share_off_by_8th; ties: fewer "
                  "bits, then the config's",
             shapes={s: sorted(map(list, v)) for s, v in cap.shapes.items()},
             rows={s: int(cap.rows(s).shape[0]) for s in cap.tensors},
             choices=choices, site_overrides=sorted(sites), results=results)
  report = pathlib.Path(report) if report else out.with_suffix(".json")
  report.write_text(json.dumps(rep, indent=1))
  return rep


def describe(choice: dict) -> str:
  """One family's choice in a line: the setting, its score and parts, the config's score."""
  return (f"{choice['setting']} score {choice['score']:.4g} (rel_l2 {choice['error']:.4g} + "
          f"share off by > 1/8 {choice['share']:.3g}; config's {choice['base_setting']}: "
          f"{choice['base_score']:.4g})")


def main(argv=None):
  from absl import app, flags
  from ml_collections import config_flags

  from taco_jax.train.cli import parse_flags, rewrite_config_arg, show_in_help, use_cpu_devices
  config_flags.DEFINE_config_file("config", None, "Experiment config file (parallel layout).")
  flags.DEFINE_integer("steps", 4, "Training steps to capture tensors from.")
  flags.DEFINE_string("out", None, "Config file to write (and <out>.json, the report); its "
                      "stem is the new config's name. Default: ./calibrated_<name>.py.")
  flags.DEFINE_string("workdir", None, "A trained run of this config: capture from its latest "
                      "checkpoint (read only). Without it, from an untrained model.")
  flags.DEFINE_list("formats", ["e4m3", "e5m2"], "FP8 formats to measure.")
  flags.DEFINE_list("group_sizes", ["32", "64", "128", "256"], "Group sizes to measure.")
  flags.DEFINE_list("hadamard", ["true", "false"], "Hadamard settings to measure.")
  flags.DEFINE_integer("rows_per_call", 1024, "Rows kept of each captured message.")
  flags.DEFINE_integer("cpu_devices", 0, "Run on this many fake CPU devices; 0 = real ones.")
  show_in_help("config", "steps", "out", "workdir", "cpu_devices")
  F = flags.FLAGS

  def run(_):
    if F.cpu_devices:
      use_cpu_devices(F.cpu_devices)
    if F.config is None:
      raise app.UsageError("--config is required")
    out = F.out or f"calibrated_{F.config.name}.py"
    settings = grid(tuple(F.formats), tuple(int(g) for g in F.group_sizes),
                    tuple(h.lower() in ("1", "true", "on") for h in F.hadamard))
    try:
      rep = calibrate(F.config, steps=F.steps, out=out, settings=settings,
                      config_path=config_flags.get_config_filename(F["config"]),
                      workdir=F.workdir, rows_per_call=F.rows_per_call)
    except (ValueError, FileNotFoundError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    for fam, c in rep["choices"].items():
      print(f"{fam:12s} {describe(c)}")
    print(f"wrote {rep['out']}; train with: python -m taco_jax.train --config={rep['out']}")

  app.run(run, argv=rewrite_config_arg(argv or sys.argv), flags_parser=parse_flags)


if __name__ == "__main__":
  main()
