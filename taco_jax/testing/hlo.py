"""Which collectives a compiled step runs, over which mesh axes, moving which dtype.

Parses `jax.jit(f).lower(...).compile().as_text()`. Replica groups print either as
`mesh['data'=2,'pipeline'=2,'tensor'=2] {'tensor'}` or as explicit/iota device groups;
collective-permutes list source-target pairs. Device ids are positions in `mesh.devices`
(flattened), which map back to mesh coordinates, hence to the axes a collective spans.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Anchored at the instruction's start (`[ROOT] %name = type op(`): a search from every "="
# would also read the text of attributes, and a Mosaic GPU kernel's custom call carries its
# whole module as one string attribute, which an unanchored lazy match scans quadratically
# (minutes per step at TP=4).
_HEAD = r"\s*(?:ROOT\s+)?(?P<name>\S+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"  # [ROOT] %x = type
_OP = re.compile(_HEAD + r"(?P<kind>" + "|".join(_KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_MESH_AXES = re.compile(r"replica_groups=mesh\[[^\]]*\]\s*\{(?P<axes>[^}]*)\}")
_GROUPS = re.compile(r"replica_groups=\{(?P<g>(?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<src>[\d,]+)\]"
                   r"(?:T\((?P<perm>[\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<p>(?:\{\d+,\d+\},?)*)\}")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
FP8_WIRE = ("u8", "s8", "f8e4m3fn", "f8e5m2")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str                  # all-gather | all-reduce | reduce-scatter | all-to-all | ...
  dtype: str                 # HLO element type of the result array
  shape: tuple               # its dimensions
  elements: int              # elements of the result array
  bytes: int                 # bytes of the result array
  axes: frozenset            # mesh axes the participating groups span
  line: str                  # the HLO instruction, for messages

  @property
  def fp8(self) -> bool:
    return self.dtype in FP8_WIRE


def _axes_of_groups(groups, mesh_shape, names) -> frozenset:
  axes = set()
  for g in groups:
    coords = np.array([np.unravel_index(i, mesh_shape) for i in g])
    axes |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
  return frozenset(axes)


def _groups(line: str, n: int):
  if m := _GROUPS.search(line):
    return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m["g"])]
  if m := _IOTA.search(line):
    shape = [int(v) for v in m["shape"].split(",")]
    src = [int(v) for v in m["src"].split(",")]
    ids = np.arange(math.prod(src)).reshape(src)
    if m["perm"]:
      ids = ids.transpose([int(v) for v in m["perm"].split(",")])
    return ids.reshape(shape).tolist()
  if m := _PAIRS.search(line):
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m["p"])]
  return [list(range(n))]


def collectives(hlo_text: str, mesh=None) -> list[Collective]:
  """Every message of every collective instruction of `hlo_text` (async pairs counted once,
  at -start; a combined collective with a tuple result gives one entry per array). Without
  a mesh, `axes` is left empty."""
  names, shape = (tuple(mesh.axis_names), tuple(mesh.devices.shape)) if mesh else ((), ())
  out = []
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    arrays = [(a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))
              for a in _ARRAY.finditer(m["type"])]
    arrays = [a for a in arrays if a[0] in _BYTES and a[1]]
    if m["start"] and m["kind"] in ("all-gather", "collective-permute"):
      arrays = arrays[len(arrays) // 2:]  # async start: (operands..., results...)
    if not arrays:
      continue
    if mesh is None:
      axes = frozenset()
    elif am := _MESH_AXES.search(line):
      axes = frozenset(re.findall(r"'([^']+)'", am["axes"]))
    else:
      axes = _axes_of_groups(_groups(line, math.prod(shape)), shape, names)
    for dtype, dims in arrays:  # a combined (tuple) collective: one message per array
      n = math.prod(dims)
      out.append(Collective(m["kind"], dtype, dims, n, n * _BYTES[dtype], axes, line.strip()))
  return out


_INSTR = re.compile(_HEAD + r"(?P<op>[a-z][\w\-]*)\(")
_OPEN, _CLOSE = "([{", ")]}"


def _operands(text: str) -> list[str]:
  """The operand names of an instruction whose operand list starts ``text`` (just after its
  opening parenthesis), up to the matching one: each operand's last word, its type
  (``bf16[4,8]{1,0}``, a tuple ``(f32[], s32[])``) skipped, commas inside it too."""
  names, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in _OPEN:
      depth += 1
    elif ch in _CLOSE:
      if depth == 0:
        return names + [text[start:i].split()[-1]] if text[start:i].strip() else names
      depth -= 1
    elif ch == "," and depth == 0:
      names.append(text[start:i].split()[-1])
      start = i + 1
  return names


def kernel_scratch_inputs(hlo_text: str, target: str = "mosaic_gpu_v2") -> list[dict]:
  """Per custom call to ``target`` (a Mosaic GPU kernel) in a compiled module: its last
  operand, which is the kernel's zeroed global scratch (its semaphores; jax passes it last
  and aliases it to an output), the opcode of the instruction that makes that operand,
  and the opcodes of the instructions that read it. A scratch made by a constant, or read
  by two kernels, would reach a kernel not zeroed."""
  producer, readers, kernels = {}, {}, []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    args = _operands(line[m.end():])
    producer[m["name"]] = m["op"]
    for a in args:
      readers.setdefault(a, []).append(m["op"])
    if m["op"] == "custom-call" and f'custom_call_target="{target}"' in line and args:
      kernels.append((m["name"], args[-1]))
  return [dict(kernel=k, scratch=s, producer=producer.get(s),
               reader_ops=sorted(readers.get(s, []))) for k, s in kernels]
