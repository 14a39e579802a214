"""Checkpointer: resharding restore, data state, retention, damage fallback, SIGTERM."""

import gc
import logging
import os
import pathlib
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.configs.schema import CheckpointConfig
from shardax.trainer import checkpoint
from shardax.trainer.checkpoint import (CheckpointError, CheckpointMismatchError,
                                        Checkpointer)

AUTO = jax.sharding.AxisType.Auto
# A failed orbax restore abandons tensorstore read coroutines; when they are collected they
# report "Event loop is closed" / "never awaited". Harmless, so silenced (and collected in-test).
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")]


def _mesh(shape, names, devices=None):
  if devices is not None:
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AUTO,) * len(shape))
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


# Param name -> (shape, spec on the (2, 4) save mesh, spec on the (4, 2) restore mesh).
PARAMS = {
    "embed": ((32, 8), P(("data", "model"), None), P(None, "data")),
    "w_in": ((8, 16), P("data", "model"), P("model", "data")),
    "w_out": ((16, 8), P("model", None), P()),
    "bias": ((16,), P("model"), P("data")),
}


def _state(mesh, specs):
  """Params and a real adamw state with non-zero moments, built from host values (no compiles)."""
  rng = np.random.default_rng(0)
  put = lambda scale: {n: jax.device_put((rng.standard_normal(shape) * scale).astype(np.float32),  # noqa: E731
                                         NamedSharding(mesh, specs[n]))
                       for n, (shape, *_) in PARAMS.items()}
  params = put(1.0)
  adam, *rest = optax.adamw(1e-2).init(params)
  adam = adam._replace(count=jnp.int32(3), mu=put(0.1), nu=put(0.01))
  return {"step": jnp.int32(7), "params": params, "opt_state": (adam, *rest)}


def _abstract(state, mesh, specs):
  """The state's structure with leaves placed per `specs` on `mesh` (opt_state follows params)."""
  def leaf(path, x):
    name = next((str(k.key) for k in reversed(path) if getattr(k, "key", None) in specs), None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, specs[name] if name else P()))
  return jax.tree_util.tree_map_with_path(leaf, state)


