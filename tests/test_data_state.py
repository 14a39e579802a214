"""Each process's data state: saved per process beside the weights, restored without
reading anything twice or skipping anything, also on another process count, in every
layout and with a mixture (simulated processes, one jax; tests/test_multihost.py does it
on real processes)."""

import json
import os

import numpy as np
import pytest

from shardax.configs.data import DataConfig
from shardax.configs.schema import CheckpointConfig
from shardax.trainer import checkpoint
from shardax.trainer.data import inputs, packing, preparation, record, resume, streaming

SEQ = 32


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("datasets"))
  preparation.prepare(DataConfig(source="stdlib", data_dir=d))
  return DataConfig(source="stdlib", data_dir=d, seq_len=SEQ, seed=3)


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
  """Two JSON-lines sources whose documents start with 'A' and 'B', mixed 0.7 / 0.3."""
  d = tmp_path_factory.mktemp("mixture")
  srcs = []
  for letter, n in (("A", 120), ("B", 80)):
    os.makedirs(d / letter)
    with open(d / letter / "part.jsonl", "w") as f:
      f.writelines(json.dumps({"text": f"{letter}{i} " + "word " * (i % 17)}) + "\n" for i in range(n))
    srcs.append(f"files:{d / letter}/*.jsonl")
  return DataConfig(mixture=((srcs[0], 0.7), (srcs[1], 0.3)), data_dir=str(d / "data"), seq_len=SEQ,
                    num_shards=2, validation_fraction=0.25, seed=3)


def batches(cfg, count, index=None, batch=8):
  its = [inputs.Batches(cfg, "train", batch, process_index=p, process_count=count) for p in range(count)]
  return its if index is None else its[index]


def take_global(its, n):
  """n global batches: the processes' rows side by side."""
  out = []
  for _ in range(n):
    parts = [{k: np.asarray(v) for k, v in next(it).items()} for it in its]
    out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
  return out


def saved_states(its):
  return [json.loads(json.dumps(it.get_state())) for it in its]   # as the JSON files hold them


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
@pytest.mark.parametrize("saved_on, resumed_on", [(2, 4), (4, 1), (1, 2)])
def test_another_process_count_resumes_exactly_with_nothing_replayed(cfg, source, saved_on, resumed_on):
  if source == "synthetic":
    cfg = DataConfig(source="synthetic", data_dir=cfg.data_dir, seq_len=SEQ, seed=3)
  whole = take_global(batches(cfg, 1), 5)
  before = batches(cfg, saved_on)
  take_global(before, 3)
  states = saved_states(before)
  after = batches(cfg, resumed_on)
  assert [it.set_state(states) for it in after] == [0] * resumed_on
  for got, want in zip(take_global(after, 2), whole[3:]):
    for k in (packing.FIELDS if source == "stdlib" else ("inputs", "targets")):
      np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("num_shards, saved_on, resumed_on, batch",
                         [(2, 4, 2, 8), (1, 2, 1, 8), (1, 1, 2, 8), (3, 2, 4, 8), (4, 3, 2, 12)])
def test_rows_off_reader_blocks_resume_exactly_with_a_mixture(mix, num_shards, saved_on, resumed_on, batch):
  """R = gcd(num_shards, batch) readers of a two-source mixture; processes whose rows are
  not whole reader blocks (R=2 on 4 processes, R=1 on 2, R=4 readers of 3 rows on 3
  processes of 4 rows, process 1 keeping rows 1-4 of readers 1 and 2) run the readers they
  overlap and keep their rows, so every layout gives the one-process batches and resumes
  exactly."""
  cfg = DataConfig(**{**mix.__dict__, "num_shards": num_shards})
  whole = take_global(batches(cfg, 1, batch=batch), 5)
  before = batches(cfg, saved_on, batch=batch)
  for got, want in zip(take_global(before, 3), whole):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
  after = batches(cfg, resumed_on, batch=batch)
  assert [it.set_state(saved_states(before)) for it in after] == [0] * resumed_on
  for got, want in zip(take_global(after, 2), whole[3:]):
    for k in packing.FIELDS:
      np.testing.assert_array_equal(got[k], want[k])
  tokens = np.concatenate([b["inputs"].ravel() for b in whole])
  assert (tokens == ord("A")).any() and (tokens == ord("B")).any()   # both sources drawn
  # validation (one source at a time) reads the same rows off reader blocks too
  one = cfg.for_source(cfg.mixture[0][0])
  val = lambda count: take_global([inputs.Batches(one, "validation", batch, process_index=p, process_count=count)
                                   for p in range(count)], 2)
  for got, want in zip(val(resumed_on), val(1)):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])


