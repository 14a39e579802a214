"""A Hugging Face model directory -> the job's orbax checkpoint at step 0, tensor by tensor.

The params are laid out for the experiment's mesh first (abstract: shapes and shardings
from the rules, trainer/model_setup.py). Then each param leaf is filled from the checkpoint's
tensors: for every distinct shard this process holds, a buffer of the shard's shape; each
Hugging Face tensor (one layer, or one layer's expert, of a stacked leaf) is read, relaid out,
and its part copied into the buffers that cover it, then dropped. The buffers go to their
devices and become the sharded array. So the host holds its own shards plus about one tensor
(and its relaid view) at a time, never the whole model.

Each process reads only what its devices hold. A tensor none of whose parts this process
holds (a layer or expert of a stacked leaf split over a mesh axis whose devices are elsewhere)
is not read at all. Where the held blocks are a range of the dim of our layout that is the
Hugging Face tensor's first dim (the expert dim of a fused expert tensor, vocab rows of the
embedding, the out dim of a projection split over `mlp` or `heads`), only the rows covering
them are read (one read of their bytes). Otherwise (the split falls on the weight's input
columns, or the reader transforms tensors, e.g. dequantizes them) the whole tensor is read.
The params are the same, bit for bit, whatever each process reads.

The optimizer (trainer/state.py, built on the same model setup) then initializes its state
on the devices (jitted, born sharded) and the train state is saved as step 0.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding

from shardax.configs.schema import ConfigError, Experiment
from shardax.models import hf as hf_models
from shardax.models.hf import fp8, mxfp4
from shardax.trainer.hf import safetensors


def model_dir(exp: Experiment) -> str:
  """The model directory an `hf:DIR` experiment was built from."""
  if not exp.name.startswith("hf:"):
    raise ConfigError(f"--exp={exp.name!r} is not a Hugging Face experiment; use --exp=hf:DIR")
  return os.path.expanduser(exp.name[3:])


def _distinct_shards(sharding: NamedSharding, shape: tuple[int, ...]):
  """{key: (index, [devices])}: this host's devices grouped by the block they hold."""
  groups: dict = {}
  for dev, idx in sharding.addressable_devices_indices_map(shape).items():
    bounds = tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
    groups.setdefault(bounds, (bounds, []))[1].append(dev)
  return groups


def row_dim(leaf: hf_models.Leaf) -> tuple[int, int] | None:
  """(d, per): the dim d of our per-tensor layout whose index ranges are row ranges of the
  Hugging Face tensor's first dim (`per` rows for each index of d, the later dims of d's group
  whole), or None where no dim of ours is (a flat tensor cut into parts)."""
  shape = leaf.one_shape
  if not shape:
    return None
  if not leaf.in_dims:   # the same layout (0), or flat (None: the HF tensor's rows are elements)
    if leaf.part is not None and (leaf.in_dims is None or len(shape) == 1):
      return None
    return 0, (math.prod(shape[1:]) if leaf.in_dims is None else 1)
  k = leaf.in_dims       # weight [out, in]: ours [in dims..., out dims...]; rows are out
  return (k, math.prod(shape[k + 1:])) if k < len(shape) else None


def _rows_to_ours(leaf: hf_models.Leaf, t: np.ndarray, d: int, span: int) -> np.ndarray:
  """Rows of a Hugging Face tensor (`span` indices of our dim `d`) -> our layout of them."""
  t = leaf.cut(t)
  shape = leaf.one_shape[:d] + (span,) + leaf.one_shape[d + 1:]
  return (t if not leaf.in_dims else t.T).reshape(shape)


def read_part(leaf: hf_models.Leaf, reader, name: str, blocks: list[tuple]):
  """(t, d, lo): our layout of the part of tensor `name` that covers `blocks` (per-tensor
  bounds): its rows covering them where `row_dim` allows and the reader reads rows (t then
  starts at index lo of our dim d), else the whole tensor (d None)."""
  rd = row_dim(leaf)
  if rd is not None and getattr(reader, "reads_rows", False):
    d, per = rd
    lo, hi = min(b[d][0] for b in blocks), max(b[d][1] for b in blocks)
    if (lo, hi) != (0, leaf.one_shape[d]) and tuple(reader.shape(name)) == leaf.hf_shape:
      return _rows_to_ours(leaf, reader.get(name, rows=(lo * per, hi * per)), d, hi - lo), d, lo
  return leaf.to_ours(reader.get(name)), None, 0


