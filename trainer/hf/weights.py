"""Our param tree <-> Hugging Face tensor names and layouts (Llama, Mistral, Qwen2, Qwen3, Mixtral).

transformers stores a linear layer as weight[out, in] (y = x W^T) with heads flattened
into out; our DenseGeneral kernel is [in dims..., out dims...] with heads kept apart
(e.g. query [embed, heads, kv], out [heads, kv, embed]). So a kernel is the transposed
weight reshaped, and back: a pure relayout, bit-exact both ways. Biases and norm scales
only reshape. Both use the rotate-half RoPE convention, so q/k need no permutation.

Scanned stacks hold one leaf per block param with a leading `layers` dim: leaf
`layers/blocks/attn/query/kernel` [L, ...] is the L tensors `model.layers.{i}.self_attn.
q_proj.weight`. A Python-list stack (scan_layers=False) has one leaf per block.

Mixtral (layers/blocks.py, every layer an MoE block): the stack is `layers/blocks/moe_block/...`
(scanned) or `layers/blocks/{i}/moe_block/...`; the router kernel [embed, E] is `block_sparse_moe.
gate.weight` [E, embed]; an expert weight is stacked over experts too: `wi_gate` [E, embed, h]
is the E tensors `block_sparse_moe.experts.{e}.w1.weight` [h, embed] (w3: wi_up, w2: wo),
so a scanned leaf [L, E, ...] is L x E tensors, in that order.
"""

from __future__ import annotations

import dataclasses
import math
import numpy as np

from shardax.configs.schema import ConfigError

