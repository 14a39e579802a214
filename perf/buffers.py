"""Where a compiled program's memory goes: its largest buffers, read from XLA's buffer assignment.

The compile is asked to dump its buffer assignment (`dump_options`: XLA's `xla_dump_to`
with text dumps); XLA writes it after scheduling, also when the TPU compiler then refuses
the program for exceeding HBM, so a dry run that does not fit still says why. From the dump:

  *after_optimizations-buffer-assignment.txt  every allocation (size, memory color, kind:
      parameter, output, preallocated-temp, ...) and the HLO values placed in it, each with
      its offset and size: the temporaries of one memory space share one preallocated-temp
      allocation, and values at one offset take turns in that block of memory;
  *after_optimizations.txt  the scheduled HLO: each instruction's metadata (op_name, and
      the stack frame that gives the model's source file and line).

`read(dump_dir)` groups each temp allocation's values by offset into blocks (a block's size
is its largest value), largest first: the heap the compiler laid out, whose size is the
temp figure of `memory_analysis()` (TPU: also the "HLO temporaries" of its out-of-memory
message). Each block is named by its largest value: shape, dtype, the instruction, op_name,
source line. Why blocks and not the values live at one instant: XLA's own "peak" in the
live-range dump (HloLiveRange) undercounts TPU programs (by how much on a small LM step:
docs/results/code_notes.md); the block layout is what the allocator actually reserved.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re

from shardax.perf import hlo as hlo_lib
from shardax.perf.hlo import sources as hlo_sources

# Memory colors of the TPU compiler's buffer assignment: 0 HBM, 1 vmem, 2 smem, and 5 the
# host memory that offloaded activations go to (jax's pinned_host; layout tag S(5)): its temp
# allocation is exactly memory_analysis().host_temp_size_in_bytes (17,301,504 B on
# tests/test_offload.py's step, libtpu 0.0.42.1; the compiler's own report calls color 5
# "cmem" and color 4 "host", which held only a few s32[2] there). Others: by number.
DEVICE, HOST = 0, 5
_SPACES = {0: "device", 1: "vmem", 2: "smem", 5: "host"}

_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(?:, color (\d+))?, (.*):$")
_VALUE = re.compile(r"^ value: <\d+ ([^{ >]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One block of a memory space's temp heap and the value that needs it most."""
  bytes: int
  space: str                 # "device" (HBM), "host" (offloaded), ...
  dtype: str                 # of the largest value in the block ("tuple" for a tuple buffer)
  shape: tuple[int, ...]     # per device
  instruction: str           # the HLO instruction that defines that value
  op_name: str               # jax's name for the op (metadata), "" if none
  source: str                # file:line function of the model code that made it, "" if none
  values: int                # how many HLO values take turns in this block


def dump_options(dump_dir: str) -> dict:
  """`compiler_options` for `lowered.compile(...)` that make XLA write the buffer assignment."""
  return {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}


def _module_files(dump_dir: str) -> tuple[str, str] | None:
  """(buffer assignment, scheduled HLO) of the largest module in the dump, or None."""
  found = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
  if not found:
    return None
  assignment = max(found, key=os.path.getsize)
  hlo = assignment.replace("-buffer-assignment.txt", ".txt")
  return assignment, hlo if os.path.exists(hlo) else ""


def _temp_values(text: str) -> dict[tuple[int, int], list[tuple[str, int, str]]]:
  """{(color, offset): [(instruction, size, shape text)]} over the preallocated-temp allocations."""
  blocks: dict[tuple[int, int], list[tuple[str, int, str]]] = {}
  color = None
  for line in text.splitlines():
    if m := _ALLOC.match(line):
      color = int(m.group(3) or 0) if "preallocated-temp" in m.group(4) else None
    elif color is not None and (v := _VALUE.match(line)):
      name, _, size, offset, shape = v.groups()
      blocks.setdefault((color, int(offset)), []).append((name, int(size), shape))
  return blocks


