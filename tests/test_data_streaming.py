"""Per-host streaming: disjoint shards per reader, memory that does not grow with the
corpus, and evaluation that covers the whole validation split once."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardax.configs.data import DataConfig
from shardax.configs.schema import TrainConfig
from shardax.trainer.data import inputs, preparation, streaming

WORDS = [f"w{i:03d}" for i in range(1000)]


def write_jsonl(root, docs, per_file=2500, seed=0, words_per_doc=330):
  """`docs` JSONL documents (~2 KB each, numbered so each is unique) in files of `per_file`."""
  os.makedirs(root, exist_ok=True)
  rng = np.random.default_rng(seed)
  for f in range(0, docs, per_file):
    with open(os.path.join(root, f"part{f // per_file:04d}.jsonl"), "w") as out:
      for i in range(f, min(f + per_file, docs)):
        out.write(json.dumps({"text": f"doc {i}: " + " ".join(rng.choice(WORDS, words_per_doc))}) + "\n")
  return f"files:{root}/*.jsonl"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
  d = tmp_path_factory.mktemp("stream")
  source = write_jsonl(str(d / "corpus"), 400, per_file=100, words_per_doc=20)
  return DataConfig(source=source, data_dir=str(d / "data"), seq_len=64, num_shards=4,
                    validation_fraction=0.25)


def doc_keys(ds):
  return [ds[i].tobytes() for i in range(len(ds))]


@pytest.mark.parametrize("readers", [2, 3])  # 2 divides the 4 shards; 3 does not
def test_readers_get_disjoint_documents_that_together_are_the_whole_split(small, readers):
  prepared = preparation.prepare(small)
  for split in ("train", "validation"):
    whole = doc_keys(streaming.local_documents(prepared, split, 0, 1))
    parts = [doc_keys(streaming.local_documents(prepared, split, r, readers)) for r in range(readers)]
    assert len(set(whole)) == len(whole) == prepared.split_counts(split)["documents"]
    for a in range(readers):
      for b in range(a + 1, readers):
        assert not set(parts[a]) & set(parts[b])
    assert sorted(k for p in parts for k in p) == sorted(whole)
  paths = prepared.shard_paths("train")
  assert streaming.reader_files(paths, 1, 2) == (paths[1::2], True)  # opens only its own files
  assert streaming.reader_files(paths, 1, 3) == (paths, False)


def test_two_processes_together_read_what_one_process_reads(small):
  """Simulated processes (process_index/count): disjoint rows of the global batch, each
  from its own shards; over the validation split their targets are one process's."""
  def targets(**kw):
    batches = list(inputs.iter_eval_batches(small, 8, None, **kw))
    return batches, np.sort(np.concatenate([np.asarray(b["targets"])[np.asarray(b["loss_mask"]) > 0]
                                            for b in batches]))
  one, t1 = targets(process_index=0, process_count=1)
  p0, t0 = targets(process_index=0, process_count=2)
  p1, tb = targets(process_index=1, process_count=2)
  assert np.asarray(p0[0]["inputs"]).shape == (4, 64)
  np.testing.assert_array_equal(np.sort(np.concatenate([t0, tb])), t1)
  train0 = next(inputs.Batches(small, "train", 8, process_index=0, process_count=2))
  train1 = next(inputs.Batches(small, "train", 8, process_index=1, process_count=2))
  assert not np.array_equal(np.asarray(train0["inputs"]), np.asarray(train1["inputs"]))


def test_eval_covers_the_whole_validation_split_once(small):
  counts = preparation.prepare(small).split_counts("validation")
  batches = list(inputs.iter_eval_batches(small, 8))
  mask = sum(float(np.asarray(b["loss_mask"]).sum()) for b in batches)
  assert mask == counts["tokens"] + counts["documents"]  # every token and every end, once
  # No batch without a real token: the eval stops when the last reader runs out.
  assert all(float(np.asarray(b["loss_mask"]).sum()) > 0 for b in batches)
  few = list(inputs.iter_eval_batches(small, 8, 2))
  assert len(few) == 2
  for k in few[0]:
    np.testing.assert_array_equal(np.asarray(few[0][k]), np.asarray(batches[0][k]))
  assert inputs.targets_per_byte(small) == (counts["tokens"] + counts["documents"]) / counts["bytes"]


