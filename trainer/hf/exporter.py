"""The latest checkpoint of an `hf:DIR` job -> a Hugging Face model directory.

Writes config.json (the family's adapter, models/hf/), the weights as safetensors (one file, or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` above the shard size),
and the source directory's tokenizer files. Tensors are fetched one at a time (one layer,
or one layer's expert, of a stacked leaf), relaid out (models/hf/common.py) and streamed into the file, so the
host holds about one tensor beyond the restored params. The weights are written in the
source model's dtype (config.json `dtype`/`torch_dtype`), else the param dtype: a model
imported and exported untouched comes back bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

import jax
import ml_dtypes
import numpy as np
from absl import logging

from shardax.configs.schema import ConfigError, Experiment
from shardax.models import hf as hf_models
from shardax.models.hf import common
from shardax.trainer.hf import importer, safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _order(name: str) -> tuple:
  """Hugging Face's natural order: embeddings, layers by index, final norm, head."""
  natural = tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"(\d+)", name))
  if name.startswith("model.layers."):   # by layer, then expert: experts.2 before experts.10
    return (1, natural)
  return (0 if "embed_tokens" in name else 2 if name.startswith("model.") else 3, natural)


def export_params(params, model_cfg, arch: str, out_dir: str, dtype, max_shard_bytes: int) -> list[str]:
  """Writes `params` (our tree, jax or numpy leaves) as safetensors files in `out_dir`, with
  the tensor names of architecture `arch` (a short name, models/hf `architecture`)."""
  plan = hf_models.leaves(params, model_cfg, arch)
  arrays = jax.tree_util.tree_leaves(params)
  where: dict[str, list[tuple[hf_models.Leaf, object, tuple[int, ...]]]] = {}
  for (_, leaf), arr in zip(plan, arrays):
    for i, name in enumerate(leaf.hf_names):   # a fused tensor: one entry per leaf it holds a part of
      where.setdefault(name, []).append((leaf, arr, leaf.index(i) if leaf.stacked else ()))
  for copy, source in hf_models.copies(model_cfg, arch).items():   # the shared tensor under another name too
    where[copy] = where[source]
  dtype = np.dtype(dtype)
  specs = [(n, where[n][0][0].hf_shape, dtype) for n in sorted(where, key=_order)]

  def tensor(name: str) -> np.ndarray:
    parts = [(leaf, leaf.to_hf(np.asarray(arr[i] if i else arr))) for leaf, arr, i in where[name]]
    return common.join(parts).astype(dtype, copy=False)

  os.makedirs(out_dir, exist_ok=True)
  return safetensors.write_model(out_dir, specs, tensor, max_shard_bytes)


def run(exp: Experiment, job_dir: str, out_dir: str, max_shard_bytes: int = 4 << 30) -> dict:
  """--mode=export: the latest checkpoint of `job_dir` as a Hugging Face model in `out_dir`."""
  from shardax.sharding import make_mesh
  from shardax.trainer import checkpoint, model_setup
  if jax.process_count() > 1:
    raise ConfigError("--mode=export runs in one process (it gathers each tensor to the host)")
  source = importer.model_dir(exp)
  src_cfg = hf_models.read(source)
  arch = hf_models.architecture(src_cfg)
  adapter = hf_models.adapter_for(arch)
  adapter.check_exportable(exp.model, arch)
  dtype_name = src_cfg.get("dtype") or src_cfg.get("torch_dtype") or exp.model.param_dtype
  if dtype_name not in DTYPES:
    raise ConfigError(f"config.json dtype={dtype_name!r}: export writes one of {sorted(DTYPES)}")
  if os.path.abspath(out_dir) == os.path.abspath(source):
    raise ConfigError(f"--hf_out={out_dir} is the source model directory; export somewhere else")
  params, step = checkpoint.restore_params(model_setup.create(exp, make_mesh(exp.mesh)), job_dir)
  t0 = time.perf_counter()
  files = export_params(params, exp.model, arch, out_dir, DTYPES[dtype_name], max_shard_bytes)
  seconds = time.perf_counter() - t0
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump({**adapter.to_hf(exp.model, arch, src_cfg), "dtype": dtype_name}, f, indent=2, sort_keys=True)
  for name in TOKENIZER_FILES:
    if os.path.exists(os.path.join(source, name)):
      shutil.copy(os.path.join(source, name), os.path.join(out_dir, name))
  nbytes = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files if f.endswith(".safetensors"))
  line = (f"exported step {step} of {job_dir} to {out_dir}: {len(files)} file(s), {nbytes / 1e6:.1f} MB "
          f"in {seconds:.2f}s ({nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
  logging.info(line)
  print(line, file=sys.stderr, flush=True)
  return {"bytes": nbytes, "seconds": seconds, "files": files, "step": step}