class _Sources:
  """op_name and source line of each instruction, from the scheduled HLO's metadata."""

  def __init__(self, hlo: str):
    mod = hlo_lib.parse(hlo)
    self.described = {i.name: i for i in mod if "metadata" in i.attributes}
    self.read = hlo_sources.Sources(mod)

  def __call__(self, instruction: str) -> tuple[str, str]:
    """A rematerialized copy (`name.remat2`) without metadata of its own reads its original's."""
    return self.read(self.described.get(instruction) or self.described.get(instruction.split(".remat")[0]))


def _array(shape: str) -> tuple[str, tuple[int, ...]]:
  found = hlo_lib.arrays(shape)
  return (found[0].dtype, found[0].dims) if found and not shape.startswith("(") else ("tuple", ())


def read(dump_dir: str, top: int = 12, spaces: tuple[int, ...] = (DEVICE, HOST),
         min_bytes: int = 64 * 2**10) -> list[Buffer]:
  """The `top` largest temp blocks (of at least `min_bytes`) of each memory color in
  `spaces`, largest first; [] when the dump holds no buffer assignment (e.g. the compile
  came from a cache)."""
  files = _module_files(dump_dir)
  if files is None:
    return []
  with open(files[0]) as f:
    blocks = _temp_values(f.read())
  hlo = ""
  if files[1]:
    with open(files[1]) as f:
      hlo = f.read()
  sources = _Sources(hlo)
  out = []
  for color in spaces:
    sized = ((max(v[1] for v in vals), vals) for (c, _), vals in blocks.items() if c == color)
    mine = sorted((b for b in sized if b[0] >= min_bytes), key=lambda b: -b[0])[:top]
    for size, vals in mine:
      # Named by its largest value; op_name and source from the largest that has metadata
      # (loop phis and the offload's copies carry none).
      ranked = sorted(vals, key=lambda v: -v[1])
      name, _, shape = ranked[0]
      dtype, dims = _array(shape)
      op_name, source = next((m for m in map(sources, (v[0] for v in ranked if v[1] == size)) if m[0]),
                             ("", ""))
      out.append(Buffer(size, _SPACES.get(color, f"color {color}"), dtype, dims, name,
                        op_name, source, len(vals)))
  return out


def _gib(b: int) -> str:
  return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def format_table(buffers: list[Buffer], limit: int = 12, source: str | None = None) -> list[str]:
  """Lines for the printed report: one per block, per memory space (`source`: which
  compile they come from, when not the program the report is about)."""
  lines = []
  of = source or "compiled program"
  for space in dict.fromkeys(b.space for b in buffers):
    rows = [b for b in buffers if b.space == space][:limit]
    lines.append(f"  largest {space} temp buffers ({of}'s buffer assignment, per device):")
    for b in rows:
      shape = f"{b.dtype}[{','.join(map(str, b.shape))}]"
      shared = f" (+{b.values - 1} sharing)" if b.values > 1 else ""
      op = b.op_name.removeprefix("jit(step)/")
      lines.append(f"    {_gib(b.bytes):>10}  {shape:<28} {b.source or '-':<44} {op[:60]}{shared}")
  return lines


def remembered(dump_dir: str, top: int, program: str | None) -> list[Buffer]:
  """`read(dump_dir, top)`, kept beside jax's persistent compilation cache under a hash of the
  compiled `program` text: a step the cache reads back writes no dump, and this returns the
  list its first compile wrote. Without a cache (or a program) it is `read`."""
  import jax
  cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
  if not cache or program is None or "://" in cache:
    return read(dump_dir, top)
  path = os.path.join(cache, "shardax-buffers", hashlib.sha256(program.encode()).hexdigest() + f"-{top}.json")
  listed = read(dump_dir, top)
  if listed or _module_files(dump_dir) is not None:   # compiled here: remember the list
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump([dataclasses.asdict(b) for b in listed], f)
    return listed
  if os.path.exists(path):   # read back from the cache: the list of its first compile
    with open(path) as f:
      return [Buffer(**{**b, "shape": tuple(b["shape"])}) for b in json.load(f)]
  return listed
