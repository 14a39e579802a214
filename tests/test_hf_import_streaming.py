"""A sharded Hugging Face import reads, in each process, only what that process's devices hold.

In one process every tensor is read (whole, or the rows that hold all of it). With a mesh axis
split across real `jax.distributed` processes, a tensor no device of a process holds a part of
(a layer or an expert of a stacked leaf) is not read there, and a tensor split on its first
dim (vocab rows) is read as its rows: each process reads its share of the file's bytes. The
checkpoint the processes write together is the one-process import's, bit for bit.
"""

import json
import os
import re
import sys

import jax
import numpy as np
import pytest

import clitools as cli
from shardax import configs
from shardax.models import hf as hf_models
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import checkpoint as ckpt_lib
from shardax.trainer import model_setup
from shardax.trainer.hf import importer, safetensors

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


def experiment(arch, *overrides):
  cfg = configs.get(f"hf:{os.path.join(FIXTURES, arch)}")
  configs.apply_overrides(cfg, list(overrides))
  return configs.build(cfg)


def test_reader_reads_rows_as_one_range():
  """rows=(a, b) gives rows a..b-1 of the tensor's first dim, counting only their bytes."""
  r = safetensors.Reader(os.path.join(FIXTURES, "mixtral"))
  assert r.bytes_read == 0 and r.nbytes == sum(r.get(n).nbytes for n in r.names())
  for name in ("model.embed_tokens.weight", "model.layers.1.block_sparse_moe.experts.2.w2.weight",
               "model.norm.weight"):
    whole = r.get(name)
    before = r.bytes_read
    part = r.get(name, rows=(3, 17))
    assert part.tobytes() == whole[3:17].tobytes()
    assert r.bytes_read - before == whole[3:17].nbytes
  with pytest.raises(safetensors.SafetensorsError, match=r"rows=\(5, 700\) is not a range of its first dim"):
    r.get("model.embed_tokens.weight", rows=(5, 700))


