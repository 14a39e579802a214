"""Preparation throughput (MB of text per second) with 1 tokenizing process and with all
cores, on a generated JSON-lines corpus, for the byte tokenizer and a SentencePiece one
(docs/results/data.md records these figures).

  nice -n 10 .venv/bin/python benchmarks/prepare_throughput.py [--mb 12] [--processes 1 2]

Each run prepares into a fresh data dir (nothing reused). Two figures, best of --repeats
runs: text bytes over the wall time of tokenizing and writing all shards (the manifest's
`bytes_per_s`: a pool pays its start-up, one fork server importing the package, ~2 s),
and over the seconds each process spent on its own shards (`bytes_per_s_per_process`).
"""
import argparse
import json
import os
import tempfile

import numpy as np

from shardax.configs.data import DataConfig
from shardax.trainer.data import preparation, tokenizers


def corpus(root: str, mb: float, files: int = 8) -> str:
  rng = np.random.default_rng(0)
  words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9)))
                    for _ in range(5000)])
  os.makedirs(root, exist_ok=True)
  per_file = int(mb * 1e6 / files)
  for f in range(files):
    with open(os.path.join(root, f"part{f}.jsonl"), "w") as out:
      size = 0
      while size < per_file:
        line = json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(50, 400))))}) + "\n"
        out.write(line)
        size += len(line)
  return f"files:{root}/*.jsonl"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mb", type=float, default=12.0)
  ap.add_argument("--processes", type=int, nargs="+", default=[1, os.cpu_count() or 1])
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args()
  root = tempfile.mkdtemp()
  source = corpus(os.path.join(root, "corpus"), args.mb)
  spm_prefix = os.path.join(root, "spm")
  sample = (json.loads(line)["text"] for line in open(os.path.join(root, "corpus", "part0.jsonl")))
  tokenizers.train_sentencepiece(sample, 2000, spm_prefix, max_bytes=1_000_000)
  print(f"corpus: {args.mb:.0f} MB of JSON lines in 8 files; {os.cpu_count()} cores")
  for tok in ("byte", f"spm:{spm_prefix}.model"):
    for n in args.processes:
      wall = per = 0.0
      for r in range(args.repeats):
        cfg = DataConfig(source=source, data_dir=os.path.join(root, f"d-{tok[:4]}-{n}-{r}"), tokenizer=tok)
        m = preparation.prepare(cfg, processes=n).manifest
        if m["bytes_per_s"] > wall:
          wall, per = m["bytes_per_s"] / 1e6, m["bytes_per_s_per_process"] / 1e6
      label = "byte" if tok == "byte" else "spm (2,000 pieces)"
      print(f"{label:>20}: {n} process(es): {wall:6.2f} MB/s wall (pool start-up included), "
            f"{per:.2f} MB/s inside each process")


if __name__ == "__main__":
  main()
