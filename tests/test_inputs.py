"""The data pipeline: corpus splits, windows, grain batching, sharding, resumption."""

import dataclasses
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

from shardax.configs.data import DataConfig
from shardax.trainer.data import inputs, layout, packing, preparation, sources, streaming, tokenizers

SEQ = 32


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """One prepared stdlib corpus (byte tokenizer) for the whole module."""
  d = str(tmp_path_factory.mktemp("datasets"))
  preparation.prepare(DataConfig(source="stdlib", data_dir=d))
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


# --- the stdlib corpus ---------------------------------------------------------------

def test_splits_are_disjoint_cover_the_stdlib_and_follow_the_path_hash(cfg):
  files = sources.stdlib_files(sources.stdlib_root())
  val = [p for p in files if sources.split_of(p, 0.05) == "validation"]
  assert len(files) > 500 and not any("site-packages" in p for p in files)
  assert 0.01 < len(val) / len(files) < 0.15
  counts = {s: preparation.prepare(cfg).split_counts(s) for s in ("train", "validation")}
  assert counts["validation"]["documents"] == len(val)
  assert counts["train"]["documents"] + len(val) == len(files)
  first_val = next(sources.documents(cfg, "validation"))
  assert first_val == sources.read_source(os.path.join(sources.stdlib_root(), val[0]))


def test_prepared_data_is_reused_and_identical_when_prepared_again(cfg, tmp_path):
  first = preparation.prepare(cfg)
  stamp = os.path.getmtime(os.path.join(first.directory, "manifest.json"))
  preparation._prepare.cache_clear()  # a new process: reads the manifest, writes nothing
  again = preparation.prepare(cfg)
  assert again.directory == first.directory
  assert os.path.getmtime(os.path.join(again.directory, "manifest.json")) == stamp
  other = preparation.prepare(dataclasses.replace(cfg, data_dir=str(tmp_path)))
  for split in ("train", "validation"):
    for a, b in zip(first.shard_paths(split), other.shard_paths(split)):
      assert open(a, "rb").read() == open(b, "rb").read()


def test_encode_decode_roundtrip():
  tok = tokenizers.ByteTokenizer()
  text = "def f(x):\n  return 'héllo ✓'\n"
  ids = tok.encode(text)
  assert min(ids) > 0 and max(ids) < 256
  assert tok.decode(ids) == text
  assert tok.decode([0] + ids + [0, 300]) == text  # end-of-document / padded ids dropped


# --- batches -------------------------------------------------------------------------

def test_validation_batches_are_the_packed_documents_in_order(cfg):
  batch = take(inputs.Batches(cfg, "validation", 8), 1)[0]
  assert set(batch) == set(packing.FIELDS)
  assert batch["inputs"].shape == (8, SEQ) and batch["inputs"].dtype == np.int32
  prepared = preparation.prepare(cfg)
  # gcd(8 shards, batch 8) = 8 readers of one row each: row r is reader r's first window.
  assert layout.reader_layout(8, 8, (0, 8)) == layout.ReaderLayout(8, tuple(range(8)), 1, (0, 8))
  for r in range(8):
    docs = streaming.local_documents(prepared, "validation", r, 8)
    want = packing.pack_documents([docs[i] for i in range(min(3, len(docs)))], SEQ,
                                  tokenizers.SEPARATOR_ID)
    for k in packing.FIELDS:
      np.testing.assert_array_equal(batch[k][r], want[k][0])
  docs = streaming.local_documents(prepared, "validation", 0, 1)
  # Record 0 of shard 0 is the first validation document of its units (unit j -> shard j % 8).
  units = sources.units(cfg, 8)[0::8]
  first = next(t for u in units for s, t in sources.unit_documents(cfg, u) if s == "validation")
  assert tokenizers.ByteTokenizer().decode(docs[0]) == first


def test_the_global_batch_does_not_depend_on_the_process_count(cfg):
  """Readers are fixed by the config (gcd(num_shards, batch)), so 2 or 4 processes
  together give exactly one process's batches, train and validation."""
  for split in ("train", "validation"):
    whole = take(inputs.Batches(cfg, split, 8, process_index=0, process_count=1), 3)
    for count in (2, 4):
      parts = [take(inputs.Batches(cfg, split, 8, process_index=p, process_count=count), 3)
               for p in range(count)]
      for step in range(3):
        for k in packing.FIELDS:
          joined = np.concatenate([parts[p][step][k] for p in range(count)])
          np.testing.assert_array_equal(joined, whole[step][k])


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


def test_each_epoch_is_a_fresh_permutation_of_all_documents(cfg):
  prepared = preparation.prepare(cfg)
  n = prepared.split_counts("validation")["documents"]
  docs = streaming.local_documents(prepared, "validation", 0, 1)
  shuffled = docs.shuffle(seed=0).repeat()  # what streaming.local_batches does for train
  key = lambda d: d.tobytes()
  e1, e2 = [key(shuffled[i]) for i in range(n)], [key(shuffled[n + i]) for i in range(n)]
  assert sorted(e1) == sorted(e2) == sorted(key(docs[i]) for i in range(n))
  assert e1 != e2


def test_worker_processes_resume_exactly(cfg):
  """Worker processes each pack their own slice of the documents (so the windows differ
  from one process's), but a run with workers still resumes exactly."""
  # 2 shards: 2 readers with one worker process each.
  mp_cfg = DataConfig(source="stdlib", data_dir=cfg.data_dir, seq_len=SEQ, seed=3, worker_count=2,
                      num_shards=2)
  it = inputs.Batches(mp_cfg, "train", 8)  # one spawn of workers: rewind instead of a new one
  try:
    take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    want = take(it, 2)
    it.set_state(state)
    assert_same(take(it, 2), want)
    assert want[0]["loss_mask"].sum() == 8 * SEQ
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
  assert set(batch) == set(packing.FIELDS)
  for k in packing.FIELDS:
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
                   seq_len=16, num_shards=2)
  val = next(sources.documents(cfg, "validation"))  # no 'validation' split: falls back to 'test'
  assert val == "document 40: " + "abc" * 40
  assert next(inputs.Batches(cfg, "train", 4))["inputs"].shape == (4, 16)
  with pytest.raises(KeyError, match="no field 'text'"):
    inputs.Batches(DataConfig(source="tfds:shardax_tiny_texts", data_dir=str(tmp_path)), "train", 4)


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
  code = ("import sys; from shardax.configs.data import DataConfig; "
          "from shardax.trainer.data import inputs; "
          f"next(inputs.Batches(DataConfig(data_dir={data_dir!r}, seq_len=8), 'train', 2)); "
          "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