# Block-relative path -> (Hugging Face name inside `model.layers.{i}.`, input dims of a kernel
# (None: not a kernel, only reshaped)).
BLOCK = {
    ("attn_norm", "scale"): ("input_layernorm.weight", None),
    ("attn", "query", "kernel"): ("self_attn.q_proj.weight", 1),
    ("attn", "query", "bias"): ("self_attn.q_proj.bias", None),
    ("attn", "key", "kernel"): ("self_attn.k_proj.weight", 1),
    ("attn", "key", "bias"): ("self_attn.k_proj.bias", None),
    ("attn", "value", "kernel"): ("self_attn.v_proj.weight", 1),
    ("attn", "value", "bias"): ("self_attn.v_proj.bias", None),
    ("attn", "out", "kernel"): ("self_attn.o_proj.weight", 2),
    ("attn", "out", "bias"): ("self_attn.o_proj.bias", None),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", None),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", None),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", 1),
    ("mlp", "gate", "bias"): ("mlp.gate_proj.bias", None),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", 1),
    ("mlp", "up", "bias"): ("mlp.up_proj.bias", None),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", 1),
    ("mlp", "down", "bias"): ("mlp.down_proj.bias", None),
}
# The MoE block (layers/blocks.py Block with moe=True): attention and norms as above, then the
# router and the experts; "{e}" marks a leaf whose leading dim is the expert.
MOE_BLOCK = {k: v for k, v in BLOCK.items() if k[0] in ("attn_norm", "attn", "mlp_norm")}
MOE_BLOCK.update({
    ("moe", "router", "kernel"): ("block_sparse_moe.gate.weight", 1),
    ("moe", "wi_gate"): ("block_sparse_moe.experts.{e}.w1.weight", 1),
    ("moe", "wi_up"): ("block_sparse_moe.experts.{e}.w3.weight", 1),
    ("moe", "wo"): ("block_sparse_moe.experts.{e}.w2.weight", 1),
})
TOP = {
    ("embed", "embedding"): ("model.embed_tokens.weight", 0),   # 0: the same layout
    ("final_norm", "scale"): ("model.norm.weight", None),
    ("head", "kernel"): ("lm_head.weight", 1),
}
# Buffers some checkpoints carry that hold no weights (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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

  @property
  def stacked(self) -> bool:
    return bool(self.stack)

  def index(self, i: int) -> tuple[int, ...]:
    """The position in the stacked dims of the i-th tensor of `hf_names`."""
    return tuple(int(j) for j in np.unravel_index(i, self.stack))

  @property
  def hf_shape(self) -> tuple[int, ...]:
    if self.in_dims == 0:
      return self.one_shape
    if self.in_dims is None:
      return (math.prod(self.one_shape),)
    return (math.prod(self.one_shape[self.in_dims:]), math.prod(self.one_shape[:self.in_dims]))

  def to_ours(self, t: np.ndarray) -> np.ndarray:
    """One Hugging Face tensor -> our layout of it."""
    if tuple(t.shape) != self.hf_shape:
      raise ConfigError(f"{self.hf_names[0]}: shape {tuple(t.shape)} in the checkpoint, but the config "
                        f"makes {self.hf_shape} (for {'/'.join(self.path)} {self.one_shape})")
    return (t if not self.in_dims else t.T).reshape(self.one_shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
    """Our layout of one tensor -> the Hugging Face tensor (contiguous)."""
    if not self.in_dims:
      return np.ascontiguousarray(a.reshape(self.hf_shape))
    rows = math.prod(self.one_shape[:self.in_dims])
    return np.ascontiguousarray(a.reshape(rows, -1).T)


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


def leaves(params_abstract, model_cfg) -> list[tuple[tuple, Leaf]]:
  """(tree path, Leaf) for every leaf of our params (abstract or real), in tree order."""
  import jax
  t = model_cfg
  if t.pipeline.stages > 1:
    raise ConfigError("Hugging Face import/export of a pipelined stack (model.pipeline.stages > 1) is not "
                      "supported yet; import with stages=1")
  moe = getattr(model_cfg, "moe", None)
  if moe is not None and (moe.every != 1 or moe.first_dense_layers or moe.num_shared_experts):
    raise ConfigError(f"Hugging Face MoE weights (Mixtral) have an MoE FFN in every layer and no shared "
                      f"experts; the model has model.moe.every={moe.every}, first_dense_layers="
                      f"{moe.first_dense_layers}, num_shared_experts={moe.num_shared_experts}")
  stack_key, table = ("layers", "blocks"), (MOE_BLOCK if moe is not None else BLOCK)
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params_abstract)[0]:
    names = _names(path)
    shape = tuple(leaf.shape)
    if names[:len(stack_key)] == stack_key:
      rest = names[len(stack_key):]
      if t.scan_layers:
        layers, key = range(shape[0]), rest
      else:
        layers, key = [int(rest[0])], rest[1:]
      if moe is not None:
        if key[0] != "moe_block":
          raise ConfigError(f"param {'/'.join(names)} has no Hugging Face counterpart")
        key = key[1:]
      hf, in_dims = _lookup(table, key, names)
      stack = (shape[0],) if t.scan_layers else ()
      if "{e}" in hf:   # one tensor per (layer, expert)
        stack += (shape[len(stack)],)
        hf_names = tuple(f"model.layers.{i}.{hf.format(e=e)}" for i in layers for e in range(stack[-1]))
      else:
        hf_names = tuple(f"model.layers.{i}.{hf}" for i in layers)
      out.append((path, Leaf(names, hf_names, stack, shape[len(stack):], in_dims)))
    else:
      hf, in_dims = _lookup(TOP, names, names)
      out.append((path, Leaf(names, (hf,), (), shape, in_dims)))
  return out


def _lookup(table, key, full) -> tuple[str, int | None]:
  if key not in table:
    raise ConfigError(f"param {'/'.join(full)} has no Hugging Face counterpart")
  return table[key]


def check_names(plan: list[tuple[tuple, Leaf]], available: list[str], tied: bool) -> None:
  """Every tensor we need is there and every tensor there is used (a tied checkpoint may
  still carry lm_head.weight: it equals the embedding and is skipped)."""
  needed = {n for _, leaf in plan for n in leaf.hf_names}
  missing = sorted(needed - set(available))
  unused = sorted(n for n in set(available) - needed
                  if not n.endswith(IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight"))
  if missing:
    raise ConfigError(f"the checkpoint lacks {len(missing)} tensor(s) the config needs: {missing[:5]}")
  if unused:
    raise ConfigError(f"the checkpoint has {len(unused)} tensor(s) the config does not use "
                      f"(a config.json that does not describe these weights?): {unused[:5]}")

