"""Where an instruction came from: jax's op_name and the model's source line, from its metadata.

An instruction's `metadata={...}` holds its op_name and either source_file/source_line
(older jax) or a stack_frame_id (jax >= 0.7) into the module's source tables (FileNames,
FunctionNames, FileLocations, StackFrames, written before the first computation). Walking
out from that innermost frame, the source shown is the first frame of shardax model code
outside the generic matmul/annotation wrappers (`_GENERIC`), so a dot reads as the layer
that made it; else the first frame outside site-packages (user code, not jax/flax/optax);
else the innermost. The printed parent_frame_id is the parent's id + 1 (1: none), seen on
libtpu 0.0.42.1 dumps and the CPU compiler of jax 0.10: parent - 1 walks attend -> logits
-> forward -> loss_and_metrics -> the train step.
"""

from __future__ import annotations

import re

from shardax.perf.hlo.module import Instruction, Module

_NUMBERS = re.compile(r"(\w+)=(\d+)")
# Frames that wrap every matmul or annotation: the source shown is the first frame outside them.
_GENERIC = ("layers/quantization.py", "layers/linear.py", "sharding/")


def short_path(path: str) -> str:
  """A source path relative to the shardax package, else the file's last two parts."""
  parts = path.split("/")
  if "shardax" in parts:
    return "/".join(parts[len(parts) - parts[::-1].index("shardax"):])
  return "/".join(parts[-2:])


def _table(prefix: str, name: str) -> dict[int, str]:
  """Rows `id value` of the source table `name` (a title line, then rows up to a blank line)."""
  rows, inside = {}, False
  for line in prefix.splitlines():
    if line == name:
      inside = True
    elif inside:
      if not line.strip() or line[:1].isupper() or line.startswith("%"):
        break
      row = line.split(None, 1)
      if len(row) == 2 and row[0].isdigit():
        rows[int(row[0])] = row[1].strip()
  return rows


def _model_code(path: str) -> bool:
  return "/shardax/" in path and "site-packages" not in path and not any(g in path for g in _GENERIC)


def stack_frames(mod: Module) -> dict[int, str]:
  """{stack frame id: 'file.py:line function'}: each frame's shown source (module docstring)."""
  files = {i: s.strip('"') for i, s in _table(mod.prefix, "FileNames").items()}
  funcs = {i: s.strip('"') for i, s in _table(mod.prefix, "FunctionNames").items()}
  locations = {i: dict(_NUMBERS.findall(s)) for i, s in _table(mod.prefix, "FileLocations").items()}
  frames = {}
  for i, s in _table(mod.prefix, "StackFrames").items():
    f = dict(_NUMBERS.findall(s))
    if loc := locations.get(int(f.get("file_location_id", 0))):
      path = files.get(int(loc.get("file_name_id", 0)), "?")
      where = f"{short_path(path)}:{loc.get('line', '?')} {funcs.get(int(loc.get('function_name_id', 0)), '')}"
      frames[i] = (path, where.strip(), int(f.get("parent_frame_id", 1)) - 1)
  out = {}
  for i in frames:
    chain, j = [], i
    while j in frames and len(chain) < 64:
      chain.append(frames[j])
      j = frames[j][2] if frames[j][2] != j else 0
    ours = [c for c in chain if _model_code(c[0])] or [c for c in chain if "site-packages" not in c[0]]
    out[i] = (ours or chain)[0][1]
  return out


class Sources:
  """(op_name, source line) of an instruction of `mod` (the frames read once, on first need)."""

  def __init__(self, mod: Module):
    self._mod = mod
    self._frames: dict[int, str] | None = None

  def __call__(self, inst: Instruction | None) -> tuple[str, str]:
    meta = inst.metadata if inst is not None else {}
    op_name = meta.get("op_name", "").replace("\\'", "'")
    if "source_file" in meta:
      return op_name, f"{short_path(meta['source_file'])}:{meta.get('source_line', '?')}"
    if "stack_frame_id" not in meta:
      return op_name, ""
    if self._frames is None:
      self._frames = stack_frames(self._mod)
    return op_name, self._frames.get(int(meta["stack_frame_id"]), "")
