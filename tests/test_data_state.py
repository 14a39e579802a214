"""Each process's data state: saved per process beside the weights, restored without
reading anything twice, also on another process count (simulated processes, one jax)."""

import json

import numpy as np
import pytest

from shardax.configs.schema import CheckpointConfig, DataConfig
from shardax.trainer import checkpoint
from shardax.trainer.data import inputs, packing, preparation

SEQ = 32


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("datasets"))
  preparation.prepare(DataConfig(source="stdlib", data_dir=d))
  return DataConfig(source="stdlib", data_dir=d, seq_len=SEQ, seed=3)


def batches(cfg, count, index=None):
  its = [inputs.Batches(cfg, "train", 8, process_index=p, process_count=count) for p in range(count)]
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


def test_rows_off_reader_blocks_replay_and_say_so(cfg, caplog):
  """2 shards, batch 8: R = 2 readers; 4 processes of 2 rows each are readers of another
  layout, so 2 processes cannot take their states: they replay (exact, and logged)."""
  two_shards = DataConfig(source="stdlib", data_dir=cfg.data_dir, seq_len=SEQ, seed=3, num_shards=2)
  whole = take_global(batches(two_shards, 1), 4)
  before = batches(two_shards, 4)
  take_global(before, 2)
  after = batches(two_shards, 2)
  with caplog.at_level("WARNING"):
    assert [it.set_state(saved_states(before)) for it in after] == [2, 2]
  assert "replaying 2 batches" in caplog.text
  for got, want in zip(take_global(after, 2), whole[2:]):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])


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
