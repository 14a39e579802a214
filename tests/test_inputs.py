"""The data pipeline: corpus splits, windows, grain batching, sharding, resumption."""

import json
import os
import re
import subprocess
import sys

import grain
import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from shardax.configs.schema import DataConfig
from shardax.trainer.data import corpus, inputs

SEQ = 32


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """One prepared stdlib corpus for the whole module."""
  d = str(tmp_path_factory.mktemp("datasets"))
  corpus.prepare_stdlib(d, 0.05)
  return d


@pytest.fixture(scope="module")
def cfg(data_dir):
  return DataConfig(source="stdlib", data_dir=data_dir, seq_len=SEQ, seed=3)


def take(it, n):
  return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def split_paths(data_dir, split):
  ds = corpus.prepare_stdlib(data_dir, 0.05).as_data_source(split=split)
  return [ds[i]["path"].decode() for i in range(len(ds))]


# --- corpus ------------------------------------------------------------------------

def test_splits_are_disjoint_cover_the_stdlib_and_follow_the_path_hash(data_dir):
  train, val = split_paths(data_dir, "train"), split_paths(data_dir, "validation")
  assert train == sorted(train) and val == sorted(val)  # deterministic document order
  assert not set(train) & set(val)
  files = corpus.stdlib_files(corpus.stdlib_root())
  assert sorted(train + val) == files and len(files) > 500
  assert not any("site-packages" in p for p in files)
  assert all(corpus.split_of(p, 0.05) == "validation" for p in val)
  assert 0.01 < len(val) / len(files) < 0.15


def test_prepare_twice_gives_identical_token_streams(data_dir, tmp_path):
  other = corpus.prepare_stdlib(str(tmp_path), 0.05)
  first = corpus.prepare_stdlib(data_dir, 0.05)
  for split in ("train", "validation"):
    a = corpus.token_stream(first.as_data_source(split=split), "text")
    b = corpus.token_stream(other.as_data_source(split=split), "text")
    np.testing.assert_array_equal(a, b)
    assert a[0] == inputs.SEPARATOR_ID and a.dtype == np.uint8


def test_encode_decode_roundtrip():
  text = "def f(x):\n  return 'héllo ✓'\n"
  ids = inputs.encode(text)
  assert ids.dtype == np.int32 and ids.min() > 0 and ids.max() < 256
  assert inputs.decode(ids) == text
  assert inputs.decode(np.concatenate([[0], ids, [0, 300]])) == text  # SEP/padded ids dropped


# --- batches -------------------------------------------------------------------------

def test_batches_are_shifted_byte_windows_of_the_stream(cfg):
  batch = take(inputs.Batches(cfg, "validation", 8), 1)[0]
  x, y = batch["inputs"], batch["targets"]
  assert x.shape == y.shape == (8, SEQ) and x.dtype == y.dtype == np.int32
  assert x.min() >= 0 and x.max() <= 255
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  stream = inputs.split_tokens(cfg, "validation")  # validation is in order: row r = window r
  for r in range(8):
    np.testing.assert_array_equal(x[r], stream[r * SEQ:(r + 1) * SEQ])
    np.testing.assert_array_equal(y[r], stream[r * SEQ + 1:(r + 1) * SEQ + 1])


def test_same_seed_same_batches_other_seed_other_batches(cfg):
  a = take(inputs.Batches(cfg, "train", 8), 3)
  assert_same(a, take(inputs.Batches(cfg, "train", 8), 3))
  b = take(inputs.Batches(cfg, "train", 8, seed=4), 3)
  assert not np.array_equal(a[0]["inputs"], b[0]["inputs"])


def test_resume_from_state_continues_the_uninterrupted_sequence(cfg):
  full = take(inputs.Batches(cfg, "train", 8), 7)
  first = inputs.Batches(cfg, "train", 8)
  take(first, 3)
  state = json.loads(json.dumps(first.get_state()))  # must survive a JSON checkpoint
  resumed = inputs.Batches(cfg, "train", 8)
  resumed.set_state(state)
  assert_same(take(resumed, 4), full[3:])


def test_state_from_another_config_is_refused(cfg):
  state = inputs.Batches(cfg, "train", 8).get_state()
  with pytest.raises(ValueError, match="global_batch=8 but this run has global_batch=16"):
    inputs.Batches(cfg, "train", 16).set_state(state)


