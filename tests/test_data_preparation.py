"""Preparation once per job, in parallel, anywhere: processes that prepare the same source
at once agree on one prepared set, a process pool writes what one process writes, every
reader opens only its own shard files, and a gs:// data dir (the local GCS emulator)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardax.configs.data import DataConfig
from shardax.trainer.data import inputs, preparation, sources, store

WORDS = [f"w{i:03d}" for i in range(300)]


def write_corpus(root, files=4, docs=60, seed=0):
  os.makedirs(root, exist_ok=True)
  rng = np.random.default_rng(seed)
  for f in range(files):
    with open(os.path.join(root, f"part{f}.jsonl"), "w") as out:
      for i in range(docs):
        out.write(json.dumps({"text": f"{f}.{i} " + " ".join(rng.choice(WORDS, 30))}) + "\n")
  return f"files:{root}/*.jsonl"


PREPARE = """
import sys
from shardax.configs.data import DataConfig
from shardax.trainer.data import preparation
cfg = DataConfig(source=sys.argv[1], data_dir=sys.argv[2], num_shards=8, validation_fraction=0.2)
p = preparation.prepare(cfg, process_index=int(sys.argv[3]), process_count=int(sys.argv[4]))
print("DIR", p.directory, p.manifest["splits"]["train"]["documents"])
"""


def _race(source, data_dir, layouts):
  """Starts one preparer per (index, count) at the same time; their (stdout, stderr)."""
  procs = [subprocess.Popen([sys.executable, "-c", PREPARE, source, data_dir, str(i), str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i, n in layouts]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err
  return outs


def test_two_processes_preparing_at_once_make_one_prepared_set(tmp_path):
  """Process 0 and 1 of a job, started together: each writes only its shards (its share
  of the input), both return the one committed manifest; then two independent preparers
  (each 0 of 1) racing on a fresh data dir also end with one set, identical bytes."""
  source = write_corpus(str(tmp_path / "corpus"))
  outs = _race(source, str(tmp_path / "job"), [(0, 2), (1, 2)])
  dirs = {o.split("DIR ")[1].split()[0] for o, _ in outs}
  assert len(dirs) == 1
  (directory,) = dirs
  for i, (_, err) in enumerate(outs):
    assert f"(4 of 8 shards, process {i} of 2)" in err   # each wrote half the shards
  names = sorted(os.listdir(directory))
  assert names.count("manifest.json") == 1 and not [n for n in names if ".tmp-" in n]
  assert len([n for n in names if n.endswith(".array_record")]) == 16
  cfg = DataConfig(source=source, data_dir=str(tmp_path / "job"), num_shards=8, validation_fraction=0.2)
  every = sum(1 for s in sources.SPLITS for _ in sources.documents(cfg, s))
  prepared = preparation._read(directory)
  assert sum(prepared.split_counts(s)["documents"] for s in sources.SPLITS) == every == 240
  # two independent jobs at once: one set, the same bytes as the cooperative one
  outs = _race(source, str(tmp_path / "two_jobs"), [(0, 1), (0, 1)])
  (other,) = {o.split("DIR ")[1].split()[0] for o, _ in outs}
  assert sorted(os.listdir(other)) == names
  for split in sources.SPLITS:
    for a, b in zip(prepared.shard_paths(split), preparation._read(other).shard_paths(split)):
      assert open(a, "rb").read() == open(b, "rb").read()


def test_a_process_pool_writes_what_one_process_writes(tmp_path):
  """Tokenizing on 2 worker processes gives the same shards as on 1: the output does not
  depend on how many processes (or hosts) made it."""
  source = write_corpus(str(tmp_path / "corpus"), files=2, docs=40)
  one = preparation.prepare(DataConfig(source=source, data_dir=str(tmp_path / "one"), num_shards=4), processes=1)
  two = preparation.prepare(DataConfig(source=source, data_dir=str(tmp_path / "two"), num_shards=4), processes=2)
  assert one.manifest["processes"] == 1 and two.manifest["processes"] == 2
  assert one.manifest["splits"] == two.manifest["splits"]
  for split in sources.SPLITS:
    for a, b in zip(one.shard_paths(split), two.shard_paths(split)):
      assert open(a, "rb").read() == open(b, "rb").read()


def _opened_files(obj, seen=None) -> set[str]:
  """The ArrayRecord files behind a grain iterator, found by walking its pipeline."""
  seen = set() if seen is None else seen
  if id(obj) in seen or isinstance(obj, (str, bytes, int, float, np.ndarray)) or obj is None:
    return set()
  seen.add(id(obj))
  if hasattr(obj, "paths") and type(obj).__name__ == "ArrayRecordDataSource":
    return {os.path.basename(p) for p in obj.paths}
  found = set()
  children = obj if isinstance(obj, (list, tuple)) else getattr(obj, "__dict__", {}).values()
  for child in children:
    if isinstance(child, (list, tuple)) or type(child).__module__.startswith(("grain", "shardax", "array_record")):
      found |= _opened_files(child, seen)
  return found


def test_four_processes_sixteen_shards_each_reader_opens_only_its_own_files(tmp_path):
  """16 shards, 4 processes, batch 16: 16 readers, 4 per process; process p's pipeline
  holds exactly shard files 4p..4p+3, and together they hold all 16."""
  source = write_corpus(str(tmp_path / "corpus"), files=2, docs=80)
  cfg = DataConfig(source=source, data_dir=str(tmp_path / "data"), num_shards=16, seq_len=16)
  preparation.prepare(cfg)
  seen = []
  for p in range(4):
    it = inputs.Batches(cfg, "train", 16, process_index=p, process_count=4)
    next(it)
    files = _opened_files(it.grain_iterator)
    it.close()
    assert files == {f"train-{k:05d}-of-00016.array_record" for k in range(4 * p, 4 * p + 4)}, (p, files)
    seen.append(files)
  assert len(set().union(*seen)) == 16


# --- a gs:// data dir (the local GCS emulator of test_cloud.py) ----------------------

from test_cloud import BUCKET, emulator  # noqa: E402,F401  (the fixture, reused)


def test_gs_data_dir_prepares_once_and_readers_copy_only_their_shards(emulator, tmp_path, monkeypatch):
  """Sources and data dir in a bucket: preparation reads the gs:// glob, commits the
  manifest with a create-if-absent precondition (a second create is refused), and a
  process copies into its local cache only the shard files its readers own."""
  env, fs = emulator
  from etils.epath import gpath
  gpath._is_tf_installed.cache_clear()   # epath decides its gs:// client once per process: let it
  # see EPATH_USE_TF=false (a test before this one may have asked while TensorFlow was allowed)
  for f in range(2):
    fs.pipe(f"{BUCKET}/corpus/part{f}.jsonl",
            "".join(json.dumps({"text": f"doc {f}.{i} " + "w " * 20}) + "\n" for i in range(40)).encode())
  monkeypatch.setattr(store, "CACHE_ROOT", str(tmp_path / "cache"))
  cfg = DataConfig(source=f"files:gs://{BUCKET}/corpus/*.jsonl", data_dir=f"gs://{BUCKET}/data",
                   num_shards=4, seq_len=16, validation_fraction=0.2)
  prepared = preparation.prepare(cfg)
  assert prepared.directory.startswith(f"gs://{BUCKET}/data/prepared/")
  fs.invalidate_cache()
  assert fs.exists(prepared.directory[len("gs://"):] + "/manifest.json")
  assert sum(prepared.split_counts(s)["documents"] for s in sources.SPLITS) == 80
  manifest = store.join(prepared.directory, "manifest.json")
  assert store.create_if_absent(manifest, b"{}") is False            # the precondition holds
  assert json.loads(store.read_bytes(manifest))["num_shards"] == 4   # and nothing was replaced
  assert store.create_if_absent(f"gs://{BUCKET}/probe/once", b"1") is True
  it = inputs.Batches(cfg, "train", 4, process_index=0, process_count=2)   # readers 0, 1 of 4
  batch = next(it)
  it.close()
  assert batch["inputs"].shape == (2, 16)
  cached = {n for _, _, names in os.walk(tmp_path / "cache") for n in names}
  assert {n for n in cached if n.startswith("train")} == \
      {"train-00000-of-00004.array_record", "train-00001-of-00004.array_record"}
