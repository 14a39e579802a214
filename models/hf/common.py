"""What every Hugging Face family adapter shares: reading config.json, the keys that carry no
math, the unknown-key check, RoPE in both spellings, and the param tree <-> tensor walk.

Config: every key of config.json is accounted for by a family (mapped onto a field, checked
against the one value we implement, or in METADATA: ids, dtype, bookkeeping). Anything else
is an error naming the key (`check_keys`): a model whose config says something we do not
compute must not load as a different model.

Weights: a Hugging Face linear weight is [out, in]; ours are einsum kernels with the input
dims first (query [embed, heads, kv], out [heads, kv, embed]). So a kernel is the transposed
weight reshaped, and back: a pure relayout, bit-exact both ways (`Leaf`). Biases and norm
scales only reshape. Scanned stacks hold one leaf per block param with a leading `layers`
dim: leaf `layers/blocks/attn/query/kernel` [L, ...] is the L tensors `model.layers.{i}.
self_attn.q_proj.weight`; a Python-list stack (scan_layers=False) has one leaf per block. A
table entry whose name holds "{e}" is stacked over experts too: a scanned leaf [L, E, ...] is
L x E tensors, in that order. A family supplies the tables (`WeightNames`); `leaves` walks.

The walk knows every layout of the decoder's stack (layers/transformer.py `LayerStack`) and
gives each block param its Hugging Face layer index (`block_layers`):
  layers/first_dense[/{i}]/...          an MoE model's first k dense layers: layers 0..k-1;
  layers/blocks[/{u}]/...               a dense model's Block per layer: layer k + u;
  layers/blocks[/{u}]/dense/{j}/...     an MoE unit's j-th dense Block: layer k + u*every + j;
  layers/blocks[/{u}]/moe_block/...     the unit's MoE Block: layer k + u*every + every-1;
  layers/blocks[/{u}]/blocks/{j}/...    a layer pattern's unit: layer k + u*P + j (P layers a unit);
  layers/tail/blocks/{j}/...            the pattern's layers after the last whole unit;
([/{u}]: the unit index of an unscanned stack; a scanned one has it as the leading dim.) What
is left is block-relative (`attn/...`, `mlp/...`, `moe/...`) and looked up in the table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError

# Keys that do not change what the model computes (bookkeeping, ids, generation defaults).
METADATA = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "pretraining_tp", "max_window_layers", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "tie_encoder_decoder", "is_decoder",
    "_attn_implementation_autoset", "unk_token_id", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "id2label", "label2id", "use_return_dict"})
# Buffers some checkpoints carry that hold no weights (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER_PREFIX = "model.layers.{i}."


def read(model_dir: str) -> dict[str, Any]:
  """The config.json of a Hugging Face model directory, as JSON (nothing executed)."""
  path = os.path.join(os.path.expanduser(model_dir), "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"hf:{model_dir}: no config.json there; give a Hugging Face model directory "
                      f"(config.json, *.safetensors, tokenizer.json)")
  with open(path) as f:
    return json.load(f)


def arch_name(hf: dict[str, Any], architectures: dict[str, str]) -> str:
  """The short name (`architectures` maps config.json classes to them) of the one class
  config.json declares; a ConfigError listing the known classes otherwise."""
  archs = hf.get("architectures") or []
  known = [architectures[a] for a in archs if a in architectures]
  if len(archs) != 1 or not known:
    raise ConfigError(f"config.json architectures={archs}: shardax imports exactly one of "
                      f"{sorted(architectures)}")
  return known[0]


def check_keys(hf: dict[str, Any], arch: str, *known: set[str]) -> None:
  """Every key of `hf` is METADATA or in one of the family's `known` sets, else a ConfigError
  naming the keys."""
  unknown = sorted(set(hf) - METADATA - set().union(*known))
  if unknown:
    raise ConfigError(f"config.json key(s) {unknown} are not implemented by shardax's {arch} import; "
                      f"a key that changes the math cannot be ignored (remove it only if it does not)")


def check_silu_without_dropout(hf: dict[str, Any], what: str = "gated MLP and experts") -> None:
  """The gate activation and attention dropout every SiLU-gated family shares: silu, no dropout."""
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ConfigError(f"config.json hidden_act={act!r}: shardax's {what} implement 'silu'")
  if hf.get("attention_dropout", 0.0):
    raise ConfigError(f"config.json attention_dropout={hf['attention_dropout']}: dropout is not implemented")


def router_mismatches(model, arch: str, family: str, router: dict[str, Any]) -> list[str]:
  """The model.moe fields that differ from what `family`'s config.json fixes (`router`); an
  error if the model has no MoE section (`arch` cannot express a dense model)."""
  m = model.moe
  if m is None:
    raise ConfigError(f"cannot export as {arch}: the model is not a mixture of experts")
  return [f"model.moe.{k}={getattr(m, k)!r} ({family}: {v!r})" for k, v in router.items() if getattr(m, k) != v]


def decoder_keys(t, source: dict[str, Any], architecture: str, model_type: str, kv_heads: int) -> dict[str, Any]:
  """The config.json keys every decoder family writes alike: the source's no-math keys, the
  architecture, sizes, norm epsilon, tying, silu and no dropout; `max_position_embeddings` is
  the larger of the model's and the source's (training at a shorter length must not shrink it)."""
  out = {k: v for k, v in source.items() if k in METADATA}
  out.update(
      architectures=[architecture], model_type=model_type, vocab_size=t.vocab_size,
      hidden_size=t.d_model, intermediate_size=t.d_ff, num_hidden_layers=t.num_layers,
      num_attention_heads=t.num_heads, num_key_value_heads=kv_heads,
      max_position_embeddings=max(t.max_len, int(source.get("max_position_embeddings", 0))),
      rms_norm_eps=t.norm_eps, tie_word_embeddings=t.tied_embedding, hidden_act="silu", attention_dropout=0.0)
  return out


def rope(hf: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
  """TransformerConfig's rope_theta and, when scaled, its rope_scaling section (llama3 or YaRN),
  from `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5);
  other scaling types are errors."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", default_theta))
  kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
  src = params if params.get("rope_type", params.get("type")) == kind and kind != "default" else scaling
  out: dict[str, Any] = {"rope_theta": float(theta)}
  if kind == "default":
    extra = set(params) - {"rope_type", "type"}
    if extra:
      raise ConfigError(f"config.json rope_parameters has {sorted(extra)} that plain RoPE does not use")
    return out
  if kind == "yarn":
    return {**out, "rope_scaling": yarn_scaling(src, hf)}
  if kind != "llama3":
    raise ConfigError(f"config.json rope scaling type {kind!r} is not implemented (shardax has "
                      f"'default', 'llama3' and 'yarn')")
  known = {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
           "original_max_position_embeddings", "rope_theta"}
  extra = set(src) - known
  if extra:
    raise ConfigError(f"config.json llama3 rope scaling has keys {sorted(extra)} shardax does not implement")
  return {**out, "rope_scaling": RopeScaling(
      "llama3", factor=float(src["factor"]), low_freq_factor=float(src["low_freq_factor"]),
      high_freq_factor=float(src["high_freq_factor"]),
      original_max_len=int(src["original_max_position_embeddings"]))}


YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def yarn_scaling(src: dict[str, Any], hf: dict[str, Any]) -> RopeScaling:
  """The YaRN section (configs/rope.py) of a yarn rope_parameters / rope_scaling, with
  transformers' defaults: factor = max_position_embeddings / original length when absent,
  beta_fast 32, beta_slow 1, mscales absent, truncate true."""
  extra = set(src) - YARN_KEYS
  if extra:
    raise ConfigError(f"config.json yarn rope scaling has keys {sorted(extra)} shardax does not implement")
  original = int(src["original_max_position_embeddings"])
  factor = src.get("factor")
  factor = float(hf["max_position_embeddings"]) / original if factor is None else float(factor)
  attention = src.get("attention_factor")
  return RopeScaling("yarn", factor=factor, original_max_len=original,
                     beta_fast=float(src.get("beta_fast") or 32.0), beta_slow=float(src.get("beta_slow") or 1.0),
                     mscale=float(src.get("mscale") or 0.0), mscale_all_dim=float(src.get("mscale_all_dim") or 0.0),
                     attention_factor=None if attention is None else float(attention),
                     truncate=bool(src.get("truncate", True)))


def rope_keys(t) -> dict[str, Any]:
  """config.json's RoPE keys for TransformerConfig `t`, in both spellings (`rope_parameters`
  and `rope_theta`, plus `rope_scaling` when scaled by llama3 or YaRN)."""
  params = {"rope_type": "default", "rope_theta": t.rope_theta}
  r = t.rope_scaling
  if r is not None and r.kind == "llama3":
    params = {"rope_type": "llama3", "rope_theta": t.rope_theta, "factor": r.factor,
              "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
              "original_max_position_embeddings": r.original_max_len}
  if r is not None and r.kind == "yarn":
    params = {"rope_type": "yarn", "rope_theta": t.rope_theta, "factor": r.factor,
              "original_max_position_embeddings": r.original_max_len, "beta_fast": r.beta_fast,
              "beta_slow": r.beta_slow}
    params.update({k: v for k, v in (("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim),
                                     ("attention_factor", r.attention_factor)) if v})
    if not r.truncate:   # transformers' default is true
      params["truncate"] = False
  out = {"rope_parameters": params, "rope_theta": t.rope_theta}
  if params["rope_type"] != "default":
    out["rope_scaling"] = params
  return out


# A table: our param path (block-relative in `block`) -> (Hugging Face name, input dims of a
# kernel: the number of leading dims of our per-tensor shape that are the weight's input;
# 0: the same layout; None: not a kernel, only reshaped[, part]). `part` (i, n, interleaved):
# the leaf is the i-th of n equal parts of the tensor's last dim, a block of columns (Llama 4's
# fused gate_up_proj: gate then up) or, interleaved, the columns i, i + n, i + 2n, ...
Table = dict[tuple[str, ...], tuple]


@dataclasses.dataclass(frozen=True)
class WeightNames:
  """A family's tensor names for one model config.

  top: paths outside the layer stack -> full Hugging Face names;
  block: paths inside one Block (`attn/...`, `mlp/...`, `moe/...`: what `block_layers` leaves
    of a stack path) -> names inside `model.layers.{i}.`; "{e}" in a name marks an
    expert-stacked leaf.
  mtp: paths inside one multi-token prediction module other than its `block` (layers/mtp.py)
    -> names inside `model.layers.{num_layers + k}.` for module k (its block's: `block`);
  copies: Hugging Face names whose tensor is another's (name -> that name): read only to
    check they are equal, written as that tensor again (DeepSeek-V3's MTP layers store
    the shared embedding and head).
  """
  top: Table
  block: Table
  mtp: Table = dataclasses.field(default_factory=dict)
  copies: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One leaf of our params and the Hugging Face tensor(s) it is made of.

  A stacked leaf's leading dims `stack` (layers; layers and experts; or experts) each index
  one tensor: `hf_names` lists them in row-major order of `stack` (`index(i)` is the i-th's
  position). An unstacked leaf (stack ()) is the one tensor. `one_shape` is our per-tensor
  shape (the leaf's shape without the stacked dims)."""
  path: tuple[str, ...]
  hf_names: tuple[str, ...]
  stack: tuple[int, ...]
  one_shape: tuple[int, ...]
  in_dims: int | None
  part: tuple[int, int, bool] | None = None   # (i, n, interleaved): see `Table`

  @property
  def stacked(self) -> bool:
    return bool(self.stack)

  def index(self, i: int) -> tuple[int, ...]:
    """The position in the stacked dims of the i-th tensor of `hf_names`."""
    return tuple(int(j) for j in np.unravel_index(i, self.stack))

  @property
  def part_shape(self) -> tuple[int, ...]:
    """The shape of our part of the Hugging Face tensor (all of it without `part`)."""
    if self.in_dims == 0:
      return self.one_shape
    if self.in_dims is None:
      return (math.prod(self.one_shape),)
    return (math.prod(self.one_shape[self.in_dims:]), math.prod(self.one_shape[:self.in_dims]))

  @property
  def hf_shape(self) -> tuple[int, ...]:
    shape = self.part_shape
    return shape if self.part is None else shape[:-1] + (shape[-1] * self.part[1],)

  def cut(self, t: np.ndarray) -> np.ndarray:
    """Our part of a Hugging Face tensor (`part`; the tensor itself without one)."""
    if self.part is None:
      return t
    i, n, interleaved = self.part
    w = t.shape[-1] // n
    return t[..., i::n] if interleaved else t[..., i * w:(i + 1) * w]

  def to_ours(self, t: np.ndarray) -> np.ndarray:
    """One Hugging Face tensor -> our layout of it (of our part of it)."""
    if tuple(t.shape) != self.hf_shape:
      raise ConfigError(f"{self.hf_names[0]}: shape {tuple(t.shape)} in the checkpoint, but the config "
                        f"makes {self.hf_shape} (for {'/'.join(self.path)} {self.one_shape})")
    t = self.cut(t)
    return (t if not self.in_dims else t.T).reshape(self.one_shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
    """Our layout of one tensor -> the Hugging Face tensor (contiguous; with `part`, our part
    of it: `join` puts the parts together)."""
    if not self.in_dims:
      return np.ascontiguousarray(a.reshape(self.part_shape))
    rows = math.prod(self.one_shape[:self.in_dims])
    return np.ascontiguousarray(a.reshape(rows, -1).T)


def join(parts: list[tuple["Leaf", np.ndarray]]) -> np.ndarray:
  """The Hugging Face tensor of its parts [(leaf, leaf.to_hf(...))] (one: that tensor)."""
  if len(parts) == 1 and parts[0][0].part is None:
    return parts[0][1]
  parts = sorted(parts, key=lambda p: p[0].part[0])
  if parts[0][0].part[2]:   # interleaved columns
    return np.ascontiguousarray(np.stack([a for _, a in parts], axis=-1).reshape(parts[0][0].hf_shape))
  return np.ascontiguousarray(np.concatenate([a for _, a in parts], axis=-1))


def _names(path) -> tuple[str, ...]:
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def block_layers(full: tuple[str, ...], lead: int, model_cfg) -> tuple[list[int], tuple[str, ...]]:
  """(the Hugging Face layer index of each block the leaf at `full` holds, the block-relative
  path) for a param of the layer stack (`full` starts with 'layers'). `lead`: the leaf's
  leading dim (the number of units of a scanned stack)."""
  t = model_cfg
  part, rest = full[1], full[2:]
  k = t.num_first_dense
  pattern = bool(getattr(t, "layer_pattern", ()))
  if part == "tail":
    units, base, per = [0], k + t.num_stack_units * t.layers_per_unit, 0
  else:
    base, per = (0, 1) if part == "first_dense" else (k, t.layers_per_unit)
    if t.scan_layers:
      units = list(range(lead))
    else:
      units, rest = [int(rest[0])], rest[1:]
  offset = 0
  if part == "tail" or (part == "blocks" and pattern):   # PatternUnit: its j-th block
    offset, rest = int(rest[1]), rest[2:]
  elif part == "blocks" and t.moe is not None:          # Unit: dense/{j}, then moe_block
    if rest[0] == "dense":
      offset, rest = int(rest[1]), rest[2:]
    else:
      offset, rest = t.moe.every - 1, rest[1:]
  elif part not in ("blocks", "first_dense"):
    raise ConfigError(f"param {'/'.join(full)}: layers/{part} is a part of the layer stack the Hugging "
                      f"Face walk does not know (models/hf/common.py block_layers)")
  return [base + u * per + offset for u in units], rest


def leaves(params_abstract, model_cfg, names: WeightNames) -> list[tuple[tuple, Leaf]]:
  """(tree path, Leaf) for every leaf of our params (abstract or real), in tree order."""
  import jax
  t = model_cfg
  if t.pipeline.stages > 1:
    raise ConfigError("Hugging Face import/export of a pipelined stack (model.pipeline.stages > 1) is not "
                      "supported yet; import with stages=1")
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params_abstract)[0]:
    full = _names(path)
    shape = tuple(leaf.shape)
    if full[0] in ("layers", "mtp"):
      if full[0] == "layers":
        layers, key = block_layers(full, shape[0] if shape else 0, t)
        scanned, table = t.scan_layers and full[1] != "tail", names.block
      else:   # MTP module k (an unstacked list): Hugging Face layer num_layers + k
        layers, key, scanned = [t.num_layers + int(full[1])], full[2:], False
        table, key = (names.block, key[1:]) if key[0] == "block" else (names.mtp, key)
      hf, in_dims, *part = _lookup(table, key, full)
      stack = (shape[0],) if scanned else ()
      prefix = LAYER_PREFIX
      if "{e}" in hf:   # one tensor per (layer, expert)
        stack += (shape[len(stack)],)
        hf_names = tuple(prefix.format(i=i) + hf.format(e=e) for i in layers for e in range(stack[-1]))
      else:
        hf_names = tuple(prefix.format(i=i) + hf for i in layers)
      out.append((path, Leaf(full, hf_names, stack, shape[len(stack):], in_dims, *part)))
    else:
      hf, in_dims, *part = _lookup(names.top, full, full)
      out.append((path, Leaf(full, (hf,), (), shape, in_dims, *part)))
  return out


def _lookup(table: Table, key, full) -> tuple[str, int | None]:
  if key not in table:
    raise ConfigError(f"param {'/'.join(full)} has no Hugging Face counterpart")
  return table[key]


def check_names(plan: list[tuple[tuple, Leaf]], available: list[str], tied: bool,
                copies: dict[str, str] | None = None) -> None:
  """Every tensor we need is there and every tensor there is used (a tied checkpoint may
  still carry lm_head.weight: it equals the embedding and is skipped; `copies`, a family's
  `WeightNames.copies`, are used when present: the importer checks them)."""
  needed = {n for _, leaf in plan for n in leaf.hf_names}
  missing = sorted(needed - set(available))
  unused = sorted(n for n in set(available) - needed - set(copies or ())
                  if not n.endswith(IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight"))
  if missing:
    raise ConfigError(f"the checkpoint lacks {len(missing)} tensor(s) the config needs: {missing[:5]}")
  if unused:
    raise ConfigError(f"the checkpoint has {len(unused)} tensor(s) the config does not use "
                      f"(a config.json that does not describe these weights?): {unused[:5]}")
