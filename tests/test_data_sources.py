"""files:GLOB sources (text, JSONL, Parquet) and their preparation into sharded ArrayRecord."""

import json
import os

import numpy as np
import pytest

from shardax.configs import ConfigError
from shardax.configs.data import DataConfig
from shardax.trainer.data import preparation, sources, streaming, tokenizers


def write_folder(root):
  """Two JSONL files (field 'body'), one Parquet file (column 'body'), one .txt file."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  os.makedirs(os.path.join(root, "sub"), exist_ok=True)
  docs = {}
  for f in range(2):
    rows = [{"body": f"jsonl {f} doc {i}: " + "x" * i, "n": i} for i in range(30)]
    with open(os.path.join(root, f"part{f}.jsonl"), "w") as out:
      out.write("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line is skipped
    docs[f"part{f}.jsonl"] = [r["body"] for r in rows]
  texts = [f"parquet doc {i} ✓" for i in range(25)]
  pq.write_table(pa.table({"body": texts, "n": list(range(25))}), os.path.join(root, "sub", "p.parquet"))
  docs["sub/p.parquet"] = texts
  with open(os.path.join(root, "sub", "notes.txt"), "w") as out:
    out.write("a whole text file is one document\n")
  docs["sub/notes.txt"] = ["a whole text file is one document\n"]
  return docs


@pytest.fixture
def folder(tmp_path):
  docs = write_folder(str(tmp_path / "corpus"))
  cfg = DataConfig(source=f"files:{tmp_path}/corpus/**/*", text_key="body", seq_len=16,
                   data_dir=str(tmp_path / "data"), validation_fraction=0.2, num_shards=4)
  return cfg, docs


def test_files_source_reads_every_format_and_splits_by_path_and_index(folder):
  cfg, docs = folder
  train, val = list(sources.documents(cfg, "train")), list(sources.documents(cfg, "validation"))
  everything = [d for path in sorted(docs) for d in docs[path]]
  assert sorted(train + val) == sorted(everything)
  assert 0 < len(val) < len(train)
  root = cfg.source[len("files:"):].split("**")[0]
  def key(path, i):   # JSON lines: "path@byte offset of the line"; others "path:index"
    if not path.endswith(".jsonl"):
      return f"{path}:{i}"
    with open(os.path.join(root, path), "rb") as f:
      lines = f.readlines()
    return f"{path}@{sum(len(x) for x in lines[:i])}"
  want_val = [d for path in sorted(docs) for i, d in enumerate(docs[path])
              if sources.split_of(key(path, i), 0.2) == "validation"]
  assert sorted(val) == sorted(want_val)  # the split is a stable hash of the document's key


def test_preparation_writes_shards_and_a_manifest_and_is_reused(folder, capfd):
  cfg, docs = folder
  prepared = preparation.prepare(cfg)
  m = prepared.manifest
  assert "prepared" in capfd.readouterr().err  # progress and throughput are reported
  assert m["tokenizer"] == "byte" and m["source"] == cfg.source and m["num_shards"] == 4
  total = sum(len(v) for v in docs.values())
  assert m["splits"]["train"]["documents"] + m["splits"]["validation"]["documents"] == total
  for split in sources.SPLITS:
    counts = prepared.split_counts(split)
    texts = list(sources.documents(cfg, split))
    assert counts["bytes"] == counts["tokens"] == sum(len(t.encode()) for t in texts)
    assert len(prepared.shard_paths(split)) == 4
    assert sum(s["documents"] for s in m["splits"][split]["shards"]) == counts["documents"]
    tok = tokenizers.ByteTokenizer()
    docs_back = streaming.local_documents(prepared, split, 0, 1)
    assert sorted(tok.decode(docs_back[i]) for i in range(len(docs_back))) == sorted(texts)
  # Reused: the same directory, nothing rewritten; a changed source: a new directory.
  preparation._prepare.cache_clear()
  assert preparation.prepare(cfg).directory == prepared.directory
  assert "prepared" not in capfd.readouterr().err
  with open(os.path.join(cfg.source[len("files:"):].split("**")[0], "sub", "notes.txt"), "a") as f:
    f.write("changed\n")
  preparation._prepare.cache_clear()
  assert preparation.prepare(cfg).directory != prepared.directory


def test_missing_text_key_and_empty_glob_say_what_to_fix(folder, tmp_path):
  cfg, _ = folder
  bad = DataConfig(source=cfg.source.replace("**/*", "*.jsonl"), data_dir=cfg.data_dir)
  with pytest.raises(KeyError, match=r"part0.jsonl at byte 0 has no field 'text'.*data.text_key"):
    preparation.prepare(bad)
  with pytest.raises(sources.MissingDatasetError, match="matches no files"):
    preparation.prepare(DataConfig(source=f"files:{tmp_path}/nothing/*.jsonl", data_dir=cfg.data_dir))
  with pytest.raises(ConfigError, match="files:GLOB"):
    DataConfig(source="file:/x")


def test_tokens_are_stored_compactly(folder):
  cfg, _ = folder
  prepared = preparation.prepare(cfg)
  assert prepared.dtype == np.uint16
  size = sum(os.path.getsize(p) for s in sources.SPLITS for p in prepared.shard_paths(s))
  tokens = sum(prepared.split_counts(s)["tokens"] for s in sources.SPLITS)
  files = 2 * cfg.num_shards
  assert size <= 2 * tokens + files * 128 * 1024  # <= 2 bytes a token (compressed) + block padding
