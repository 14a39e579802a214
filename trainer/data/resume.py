"""A process's data state rebuilt from a checkpoint written by any number of processes.

A checkpoint's step holds one data state per writing process (trainer/checkpoint.py
`data_states`), each the grain states of the readers that process ran (layout.py). The
readers are fixed by the config, so a reader's state means the same on any process
count: a resuming process takes the states of its own readers from whichever writers
ran them, and continues exactly where the uninterrupted run would be: nothing read twice
or skipped, a mixture's interleaving (inside each reader's state) included. Nothing is
ever replayed. What cannot be resumed exactly is refused, naming why:

  * a state written with other readers (R): a checkpoint of shardax before readers were
    fixed by the config (each process was its own reader when its rows were not reader
    blocks); its stream cannot be continued by the fixed readers;
  * a reader the writers do not hold, or two writers disagreeing on one reader or on
    the batch count: a damaged or incomplete step;
  * grain worker processes per reader other than the writers' (data.worker_count): each
    worker packs its own slice of the documents, so the windows depend on that number.
"""

from __future__ import annotations

from typing import Any


class DataResumeError(ValueError):
  """A saved data state that this run cannot continue exactly (the message says why)."""


def batch_count(states: list[dict[str, Any]], default: int) -> int:
  """The batches the writers had consumed (all the same, or the step is damaged)."""
  counts = sorted({st.get("batches", default) for st in states})
  if len(counts) > 1:
    raise DataResumeError(f"the saved data states disagree on the batch count ({counts}); "
                          f"the checkpoint is damaged")
  return counts[0]


def _per_reader(states: list[dict[str, Any]], reader_count: int) -> dict[int, Any]:
  """{reader: its grain state} over every writer; a reader two writers ran must agree."""
  out: dict[int, Any] = {}
  for i, st in enumerate(states):
    if st.get("reader_count") != reader_count:
      raise DataResumeError(
          f"data state of writer {i} of {len(states)} was saved by {st.get('reader_count')} readers "
          f"{st.get('readers')}, this config has {reader_count} (gcd(data.num_shards, global batch)); "
          f"it was written by a shardax that gave each process its own reader, a stream the fixed "
          f"readers cannot continue: resume it on the process count that wrote it with that version")
    readers = st.get("readers") or []
    parts = [st["grain"]] if len(readers) == 1 else st["grain"].get("parents", [])
    for r, part in zip(readers, parts):
      if r in out and out[r] != part:
        raise DataResumeError(f"two writers saved different states for data reader {r}; "
                              f"the checkpoint is damaged")
      out[r] = part
  return out


def reader_states(states: list[dict[str, Any]], mine: list[int], reader_count: int) -> Any:
  """The grain state of this process's readers `mine`, from every writer's state."""
  own = states[0]
  if len(states) == 1 and own.get("readers", mine) == mine and own.get("reader_count", reader_count) == reader_count:
    return own["grain"]   # the same process layout: its own state as saved (older states lack the keys)
  per_reader = _per_reader(states, reader_count)
  missing = [r for r in mine if r not in per_reader]
  if missing:
    raise DataResumeError(f"data readers {missing} of {reader_count} are in none of the {len(states)} "
                          f"saved data states (readers {sorted(per_reader)}); the checkpoint is incomplete")
  parts = [per_reader[r] for r in mine]
  return parts[0] if len(parts) == 1 else {"parents": parts}


def check_workers(saved: int | None, here: int, worker_count: int, suggest) -> None:
  """Refuses other grain workers per reader than the writers had; `suggest(w)` is the
  data.worker_count that gives w per reader on this layout (None if none does)."""
  if saved is None or saved == here:
    return
  fix = suggest(saved)
  how = (f"set data.worker_count={fix}" if fix else "resume on the process count that wrote it")
  raise DataResumeError(
      f"the data state was saved with {saved} grain worker processes per reader; "
      f"data.worker_count={worker_count} gives {here} per reader on this process count, and each "
      f"worker packs its own slice of the documents, so the batches would differ: {how}")
