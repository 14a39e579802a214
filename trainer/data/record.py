"""The document-id record: which documents each training step consumed, per process.

A debugging and audit hook, off by default. With the environment variable

    SHARDAX_RECORD_DOCUMENTS=DIR   (e.g. the job dir)

every process appends one JSON line per training batch it takes to
`DIR/documents/process_<i>-of-<n>.jsonl`:

    {"step": 7, "rows": [4, 8], "documents": [[[source, index, tokens], ...], ...]}

one list per row it holds: the pieces of documents packed into that row, in order, as
(mixture source k, the document's index in source k's prepared train split, tokens of it
in the row). `steps(DIR)` merges every process file, of every run in the job dir, into
{step: [piece, ...] over the global batch}: two runs consumed the same documents exactly
when those are equal step by step (how tests/test_multihost.py checks a resume on another
process count against an uninterrupted run); `python -m shardax.trainer.data.record DIR`
prints each step's documents and tokens per source. An environment variable rather than a config
field: it changes nothing the run computes, so it must not change the resolved config.

Ids travel with the tokens through packing (streaming.py `with_ids`), so the record says
what the step really took, not what a reader prefetched.
"""

from __future__ import annotations

import collections
import glob
import json
import os

import numpy as np

ENV = "SHARDAX_RECORD_DOCUMENTS"
_SOURCE_BITS = 40   # id = source << 40 | (index + 1); 0 is padding


def directory() -> str | None:
  """Where to record, or None (the default: nothing recorded, no id field packed)."""
  return os.environ.get(ENV) or None


def document_id(source: int, index: int) -> int:
  return (source << _SOURCE_BITS) | (index + 1)


def split_id(doc: int) -> tuple[int, int]:
  """(source, index) of a document id."""
  return int(doc) >> _SOURCE_BITS, (int(doc) & ((1 << _SOURCE_BITS) - 1)) - 1


def row_pieces(document: np.ndarray) -> list[list[list[int]]]:
  """Per row of a [rows, seq_len] `document` field: [[source, index, tokens], ...] of the
  document pieces it holds, in order (padding, id 0, left out)."""
  out = []
  for row in np.asarray(document):
    pieces, start = [], 0
    for end in [*np.flatnonzero(np.diff(row)) + 1, len(row)]:
      if row[start]:
        pieces.append([*split_id(row[start]), int(end - start)])
      start = end
    out.append(pieces)
  return out


class Recorder:
  """Appends this process's rows of each step to its file (line-buffered: a killed run
  keeps every line it wrote)."""

  def __init__(self, root: str, process_index: int, process_count: int, rows: tuple[int, int]):
    os.makedirs(os.path.join(root, "documents"), exist_ok=True)
    name = f"process_{process_index}-of-{process_count}.jsonl"
    self._file = open(os.path.join(root, "documents", name), "a", buffering=1)
    self._rows = list(rows)

  def write(self, step: int, document: np.ndarray) -> None:
    self._file.write(json.dumps({"step": step, "rows": self._rows, "documents": row_pieces(document)}) + "\n")

  def close(self) -> None:
    self._file.close()


def steps(root: str) -> dict[int, list[tuple[int, int, int]]]:
  """{step: sorted pieces (source, index, tokens) of the whole global batch} from every
  process file under root/documents. A step recorded twice (a run that went past its
  last checkpoint before it stopped) keeps the newest run's rows."""
  rows: dict[int, dict[tuple[int, int], list]] = collections.defaultdict(dict)
  for path in sorted(glob.glob(os.path.join(root, "documents", "process_*.jsonl")),
                     key=os.path.getmtime):
    for line in open(path):
      rec = json.loads(line)
      start = rec["rows"][0]
      for k, pieces in enumerate(rec["documents"]):
        rows[rec["step"]][start + k] = [tuple(p) for p in pieces]
  return {s: sorted(p for row in by_row.values() for p in row) for s, by_row in sorted(rows.items())}


def summary(root: str) -> list[str]:
  """One line per recorded step: document pieces and tokens per source (the mixture's
  realized proportions)."""
  lines = []
  for step, pieces in steps(root).items():
    per = collections.Counter()
    for src, _, tokens in pieces:
      per[src] += tokens
    total = sum(per.values()) or 1
    shares = ", ".join(f"source {s}: {t} tokens ({t / total:.0%})" for s, t in sorted(per.items()))
    lines.append(f"step {step}: {len(pieces)} document pieces, {len({p[:2] for p in pieces})} documents; {shares}")
  return lines


if __name__ == "__main__":   # python -m shardax.trainer.data.record JOB_DIR
  import sys
  print("\n".join(summary(sys.argv[1])))
