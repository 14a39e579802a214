"""The safetensors format, read and written one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}, plus "__metadata__"), then the raw little-endian tensor bytes. Reading a
tensor is one `pread` of its byte range into a fresh numpy array, so memory holds exactly
the tensors being converted (a memory map would leave touched pages in the process's
resident set until unmapped); writing streams each tensor's bytes after a header computed
up front from the shapes. bfloat16 comes from ml_dtypes (numpy has none). Sharded models
have `model.safetensors.index.json` ({"weight_map": {name: file}}), as transformers writes.
A tensor's rows (a range of its first dim) are one contiguous byte range, so a process that
holds only some rows of a tensor reads only those (`Reader.get(name, rows=(a, b))`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}   # fp8: models/hf/fp8.py dequantizes
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsError(ValueError):
  """A file that is not valid safetensors, or a tensor that is not there."""


def read_header(path: str) -> tuple[dict, int]:
  """({name: entry}, byte offset of the data) of one file."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 << 20:
      raise SafetensorsError(f"{path}: header of {n} bytes; not a safetensors file")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


class Reader:
  """All tensors of a model directory (one file or an indexed set), read on demand.

  `bytes_read` counts the tensor bytes this reader has read (what a process of a sharded
  import costs its storage), `nbytes` is the sum over all tensors. `reads_rows`: `get` takes
  `rows` (readers that wrap this one and transform tensors, e.g. dequantizing ones, may not)."""

  reads_rows = True

  def __init__(self, model_dir: str):
    self.dir = os.path.expanduser(model_dir)
    index = os.path.join(self.dir, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(self.dir, SINGLE)):
      files = [SINGLE]
    else:
      raise SafetensorsError(f"{self.dir}: neither {SINGLE} nor {INDEX}; shardax reads safetensors "
                             f"weights only (no pickled .bin files)")
    self.entries: dict[str, tuple[str, dict, int]] = {}
    for name in files:
      path = os.path.join(self.dir, name)
      header, start = read_header(path)
      for key, entry in header.items():
        self.entries[key] = (path, entry, start)
    self.bytes_read = 0
    self.nbytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e, _ in self.entries.values())

  def names(self) -> list[str]:
    return sorted(self.entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entry(name)[1]["shape"])

  def _entry(self, name: str):
    if name not in self.entries:
      raise SafetensorsError(f"tensor {name!r} is not in the safetensors files of {self.dir}")
    return self.entries[name]

  def get(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor as a numpy array of its stored dtype (one read, no memory map); with
    `rows=(a, b)`, only rows a..b-1 of its first dim (one read of their bytes)."""
    path, entry, start = self._entry(name)
    dtype = np.dtype(DTYPES[entry["dtype"]])
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != end - begin:
      raise SafetensorsError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {dtype}")
    if rows is not None:
      a, b = rows
      if not shape or not 0 <= a <= b <= shape[0]:
        raise SafetensorsError(f"tensor {name!r} of shape {shape}: rows={rows} is not a range of its first dim")
      row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
      begin, shape = begin + a * row_bytes, (b - a,) + shape[1:]
    out = np.empty(shape, dtype)
    with open(path, "rb", buffering=0) as f:
      f.seek(start + begin)
      view = memoryview(out.reshape(-1).view(np.uint8))
      got = 0
      while got < out.nbytes:
        n = f.readinto(view[got:])
        if not n:
          raise SafetensorsError(f"{path}: truncated in tensor {name!r}")
        got += n
    self.bytes_read += out.nbytes
    return out


def write(path: str, specs: Iterable[tuple[str, tuple[int, ...], np.dtype]],
          tensor: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> int:
  """Writes one file whose tensors are `specs` (name, shape, dtype) in order, asking
  `tensor(name)` for each only when its bytes are due; returns the bytes written."""
  specs = list(specs)
  header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  for name, shape, dtype in specs:
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)   # keeps the data 8-byte aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name, shape, dtype in specs:
      arr = np.ascontiguousarray(tensor(name))
      if arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise SafetensorsError(f"tensor {name!r}: got {arr.shape} {arr.dtype}, planned {shape} {dtype}")
      f.write(arr.reshape(-1).view(np.uint8).data)
  return 8 + len(raw) + offset


def plan_files(specs: list[tuple[str, tuple[int, ...], np.dtype]], max_bytes: int) -> list[list]:
  """Consecutive groups of `specs`, each under `max_bytes` (a larger tensor gets its own file)."""
  files: list[list] = [[]]
  size = 0
  for spec in specs:
    n = int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[2]).itemsize
    if files[-1] and size + n > max_bytes:
      files.append([])
      size = 0
    files[-1].append(spec)
    size += n
  return files


def write_model(out_dir: str, specs: list[tuple[str, tuple[int, ...], np.dtype]],
                tensor: Callable[[str], np.ndarray], max_bytes: int) -> list[str]:
  """model.safetensors, or model-0000i-of-0000n.safetensors + the index when the tensors
  exceed `max_bytes`; returns the file names."""
  groups = plan_files(specs, max_bytes)
  if len(groups) == 1:
    write(os.path.join(out_dir, SINGLE), groups[0], tensor)
    return [SINGLE]
  names, weight_map, total = [], {}, 0
  for i, group in enumerate(groups):
    name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    total += write(os.path.join(out_dir, name), group, tensor)
    names.append(name)
    weight_map.update({spec[0]: name for spec in group})
  total_size = sum(int(np.prod(s[1], dtype=np.int64)) * np.dtype(s[2]).itemsize for s in specs)
  with open(os.path.join(out_dir, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
  return names + [INDEX]
