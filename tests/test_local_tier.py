"""The local checkpoint tier (trainer/local_tier.py): each process's shards round-trip onto
the same layout, a step is restored only when complete and only by the job dir (identity)
and history it was written for, and the tier choice."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from shardax.configs.schema import CheckpointConfig, ConfigError
from shardax.trainer import local_tier


def _state(mesh, step):
  shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  w = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) + step
  return {"step": shard(jnp.int32(step), P()),
          "params": {"w": shard(w, P("data", "model")), "b": shard(jnp.ones(6, jnp.bfloat16) * step, P())},
          "opt": {"mu": shard(w * 2, P("data", None))}}


@pytest.fixture
def mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def test_a_step_round_trips_with_its_data_state(tmp_path, mesh):
  tier = local_tier.LocalTier(str(tmp_path), every=2, job_dir="/jobs/a")
  for step in (2, 4, 6):
    tier.save(step, _state(mesh, step), {"position": step * 10})
  tier.wait()
  assert tier.complete_steps() == [4, 6]   # the newest checkpoint.local_keep=2
  want = _state(mesh, 6)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
  got, data_state = tier.restore(6, abstract)
  assert data_state == {"position": 60}
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.sharding == b.sharding and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
      mesh, P("model", None) if x.ndim == 2 else P())), want)   # another layout: refused, not misread
  with pytest.raises(ValueError, match="another mesh layout"):
    tier.restore(6, other)


def test_a_step_donated_to_the_next_one_while_written_is_saved_as_it_was(tmp_path, mesh):
  tier = local_tier.LocalTier(str(tmp_path), every=1, job_dir="/jobs/d")
  state = _state(mesh, 3)
  want = jax.tree.map(np.asarray, _state(mesh, 3))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  tier.save(3, state, {})
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 99, s), donate_argnums=0)
  jax.block_until_ready(step(state))   # the train loop donates the state it just saved
  tier.wait()
  got, _ = tier.restore(3, abstract)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_an_incomplete_or_damaged_step_is_not_complete(tmp_path, mesh):
  tier = local_tier.LocalTier(str(tmp_path), every=1, job_dir="/jobs/b")
  for step in (1, 2):
    tier.save(step, _state(mesh, step), {})
  tier.wait()
  os.remove(os.path.join(tier.dir, "2", local_tier.MARKER))      # killed before its marker
  assert tier.complete_steps() == [1]
  victim = os.path.join(tier.dir, "1", "1.0.bin")
  with open(victim, "r+b") as f:
    f.truncate(4)                                                # a short file
  assert tier.complete_steps() == []


def test_the_newest_step_every_process_holds_wins_over_an_older_persistent_one():
  assert local_tier.choose([[4, 8], [4, 8]], 6)[:2] == ("local", 8)
  assert local_tier.choose([[4, 8], [4]], 6)[:2] == ("persistent", 6)   # 8 incomplete on process 1
  assert local_tier.choose([[4, 8], [4]], None)[:2] == ("local", 4)
  tier, step, why = local_tier.choose([[4, 8], []], 6)                # process 1's disk wiped
  assert (tier, step) == ("persistent", 6) and "process(es) [1] hold no complete local step" in why
  assert local_tier.choose([[8], [8]], 8)[:2] == ("local", 8)         # as new: the faster read


class Persistent:
  """The job's persistent tier as the local tier sees it: its newest step so far."""
  def __init__(self, step=None):
    self.step = step

  def latest_step(self):
    return self.step


def test_a_step_of_another_job_dir_identity_is_removed_not_restored(tmp_path, mesh):
  old = local_tier.LocalTier(str(tmp_path), every=1, job_dir="/jobs/i", identity="old")
  old.save(2, _state(mesh, 2), {})
  old.wait()
  new = local_tier.LocalTier(str(tmp_path), every=1, job_dir="/jobs/i", identity="new")
  assert new.dir == old.dir and new.complete_steps() == [2]
  steps, why = new.usable(None)
  assert steps == [] and why.startswith("identity rule: local step(s) [2] were written for another job dir")
  assert new.complete_steps() == []   # removed, not only skipped


def test_a_step_is_usable_only_while_the_persistent_step_it_descends_from_is_the_newest(tmp_path, mesh):
  persistent = Persistent()
  tier = local_tier.LocalTier(str(tmp_path), every=1, job_dir="/jobs/h", identity="j", keep=5,
                              persistent=persistent)
  for step in (1, 2, 3):                # before any persistent step
    tier.save(step, _state(mesh, step), {})
  tier.wait()
  assert tier.complete_steps() == [1, 2, 3]   # checkpoint.local_keep=5
  persistent.step = 4                   # saved (or being saved) at step 4
  tier.save(6, _state(mesh, 6), {})
  tier.save(8, _state(mesh, 8), {})
  tier.wait()
  assert tier.complete_steps() == [6, 8]   # steps 1-3 predate persistent step 4: another history
  assert tier.usable(4) == ([6, 8], "")    # a crash after local step 8: both continue step 4
  steps, why = tier.usable(None)           # the persistent steps were deleted (or 4 never committed)
  assert steps == [] and why.startswith("history rule: local step(s) [6, 8] descend from persistent step(s) [4]")
  assert tier.usable(0)[0] == []           # rolled back to an older persistent step
  assert tier.usable(12) == ([6, 8], "")   # a newer persistent step: `choose` takes it
  tier.discard(restored=8)                   # what the restart did not restore goes
  assert tier.complete_steps() == [8]


def test_a_finished_job_removes_its_local_copies(tmp_path, mesh):
  tier = local_tier.LocalTier(str(tmp_path), every=1, job_dir="/jobs/f")
  tier.save(1, _state(mesh, 1), {})
  tier.remove()
  assert os.listdir(tmp_path) == []


def test_local_keep_must_be_positive():
  with pytest.raises(ConfigError, match="checkpoint.local_keep=0 must be >= 1"):
    CheckpointConfig(local_keep=0)


def test_local_every_must_be_set():
  """Refused when the config is built, before the job dir's checkpoints folder is made."""
  with pytest.raises(ConfigError, match="checkpoint.local_every=0 must be >= 1 with checkpoint.local_dir='/tmp/x'"):
    CheckpointConfig(local_dir="/tmp/x", local_every=0)
  assert CheckpointConfig(local_every=0).local_dir == ""   # the tier off: no interval needed


def test_the_job_key_of_a_url_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
  roots = []
  for cwd in ("a", "b"):
    (tmp_path / cwd).mkdir()
    monkeypatch.chdir(tmp_path / cwd)
    roots.append(local_tier.LocalTier(str(tmp_path / "local"), every=1, job_dir="gs://bucket/run").root)
    roots.append(local_tier.LocalTier(str(tmp_path / "local"), every=1, job_dir="../run").root)
  assert roots[0] == roots[2] and roots[1] == roots[3] and roots[0] != roots[1]
  # a local dir keeps its key, however it is spelled
  assert roots[1] == local_tier.LocalTier(str(tmp_path / "local"), every=1, job_dir=str(tmp_path / "run")).root