def test_recorded_document_ids_match_across_process_counts(mix, tmp_path, monkeypatch):
  """The document-id record (SHARDAX_RECORD_DOCUMENTS): 2 simulated processes saving
  at batch 3 and 1 resuming record, step by step, the pieces an uninterrupted run records;
  ids name the source and the document, whose text starts with that source's letter."""
  runs = {}
  for name, plan in (("whole", [(1, 5)]), ("resumed", [(2, 3), (1, 5)])):
    monkeypatch.setenv(record.ENV, str(tmp_path / name))
    states = None
    for count, upto in plan:
      its = batches(mix, count)
      if states:
        [it.set_state(states) for it in its]
      take_global(its, upto - its[0].consumed)
      states = saved_states(its)
      [it.close() for it in its]
    runs[name] = record.steps(str(tmp_path / name))
  assert sorted(runs["whole"]) == [1, 2, 3, 4, 5] and runs["resumed"] == runs["whole"]
  sources = {s for pieces in runs["whole"].values() for s, _, _ in pieces}
  assert sources == {0, 1}
  assert sum(t for p in runs["whole"].values() for _, _, t in p) == 5 * 8 * SEQ   # no padding in train
  # every id names a real document of its source: source k's documents start with "AB"[k]
  sets = preparation.prepare_components(mix)
  docs = [streaming.local_documents(p, "train", 0, 1) for p in sets]
  for src, index, _ in runs["whole"][1] + runs["whole"][5]:
    assert docs[src][index][0] == ord("AB"[src])


def test_a_state_of_other_readers_is_refused_naming_why(mix):
  """A state whose reader count is not the config's (written by the old per-process
  readers) cannot be continued exactly: refused, not replayed."""
  before = batches(mix, 2)
  take_global(before, 1)
  states = saved_states(before)
  for st in states:
    st["reader_count"] = 4
  with pytest.raises(resume.DataResumeError, match="saved by 4 readers .* this config has 2"):
    batches(mix, 1, 0).set_state(states)
  states = saved_states(before)[:1]   # one writer of two: reader 1 missing
  with pytest.raises(resume.DataResumeError, match=r"data readers \[1\] of 2 are in none"):
    batches(mix, 1, 0).set_state(states + [dict(states[0], readers=[0])])


def test_every_process_writes_its_own_file_in_the_step(cfg, tmp_path):
  """The step's data_states item holds process_<i>-of-<n>.json; a step written by two
  processes restores, on one, as the list of both states (the iterator rebuilds from it)."""
  import jax.numpy as jnp
  state = {"step": jnp.int32(3), "params": {"w": jnp.ones((4, 2))}}
  it = batches(cfg, 1, 0)
  take_global([it], 3)
  with checkpoint.Checkpointer(tmp_path, CheckpointConfig(every=1)) as ckpt:
    ckpt.save(3, state, it.get_state())
    ckpt.wait()
    item = tmp_path / "3" / "data_states"
    assert sorted(p.name for p in item.iterdir() if p.suffix == ".json") == ["process_0-of-1.json"]
    _, data = ckpt.restore(state)
    assert data == json.loads(json.dumps(it.get_state()))
    # What two processes leave in a step (each wrote its own file in the same commit).
    two = batches(cfg, 2)
    take_global(two, 3)
    (item / "process_0-of-1.json").unlink()
    for i, st in enumerate(saved_states(two)):
      (item / checkpoint.state_file(i, 2)).write_text(json.dumps(st))
    _, data = ckpt.restore(state)
  assert isinstance(data, list) and [d["readers"] for d in data] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  fresh = batches(cfg, 1, 0)
  assert fresh.set_state(data) == 0
  np.testing.assert_array_equal(take_global([fresh], 1)[0]["inputs"], take_global([it], 1)[0]["inputs"])


def test_other_workers_per_reader_are_refused_with_the_worker_count_that_fits(cfg):
  """Each grain worker packs its own slice of the documents, so a state saved with 1
  worker per reader (worker_count=2 on 1 process: 2 readers) is refused on 2 processes,
  where worker_count=2 gives each process's one reader 2; the fix is named."""
  mp = DataConfig(source="stdlib", data_dir=cfg.data_dir, seq_len=SEQ, seed=3, worker_count=2, num_shards=2)
  it = inputs.Batches(mp, "train", 8, process_index=0, process_count=2)
  saved = {**it._identity(), "workers_per_reader": 1, "readers": [0, 1], "reader_count": 2, "batches": 0}
  try:
    with pytest.raises(resume.DataResumeError, match="saved with 1 grain worker processes per reader; "
                       "data.worker_count=2 gives 2 per reader .* set data.worker_count=1"):
      it.set_state([saved])
  finally:
    it.close()