def put_leaf(leaf: hf_models.Leaf, reader: safetensors.Reader, shape, dtype, sharding) -> jax.Array:
  """One param as a sharded jax.Array, streamed from the checkpoint's tensors: each tensor
  this process holds a part of read (its rows, or whole) and copied into the shards it covers."""
  dtype = np.dtype(dtype)
  groups = _distinct_shards(sharding, tuple(shape))
  bufs = {k: np.empty(tuple(b - a for a, b in bounds), dtype) for k, (bounds, _) in groups.items()}
  n = len(leaf.stack)
  for i, name in enumerate(leaf.hf_names):
    at = leaf.index(i) if n else ()   # (layer,), (layer, expert) or (expert,); () unstacked
    held = [bounds for bounds, _ in groups.values()
            if all(a <= j < b for j, (a, b) in zip(at, bounds[:n]))]
    if not held:
      continue   # no device of this process holds a part of this tensor
    t, d, lo = read_part(leaf, reader, name, [bounds[n:] for bounds in held])
    for bounds in held:
      block = tuple(slice(a - lo, b - lo) if j == d else slice(a, b) for j, (a, b) in enumerate(bounds[n:]))
      bufs[bounds][tuple(j - a for j, (a, _) in zip(at, bounds[:n]))] = t[block]
    del t
  # A copy (never an alias of the numpy buffer, which a CPU device may otherwise keep as
  # the param), waited for; the runtime hands the buffer back from its transfer thread through
  # jaxlib's gc callback, which a young-generation collection runs. So this leaf's host
  # buffers are freed before the next leaf's are filled, not held beside them.
  arrays = [jax.device_put(bufs[k], dev, may_alias=False) for k, (_, devs) in groups.items()
            for dev in devs]
  jax.block_until_ready(arrays)
  del bufs
  gc.collect(0)
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def check_copies(reader, copies: dict[str, str], rows: int = 4096) -> None:
  """Each copy the checkpoint holds (`hf_models.copies`: DeepSeek-V3's MTP layers store the
  embedding and head they share) equals its tensor bit for bit, compared `rows` rows at a time
  where the reader reads rows; a ConfigError naming both otherwise (the model would hold one)."""
  present = set(reader.names())
  for copy, source in copies.items():
    if copy not in present:
      continue
    shape = tuple(reader.shape(source))
    same = tuple(reader.shape(copy)) == shape
    n = shape[0] if shape else 1
    step = rows if shape and getattr(reader, "reads_rows", False) else n
    for a in range(0, n, step):
      if not same:
        break
      get = (lambda name: reader.get(name, rows=(a, min(n, a + step)))) if step < n else reader.get
      same = np.array_equal(get(copy), get(source))
    if not same:
      raise ConfigError(f"{copy} differs from {source}: shardax shares the embedding and head between the "
                        f"main model and the multi-token prediction layers (DeepSeek-V3 section 2.2), so "
                        f"the checkpoint's copy must equal it (this checkpoint's MTP layer has its own)")


def import_params(setup, source: str, files: safetensors.Reader | None = None):
  """The params tree of `setup` (a `ModelSetup`, trainer/model_setup.py, or the training
  setup) filled from the model dir `source` (read through `files`, a Reader of it, when
  given: its `bytes_read` then says what this process read)."""
  hf = hf_models.read(source)   # quantized weights dequantized: MXFP4 experts (gpt-oss), block-scaled fp8
  quantized = mxfp4 if mxfp4.is_mxfp4(hf) else fp8
  reader = quantized.dequantizing(safetensors.Reader(source) if files is None else files, hf)
  abstract = setup.abstract_params
  model = setup.exp.model
  arch = hf_models.architecture(hf)
  plan = hf_models.leaves(abstract, model, arch)
  copies = hf_models.copies(model, arch)
  hf_models.check_names(plan, reader.names(), model.tied_embedding, copies)
  check_copies(reader, copies)
  flat, treedef = jax.tree_util.tree_flatten(abstract)
  out = [put_leaf(leaf, reader, a.shape, a.dtype, a.sharding) for (_, leaf), a in zip(plan, flat)]
  return jax.tree_util.tree_unflatten(treedef, out)


