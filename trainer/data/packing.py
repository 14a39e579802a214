"""Packing documents into fixed windows: segment ids, per-document positions, a loss mask.

A document of token ids t1..tn becomes one next-token example with the end-of-document
id `eos` on both sides (GPT-2 style, one id serves as BOS and EOS):

    inputs  = [eos, t1, ..., tn]        targets = [t1, ..., tn, eos]

so every token of the document, and its end, is predicted exactly once. Examples are
then concatenated and split into windows of `seq_len` (grain's concat-then-split, which
is checkpointable): no token is dropped, a long document continues in the next window
(as a new segment whose positions restart at 0), and only the very last window of a
finite split is padded. Each window carries

    segment_ids  1, 2, ... per document piece in the row, 0 on padding  (attention mask)
    positions    0.. within each piece                                  (RoPE)
    loss_mask    1.0 on real targets, 0.0 on padding                    (the loss)

The model (layers/attention.py) lets a query see only keys with its own segment id, so a
packed batch computes what each document would compute alone; the test of that is
tests/test_packing.py.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def document_example(ids: np.ndarray, eos: int, own_start: bool = False) -> dict[str, np.ndarray]:
  """The next-token example of one document: inputs [eos, ids], targets [ids, eos].
  own_start (a model tokenizer whose ids already begin with its BOS): inputs ids,
  targets [ids[1:], eos], so the text is exactly what the model's tokenizer made of it."""
  ids = np.asarray(ids, dtype=np.int32).reshape(-1)
  edge = np.asarray([eos], np.int32)
  if own_start:
    return {"inputs": ids, "targets": np.concatenate([ids[1:], edge])}
  return {"inputs": np.concatenate([edge, ids]), "targets": np.concatenate([ids, edge])}


def _window_fields(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """grain's {inputs, inputs_segment_ids, inputs_positions, targets, ...} -> FIELDS
  (+ `document`, the document id of every token, when the examples carry one)."""
  segments = packed["inputs_segment_ids"].astype(np.int32)
  out = {"inputs": packed["inputs"].astype(np.int32),
         "targets": packed["targets"].astype(np.int32),
         "segment_ids": segments,
         "positions": packed["inputs_positions"].astype(np.int32),
         "loss_mask": (segments > 0).astype(np.float32)}
  if "document" in packed:
    out["document"] = np.where(segments > 0, packed["document"], 0).astype(np.int64)
  return out


def pack(examples: grain.IterDataset, seq_len: int, with_ids: bool = False) -> grain.IterDataset:
  """Windows {FIELDS} of `seq_len` tokens from an IterDataset of `document_example`s
  (with_ids: each example also has a `document` field, packed alongside)."""
  lengths = {"inputs": seq_len, "targets": seq_len, **({"document": seq_len} if with_ids else {})}
  packed = grain.experimental.ConcatThenSplitIterDataset(examples, length_struct=lengths)
  return packed.map(_window_fields)


def state_from_json(state: Any) -> Any:
  """A grain state read back from JSON, with the packer's slices as tuples again.

  grain's ConcatThenSplit tests `slices != (-1, -1)` to know whether it holds a partial
  document; JSON turns the tuple into a list, so a restored packer with no partial
  document would take the next document's head as one and replay from the wrong place
  (seen whenever a checkpoint fell right after a window that ended a document)."""
  if isinstance(state, dict):
    return {k: ({f: tuple(s) for f, s in v.items()} if k == "remainder_slices" and isinstance(v, dict)
                else state_from_json(v)) for k, v in state.items()}
  if isinstance(state, list):
    return [state_from_json(v) for v in state]
  return state


def padding_window(seq_len: int) -> dict[str, np.ndarray]:
  """A window that is all padding: it adds nothing to a loss or to attention."""
  zeros = np.zeros((seq_len,), np.int32)
  return {"inputs": zeros, "targets": zeros, "segment_ids": zeros, "positions": zeros,
          "loss_mask": np.zeros((seq_len,), np.float32)}


def pack_documents(docs: list[Any], seq_len: int, eos: int) -> dict[str, np.ndarray]:
  """All windows of a small list of token-id documents, stacked [windows, seq_len] (tests,
  notebooks); the loader streams the same thing through `pack`."""
  examples = grain.MapDataset.source([np.asarray(d, np.int32) for d in docs]).map(
      lambda ids: document_example(ids, eos))
  windows = list(pack(examples.to_iter_dataset(), seq_len))
  return {k: np.stack([w[k] for w in windows]) for k in FIELDS}