def halves(shape):
  """Per dim of `shape` (of size >= 2): the full bounds with that dim cut to its second half."""
  full = [(0, n) for n in shape]
  return [(j, tuple(full[:j] + [(n // 2, n)] + full[j + 1:])) for j, n in enumerate(shape) if n >= 2]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "mixtral", "llama4", "gpt_oss"])
def test_a_part_read_is_the_whole_tensors_part(arch):
  """For every leaf of a family (kernels with 1 or 2 input dims, embeddings, biases, norms, fused
  expert tensors cut into gate/up parts, by columns or interleaved) and a block cut on each of its
  dims: the part read equals that block of the whole tensor in our layout, and only a cut on the
  dim that is the tensor's first (`row_dim`) reads less: exactly the rows of the block."""
  exp = experiment(arch, "mesh.ici=(1, 1)")
  setup = model_setup.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  src = os.path.join(FIXTURES, arch)
  reader = safetensors.Reader(src)
  plan = hf_models.leaves(setup.abstract_params, exp.model, hf_models.architecture(hf_models.read(src)))
  kinds, row_reads = set(), 0
  for _, leaf in plan:
    name = leaf.hf_names[-1]
    whole = leaf.to_ours(reader.get(name))
    rd = importer.row_dim(leaf)
    kinds.add((leaf.in_dims, leaf.part is not None, rd is not None))
    for j, block in halves(leaf.one_shape):
      before = reader.bytes_read
      t, d, lo = importer.read_part(leaf, reader, name, [block])
      got = t[tuple(slice(a - lo, b - lo) if i == d else slice(a, b) for i, (a, b) in enumerate(block))]
      want = whole[tuple(slice(a, b) for a, b in block)]
      assert got.shape == want.shape and got.tobytes() == want.tobytes(), (leaf.path, block)
      read = reader.bytes_read - before
      if rd is not None and j == rd[0]:
        assert d == j and read == reader.get(name).nbytes // leaf.one_shape[j] * (block[j][1] - block[j][0]), leaf.path
        row_reads += 1
      else:
        assert d is None and read == reader.get(name).nbytes, (leaf.path, block)
  assert row_reads >= 3, kinds
  print(arch, sorted(kinds, key=str), row_reads)


# A Mixtral (2 layers, 4 experts, vocab 384) on a (data 2, model 4) mesh: one process, or two
# with the data axis across them (4 devices each). Its experts are wider than the fixture's
# (d_ff 512), so that they hold ~90% of the bytes, as in real MoE checkpoints.
LAYERS_AND_VOCAB = ("(('batch', 'data'), ('layers', 'data'), ('vocab', 'data'), ('expert', 'model'))",
                    lambda name: ("layer", "rows") if ".layers." in name else
                    ("rows", "rows") if name in ("model.embed_tokens.weight", "lm_head.weight") else None)
EXPERTS = ("(('batch', 'data'), ('expert', 'data'))",
           lambda name: ("expert", None) if ".experts." in name else None)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
  """The Mixtral fixture's config and tensors with d_ff 96 -> 512, random weights."""
  d = str(tmp_path_factory.mktemp("moe"))
  src = os.path.join(FIXTURES, "mixtral")
  cfg = hf_models.read(src)
  assert cfg["intermediate_size"] == 96 and 96 not in (cfg["hidden_size"], cfg["vocab_size"])
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({**cfg, "intermediate_size": 512}, f)
  r = safetensors.Reader(src)
  specs = [(n, tuple(512 if k == 96 else k for k in r.shape(n)), np.dtype(np.float32)) for n in r.names()]
  rng = np.random.default_rng(0)
  safetensors.write_model(d, specs, lambda n: rng.standard_normal(dict((s[0], s[1]) for s in specs)[n],
                                                                  np.float32), max_bytes=1 << 20)
  return d


def imports_in_two_processes(src, job, rules, tmp_path) -> list[int]:
  """Bytes each of two processes read importing `src` into `job` together."""
  port = cli.free_port()
  args = [f"--exp=hf:{src}", f"--job_dir={job}", "--mode=import"]
  for s in ("mesh.dcn=(2, 1)", "mesh.ici=(1, 4)", "mesh.num_cpu_devices=4", f"sharding.rules={rules}"):
    args += ["--set", s]
  procs = [cli.start([sys.executable, "-m", "shardax.main", *args, f"--coordinator_address=127.0.0.1:{port}",
                      "--num_processes=2", f"--process_id={i}"], devices=4, log=tmp_path / f"p{i}.log")
           for i in range(2)]
  codes = [cli.wait_or_kill(p, timeout=300) for p in procs]
  logs = [open(tmp_path / f"p{i}.log").read() for i in range(2)]
  assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
  out = []
  for i, log in enumerate(logs):
    m = re.search(rf"process {i} of 2 read ([\d,]+) of the checkpoint's ([\d,]+) bytes", log)
    assert m, log[-2000:]
    out.append(int(m.group(1).replace(",", "")))
  return out


def expected_share(reader, split, process) -> int:
  """The bytes `process` of 2 holds a part of: a layer's tensors in its half of the layers, an
  expert's in its half of the experts, rows: half of the tensor; the rest whole."""
  total = 0
  for name in reader.names():
    size = reader.get(name).nbytes
    how = split(name)
    if how is None:
      total += size
    elif how[0] == "layer":
      total += size if int(name.split(".")[2]) == process else 0   # 2 layers: layer p on process p
    elif how[0] == "expert":
      total += size if int(name.split(".experts.")[1].split(".")[0]) // 2 == process else 0
    else:
      total += size // 2
  return total


@pytest.mark.slow   # two process starts, two imports and a restore: ~40-90 s on 2 busy cores
@pytest.mark.parametrize("rules,split", [LAYERS_AND_VOCAB, EXPERTS], ids=["layers_and_vocab", "experts"])
def test_two_processes_read_their_share_and_write_the_one_process_checkpoint(rules, split, moe_dir, tmp_path):
  """Layers (and vocab rows) or experts split across 2 processes: each reads exactly the
  tensors (rows) its devices hold a part of, under 0.6 of the file; one process reads it all.
  The params of the two checkpoints are equal bit for bit."""
  cfg = configs.get(f"hf:{moe_dir}")
  configs.apply_overrides(cfg, ["mesh.ici=(2, 4)", f"sharding.rules={rules}"])
  exp = configs.build(cfg)
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  summary = importer.run(exp, one)
  assert summary["bytes_read"] == summary["checkpoint_bytes"]   # one process holds every part
  read = imports_in_two_processes(moe_dir, two, rules, tmp_path)
  reader = safetensors.Reader(moe_dir)
  assert read == [expected_share(reader, split, p) for p in (0, 1)]
  assert max(read) < 0.6 * reader.nbytes, (read, reader.nbytes)
  setup = model_setup.create(exp, make_mesh(exp.mesh))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    a, step_a = ckpt_lib.restore_params(setup, one)
    b, step_b = ckpt_lib.restore_params(setup, two)
  assert step_a == step_b == 0
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), path