RSS_SCRIPT = """
import json, resource, sys, time
from shardax.configs.data import DataConfig
from shardax.configs.schema import TrainConfig
from shardax.trainer.data import preparation, streaming

def status_mb(key):
  for line in open("/proc/self/status"):
    if line.startswith(key + ":"):
      return int(line.split()[1]) / 1024

with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM): imports are not data
  f.write("5")
baseline = status_mb("VmRSS")
cfg = DataConfig(source=sys.argv[1], data_dir=sys.argv[2], seq_len=256, num_shards=8)
t = time.perf_counter()
prepared = preparation.prepare(cfg)
seconds = time.perf_counter() - t
train = iter(streaming.local_batches([prepared], "train", 256, 8, 0, 0, 1))
for _ in range(300):
  next(train)
val = sum(int(b["loss_mask"].sum()) for b in streaming.local_batches([prepared], "validation", 256, 8, 0, 0, 1))
mb = sum(prepared.split_counts(s)["bytes"] for s in ("train", "validation")) / 1e6
print(json.dumps({"peak_rss_mb": status_mb("VmHWM"), "after_imports_mb": baseline,
                  "corpus_mb": mb, "prepare_s": seconds, "mb_per_s": mb / seconds, "val_targets": val}))
"""


def measure(source, data_dir):
  """Peak RSS of a fresh process that prepares `source` and reads 300 train batches and
  the whole validation split."""
  proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, source, data_dir], capture_output=True,
                        text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
  """1x (5 MB) vs 10x (50 MB) corpus: preparing and reading change peak RSS by < 20%."""
  one = measure(write_jsonl(str(tmp_path / "x1"), 2500), str(tmp_path / "d1"))
  ten = measure(write_jsonl(str(tmp_path / "x10"), 25000), str(tmp_path / "d10"))
  print(f"\n1x: {one}\n10x: {ten}")
  assert 9 < ten["corpus_mb"] / one["corpus_mb"] < 11
  assert ten["val_targets"] > 5 * one["val_targets"]
  assert abs(ten["peak_rss_mb"] - one["peak_rss_mb"]) < 0.2 * one["peak_rss_mb"]


def test_periodic_eval_weighs_every_validation_token_and_reports_bits_per_byte(small):
  """The loop's eval over the whole split: weight = every target token, bits per byte from
  the loss and the manifest's bytes."""
  import math
  import jax
  from shardax import configs
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import loop, state as state_lib
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.d_ff=64",
      "model.max_len=64", "data.seq_len=64", "train.global_batch=8", "mesh.ici=(8, 1)",
      f"data.source={small.source!r}", f"data.data_dir={small.data_dir!r}", "data.num_shards=4",
      "data.validation_fraction=0.25", "train.eval_batches=None"])
  exp = configs.build(cfg)
  assert TrainConfig().eval_batches is None  # the default: the whole validation split
  setup = state_lib.create(exp, make_mesh(exp.mesh))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    state = state_lib.init_fn(setup)(jax.random.key(0))
    e = loop._eval(loop.eval_sums_fn(setup), state["params"], loop._eval_batches(setup),
                   inputs.targets_per_byte(exp.data))
  counts = preparation.prepare(exp.data).split_counts("validation")
  assert e["eval_weight"] == counts["tokens"] + counts["documents"]
  assert abs(e["eval_loss"] - math.log(256)) < 0.5  # an untrained model: about uniform
  np.testing.assert_allclose(e["eval_bits_per_byte"],
                             e["eval_loss"] * e["eval_weight"] / counts["bytes"] / math.log(2), rtol=1e-6)
  assert "whole validation split" in loop.format_eval(0, 1, exp, e)
