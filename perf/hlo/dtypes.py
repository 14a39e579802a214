"""Element sizes of every XLA primitive type, in bytes, as HLO text spells them.

The one table: collective bytes, operand dtypes and buffer sizes all read it. Sub-byte
types (s1, s2, s4, u1, u2, u4, f4e2m1fn) count one byte per element, as XLA's
`primitive_util::ByteWidth` rounds them; `token` and tuples hold no array data.
"""

from __future__ import annotations

import math

BYTES: dict[str, int] = {
    "pred": 1,
    "s1": 1, "s2": 1, "s4": 1, "s8": 1, "s16": 2, "s32": 4, "s64": 8,
    "u1": 1, "u2": 1, "u4": 1, "u8": 1, "u16": 2, "u32": 4, "u64": 8,
    "f4e2m1fn": 1,
    "f8e3m4": 1, "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16,
    "token": 0,
}

FLOAT8 = frozenset(t for t in BYTES if t.startswith("f8"))
INT8 = frozenset({"s8", "u8"})


def nbytes(dtype: str, dims) -> int:
  """Bytes of an array of `dtype` (HLO spelling) and shape `dims`; a ValueError for an unknown
  type, so a type a new XLA adds is taught here rather than counted as 0."""
  if dtype not in BYTES:
    raise ValueError(f"unknown HLO element type {dtype!r}: add it to perf/hlo/dtypes.BYTES")
  return BYTES[dtype] * math.prod(dims)