def held_bytes(abstract) -> int:
  """The bytes of `abstract`'s arrays (shape, dtype, sharding) on this process's devices: a
  block replicated on several of them counts once for each (CPU devices keep it in host memory)."""
  total = 0
  for a in jax.tree.leaves(abstract):
    for idx in a.sharding.addressable_devices_indices_map(tuple(a.shape)).values():
      total += math.prod(len(range(*s.indices(n))) for s, n in zip(idx, a.shape)) * np.dtype(a.dtype).itemsize
  return total


def host_memory() -> dict[str, int]:
  """{"rss": resident bytes now, "peak": the most resident so far} of this process, from
  /proc/self/status (Linux); {} where there is none."""
  try:
    with open("/proc/self/status") as f:
      fields = dict(line.split(":", 1) for line in f if ":" in line)
  except OSError:
    return {}
  return {key: int(fields[name].split()[0]) * 1024 for key, name in (("rss", "VmRSS"), ("peak", "VmHWM"))
          if name in fields}


def run(exp: Experiment, job_dir: str) -> dict:
  """--mode=import: the model dir's weights as step 0 of `job_dir`; returns a summary."""
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import checkpoint as ckpt_lib
  from shardax.trainer import model_setup
  from shardax.trainer import state as state_lib
  source = model_dir(exp)
  hf = hf_models.read(source)   # the same checks as the experiment's build
  adapter = hf_models.adapter_for(hf)
  adapter.model_fields(hf), adapter.moe_fields(hf)
  mesh = make_mesh(exp.mesh)
  model = model_setup.create(exp, mesh)
  setup = state_lib.with_optimizer(model)   # step 0 is a train state: training resumes from it
  checkpointer = ckpt_lib.Checkpointer(os.path.join(job_dir, "checkpoints"), exp.checkpoint)
  try:
    if checkpointer.latest_step() is not None:
      raise ConfigError(f"{job_dir}/checkpoints already holds step {checkpointer.latest_step()}; "
                        f"import into a fresh --job_dir")
    files = safetensors.Reader(source)
    held, before = held_bytes(model.abstract_params), host_memory()
    print(f"importing {source} ({files.nbytes / 1e6:,.1f} MB): process {jax.process_index()} of "
          f"{jax.process_count()} holds {held / 1e6:,.1f} MB of params on {len(mesh.local_devices)} device(s); "
          f"host RSS {before.get('rss', 0) / 1e6:,.1f} MB", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), use_rules(model.rules, exp.sharding.allow_uneven):
      params = import_params(model, source, files)
      jax.block_until_ready(params)
      seconds = time.perf_counter() - t0
      in_place = host_memory()
      opt_state = jax.jit(setup.tx.init, out_shardings=setup.shardings["opt_state"])(params)
      step = jax.device_put(np.zeros((), np.int32), setup.replicated)
      state = {"step": step, "params": params, "opt_state": opt_state}
      checkpointer.save(0, state, None, force=True)
      checkpointer.wait()
  finally:
    checkpointer.close()
  nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
  line = (f"imported {source}: {state_lib.count_params(model):,} params, {nbytes / 1e6:.1f} MB in "
          f"{seconds:.2f}s ({nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s) -> {job_dir}/checkpoints step 0; "
          f"process {jax.process_index()} of {jax.process_count()} read {files.bytes_read:,} of the "
          f"checkpoint's {files.nbytes:,} bytes; host peak RSS {in_place.get('peak', 0) / 1e6:,.1f} MB with the "
          f"params in place, {host_memory().get('peak', 0) / 1e6:,.1f} MB after the save")
  logging.info(line)
  print(line, file=sys.stderr, flush=True)
  return {"bytes": nbytes, "seconds": seconds, "bytes_read": files.bytes_read, "checkpoint_bytes": files.nbytes,
          "held_bytes": held, "rss_before": before.get("rss"), "peak_rss_params": in_place.get("peak"),
          "peak_rss": host_memory().get("peak")}