def _small_state(x=1.0):
  return {"step": jnp.int32(0), "params": {"w": jnp.full((4, 2), x)}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One checkpoint (step 7) written from a (2, 4) mesh."""
  mesh = _mesh((2, 4), ("data", "model"))
  state = _state(mesh, {n: v[1] for n, v in PARAMS.items()})
  directory = tmp_path_factory.mktemp("ckpt")
  with Checkpointer(directory, CheckpointConfig(every=1)) as ckpt:
    assert ckpt.save(7, state, {"pos": 123, "epoch": 1})
  return directory, jax.device_get(state)


@pytest.mark.parametrize("target", ["8", "4x2", "one_device"])
def test_restore_reshards_onto_another_mesh(saved, target):
  directory, host_state = saved
  if target == "8":
    mesh, specs = _mesh((8,), ("x",)), {n: P("x") for n in PARAMS}
  elif target == "4x2":
    mesh, specs = _mesh((4, 2), ("data", "model")), {n: v[2] for n, v in PARAMS.items()}
  else:
    mesh, specs = _mesh((1,), ("x",), jax.devices()[:1]), {n: P() for n in PARAMS}
  abstract = _abstract(host_state, mesh, specs)
  with Checkpointer(directory, CheckpointConfig()) as ckpt:
    state, data = ckpt.restore(abstract)
  assert data == {"pos": 123, "epoch": 1}
  assert jax.tree.structure(state) == jax.tree.structure(host_state)   # optax namedtuples intact
  assert isinstance(state["opt_state"][0], optax.ScaleByAdamState)
  for got, want, spec in zip(jax.tree.leaves(state), jax.tree.leaves(host_state),
                             jax.tree.leaves(abstract)):
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), want)   # bit-equal
    assert got.sharding == spec.sharding
  assert float(np.abs(host_state["opt_state"][0].mu["w_in"]).sum()) > 0   # not trivially zero


def test_data_state_latest_step_and_retention(tmp_path):
  """keep=2, keep_every=4: saving steps 1..10 leaves 4 and 8 (every 4th) plus 9 and 10."""
  ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=2, keep_every=4, async_save=True))
  assert ckpt.latest_step() is None
  for step in range(1, 11):
    assert ckpt.should_save(step)
    assert ckpt.save(step, _small_state(step), {"pos": step * 10})
  assert not ckpt.save(10, _small_state(), {"pos": 0}, force=True)   # already saved: no-op
  ckpt.wait()
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 8, 9, 10]
  assert ckpt.latest_step() == 10
  state, data = ckpt.restore(_small_state())
  assert data == {"pos": 100} and float(state["params"]["w"][0, 0]) == 10.0
  assert ckpt.restore(_small_state(), step=4)[1] == {"pos": 40}
  ckpt.close()

  ckpt = Checkpointer(tmp_path, CheckpointConfig(every=3))   # a fresh process sees the same
  assert ckpt.latest_step() == 10
  assert [s for s in range(11, 19) if ckpt.should_save(s)] == [12, 15, 18]
  assert not ckpt.save(13, _small_state())                    # not an interval step
  assert ckpt.save(13, _small_state(), force=True)            # the final step
  ckpt.wait()
  assert ckpt.latest_step() == 13
  ckpt.close()


def test_uncommitted_tmp_dir_is_ignored_and_cleaned(tmp_path):
  with Checkpointer(tmp_path, CheckpointConfig(every=1)) as ckpt:
    ckpt.save(1, _small_state(), {"pos": 1})
  # What a save killed before its commit (the rename) leaves behind.
  leftover = tmp_path / "2.orbax-checkpoint-tmp-1234567"
  leftover.mkdir()
  (leftover / "state").mkdir()
  with Checkpointer(tmp_path, CheckpointConfig(every=1)) as ckpt:
    assert ckpt.latest_step() == 1
    assert ckpt.restore(_small_state())[1] == {"pos": 1}
    assert ckpt.save(2, _small_state(), {"pos": 2})
  assert not leftover.exists()


def _damage(step_dir: pathlib.Path, how: str):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files, "expected ocdbt data files under state/**/d/"
  for p in files:
    if how == "truncate":
      with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)
    else:
      p.unlink()


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_damaged_latest_step_is_moved_aside_and_the_previous_restored(tmp_path, how, caplog, monkeypatch):
  monkeypatch.setattr(checkpoint, "BACKOFF_S", 0.01)
  ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1))
  ckpt.save(1, _small_state(1.0), {"pos": 1})
  ckpt.save(2, _small_state(2.0), {"pos": 2})
  ckpt.wait()
  _damage(tmp_path / "2", how)
  with caplog.at_level(logging.WARNING):
    state, data = ckpt.restore(_small_state())
  assert data == {"pos": 1} and float(state["params"]["w"][0, 0]) == 1.0
  assert any("step 2" in r.getMessage() and "moved aside" in r.getMessage() and str(tmp_path) in r.getMessage()
             for r in caplog.records)
  # Moved, not deleted: the damaged files are kept under damaged/; step 2 is written afresh.
  aside = list((tmp_path / "damaged").iterdir())
  assert [p.name.split("-")[0] for p in aside] == ["2"] and (aside[0] / "state").is_dir()
  assert ckpt.latest_step() == 1
  assert ckpt.save(2, _small_state(2.0), {"pos": 2})
  assert ckpt.restore(_small_state())[1] == {"pos": 2}
  ckpt.wait()
  _damage(tmp_path / "1", how)
  _damage(tmp_path / "2", how)
  with pytest.raises(CheckpointError, match=str(tmp_path)):
    ckpt.restore(_small_state())
  assert len(list((tmp_path / "damaged").iterdir())) == 3
  ckpt.close()
  gc.collect()


class Flaky:
  """The real orbax restore behind a storage that fails `failures` times first."""

  def __init__(self, restore, failures):
    self.restore, self.failures, self.calls = restore, failures, 0

  def __call__(self, *args, **kwargs):
    self.calls += 1
    if self.calls <= self.failures:
      raise OSError("503 Service Unavailable: backend error, retry")
    return self.restore(*args, **kwargs)


@pytest.fixture
def two_steps(tmp_path, monkeypatch):
  monkeypatch.setattr(checkpoint, "BACKOFF_S", 0.01)
  ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1))
  ckpt.save(1, _small_state(1.0), {"pos": 1})
  ckpt.save(2, _small_state(2.0), {"pos": 2})
  ckpt.wait()
  yield ckpt
  ckpt.close()


def test_a_transient_read_error_is_retried_and_the_newest_step_restored(two_steps, caplog):
  two_steps._manager.restore = flaky = Flaky(two_steps._manager.restore, failures=1)
  with caplog.at_level(logging.WARNING):
    assert two_steps.restore(_small_state())[1] == {"pos": 2}
  assert flaky.calls == 2 and "retrying" in caplog.text
  assert sorted(p.name for p in two_steps.directory.iterdir() if p.name.isdigit()) == ["1", "2"]


def test_a_persistent_error_that_proves_no_damage_stops_without_rolling_back(two_steps):
  two_steps._manager.restore = Flaky(two_steps._manager.restore, failures=100)
  with pytest.raises(CheckpointError, match=r"step 2 .* not rolling back"):
    two_steps.restore(_small_state())
  assert two_steps.latest_step() == 2 and not (two_steps.directory / "damaged").exists()


def test_structure_mismatch_is_a_clear_error(tmp_path):
  with Checkpointer(tmp_path, CheckpointConfig(every=1)) as ckpt:
    ckpt.save(1, _small_state(), None)
    other_model = {"step": jnp.int32(0), "params": {"w": jnp.zeros((4, 2)), "v": jnp.zeros(3)}}
    with pytest.raises(CheckpointMismatchError, match=r"fresh --job_dir") as err:
      ckpt.restore(other_model)
    assert str(tmp_path) in str(err.value) and "params/v" in str(err.value)
    wider = {"step": jnp.int32(0), "params": {"w": jnp.zeros((8, 2))}}
    with pytest.raises(CheckpointMismatchError, match=r"\(4, 2\) vs requested \(8, 2\)"):
      ckpt.restore(wider)
    assert ckpt.restore(_small_state())[1] is None   # data_state=None round-trips
  gc.collect()


@pytest.mark.parametrize("name, mode", [("lm.tiny", "train first (--mode=train)"),
                                        ("hf:/some/model", "import or train first (--mode=import / --mode=train)")])
def test_restore_params_of_an_empty_job_dir_names_the_mode_that_writes_one(tmp_path, name, mode):
  import dataclasses
  from shardax import configs
  from shardax.sharding import make_mesh
  from shardax.trainer import model_setup
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, ["model.num_layers=1", "model.d_model=32", "model.num_heads=2",
                                "model.d_ff=64", "mesh.ici=(1, 1)"])
  exp = dataclasses.replace(configs.build(cfg), name=name)
  setup = model_setup.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  with pytest.raises(FileNotFoundError) as err:
    checkpoint.restore_params(setup, str(tmp_path))
  assert str(err.value) == f"no checkpoint in {tmp_path}/checkpoints; {mode}"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers can only be installed from the main thread")
def test_sigterm_marks_preemption_without_killing(tmp_path):
  seen_by_fallback = []
  fallback = lambda signum, frame: seen_by_fallback.append(signum)  # noqa: E731
  before = signal.signal(signal.SIGTERM, fallback)   # so a broken Checkpointer fails, not kills pytest
  try:
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1000))
    assert not ckpt.preempted() and not ckpt.should_save(7)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not ckpt.preempted() and not seen_by_fallback and time.monotonic() < deadline:
      time.sleep(0.01)   # the Python-level handler runs at the next bytecode boundary
    assert ckpt.preempted() and not seen_by_fallback
    assert ckpt.should_save(7) and ckpt.save(7, _small_state(), {"pos": 7})
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is fallback   # previous handler is back
  finally:
    signal.signal(signal.SIGTERM, before)