def test_orbax_checkpoint_through_grain_handler(cfg, tmp_path):
  import orbax.checkpoint as ocp
  it = inputs.Batches(cfg, "train", 8)
  take(it, 2)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mgr.wait_until_finished()
    want = take(it, 2)
    fresh = inputs.Batches(cfg, "train", 8)
    mgr.restore(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
  assert_same(take(fresh, 2), want)


def test_each_epoch_is_a_fresh_permutation_of_all_windows():
  stream = np.arange(1, 10 * 4 + 2, dtype=np.uint8)  # 10 windows of 4 (+1) tokens
  ds = inputs.local_dataset(inputs.WindowSource(stream, 4, "toy"), "train", 2, seed=0,
                            rows=(0, 2))
  firsts = [int(b["inputs"][r, 0]) for b in ds[:10] for r in range(2)]
  e1, e2 = firsts[:10], firsts[10:]
  assert sorted(e1) == sorted(e2) == list(range(1, 41, 4))
  assert e1 != e2


@pytest.mark.parametrize("split", ["train", "validation"])
def test_processes_take_contiguous_rows_of_each_global_batch(cfg, split):
  whole = take(inputs.Batches(cfg, split, 8, process_index=0, process_count=1), 3)
  parts = [take(inputs.Batches(cfg, split, 8, process_index=p, process_count=4), 3)
           for p in range(4)]
  for step in range(3):
    for k in ("inputs", "targets"):
      joined = np.concatenate([parts[p][step][k] for p in range(4)])
      np.testing.assert_array_equal(joined, whole[step][k])


def test_worker_processes_give_the_same_batches_and_resume(cfg):
  mp_cfg = DataConfig(source="stdlib", data_dir=cfg.data_dir, seq_len=SEQ, seed=3, worker_count=2)
  want = take(inputs.Batches(cfg, "train", 8), 4)
  it = inputs.Batches(mp_cfg, "train", 8)  # one spawn of workers: rewind instead of a new one
  try:
    assert_same(take(it, 2), want[:2])
    state = json.loads(json.dumps(it.get_state()))
    assert_same(take(it, 2), want[2:])
    it.set_state(state)
    assert_same(take(it, 2), want[2:])
  finally:
    it.close()


def test_global_batch_not_divisible_by_process_count(cfg):
  with pytest.raises(ValueError, match=r"global batch 10 is not divisible by the process count 4"):
    inputs.Batches(cfg, "train", 10, process_index=0, process_count=4)


def test_global_batch_not_divisible_by_the_mesh(cfg):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match="global batch 12 does not split evenly"):
    inputs.Batches(cfg, "train", 12, NamedSharding(mesh, P("data")))


def test_global_arrays_on_an_8_device_mesh(cfg):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  sharding = NamedSharding(mesh, P("data"))
  batch = next(inputs.Batches(cfg, "train", 16, sharding))
  plain = take(inputs.Batches(cfg, "train", 16), 1)[0]
  for k in ("inputs", "targets"):
    arr = batch[k]
    assert arr.shape == (16, SEQ) and arr.sharding == sharding
    assert {s.data.shape for s in arr.addressable_shards} == {(2, SEQ)}
    np.testing.assert_array_equal(np.asarray(arr), plain[k])


def test_eval_batches_are_the_same_every_time(cfg):
  a = inputs.eval_batches(cfg, 8, 3)
  assert len(a) == 3
  assert_same([{k: np.asarray(v) for k, v in b.items()} for b in a],
              [{k: np.asarray(v) for k, v in b.items()} for b in inputs.eval_batches(cfg, 8, 3)])


# --- other sources ------------------------------------------------------------------------

def test_missing_tfds_dataset_says_what_and_how(tmp_path):
  for name in ("no_such_dataset_xyz", "mnist"):  # unknown; registered but not prepared
    cfg = DataConfig(source=f"tfds:{name}", data_dir=str(tmp_path))
    with pytest.raises(inputs.MissingDatasetError,
                       match=rf"'{name}'.*data_dir='{re.escape(str(tmp_path))}'.*tfds build {name}"):
      inputs.Batches(cfg, "train", 8)


class ShardaxTinyTexts(tfds.core.GeneratorBasedBuilder):
  """A tiny array_record dataset with train/test splits and a non-default text field."""
  VERSION = tfds.core.Version("1.0.0")
  code_path = None

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, disable_shuffling=True,
                                 features=tfds.features.FeaturesDict({"body": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(0, 40), "test": self._generate_examples(40, 50)}

  def _generate_examples(self, lo, hi):
    for i in range(lo, hi):
      yield i, {"body": f"document {i}: " + "abc" * i}


def test_any_prepared_tfds_dataset_reads_by_text_key(tmp_path):
  ShardaxTinyTexts(data_dir=str(tmp_path), file_format="array_record").download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  cfg = DataConfig(source="tfds:shardax_tiny_texts", data_dir=str(tmp_path), text_key="body",
                   seq_len=16)
  val = inputs.split_tokens(cfg, "validation")  # no 'validation' split: falls back to 'test'
  assert inputs.decode(val).startswith("document 40: abcabc")
  assert next(inputs.Batches(cfg, "train", 4))["inputs"].shape == (4, 16)
  with pytest.raises(KeyError, match="no field 'text'"):
    inputs.split_tokens(DataConfig(source="tfds:shardax_tiny_texts", data_dir=str(tmp_path)),
                        "train")


def test_synthetic_is_deterministic_learnable_and_needs_no_files(tmp_path):
  cfg = DataConfig(source="synthetic", data_dir=str(tmp_path / "absent"), seq_len=64, seed=1)
  a = take(inputs.Batches(cfg, "train", 8, vocab_size=100), 2)
  assert_same(a, take(inputs.Batches(cfg, "train", 8, vocab_size=100), 2))
  x = a[0]["inputs"]
  assert x.shape == (8, 64) and x.min() >= 1 and x.max() < 100
  np.testing.assert_array_equal(x[:, 1:], a[0]["targets"][:, :-1])
  # Each row repeats a motif of period 2..16, so later tokens can be copied from context.
  assert all(any(np.array_equal(row[p:], row[:-p]) for p in range(2, 17)) for row in x)
  val = take(inputs.Batches(cfg, "validation", 8, vocab_size=100), 1)[0]["inputs"]
  assert not np.array_equal(val, x)
  assert not os.path.exists(tmp_path / "absent")


def test_default_path_never_imports_tensorflow(data_dir):
  code = ("import sys; from shardax.configs.schema import DataConfig; "
          "from shardax.trainer.data import inputs; "
          f"next(inputs.Batches(DataConfig(data_dir={data_dir!r}, seq_len=8), 'train', 2)); "
          "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
