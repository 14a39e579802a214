"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): `cfg.mtp.depth` modules
after the main model; module k (1-based) predicts, at each input position, the token k + 1
positions after that input.

With inputs t_i and targets t_{i+1} at position i (i = 0 .. L-1), depth k = 1 .. D:

    h'_i^k = M_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h_i^{k-1})]      (eh_proj, enorm, hnorm)
    h^k    = TRM_k(h'^k)                                             (one decoder Block, causal)
    P_i^k  = OutHead(RMSNorm_s(h_i^k)), the distribution of t_{i+k+1} (head_norm, the main head)
    CE_k   = mean over the kept positions of -log P_i^k(t_{i+k+1})
    loss   = main loss + cfg.mtp.loss_weight x mean_k CE_k

h^0 is the main model's output after its final norm: the representation its own head reads,
and what the inference engines that serve DeepSeek-V3's MTP layer (vLLM, SGLang) feed it.
M_k takes the embedding half first, as the checkpoints' `eh_proj` stores its input columns
(the paper writes [h; e]: the same map with M's columns swapped). Emb and OutHead are the main
model's embedding and head (or its tied embedding) with its logit soft-cap: shared, never copied.
TRM_k is the stack's `Block` (its attention, MLA included, and an MoE FFN when the model has
`moe`), run under the model's remat policy; its params carry the same logical axes.

Kept positions: i + k < L (a token to predict exists), the input at i + k in the same packed
document as i (`segment_ids`), and the target at i + k kept by `loss_mask`. The shifted fields
are made in the natural order (`shifted_fields`), before a context-parallel run moves the
sequence into its balanced order, so they travel with their position.

Training only: the main logits, evaluation and decoding never run these modules (the model's
`forward` and `cached` do not touch them), so a model with MTP decodes what it decodes without.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.configs.schema import TransformerConfig
from shardax.layers.blocks import RESIDUAL, Block, block_fn
from shardax.layers.linear import DenseGeneral
from shardax.layers.norm import make_norm
from shardax.sharding import shard


def field_names(k: int) -> tuple[str, str, str]:
  """The batch fields of depth k: its input tokens t_{i+k}, targets t_{i+k+1} and kept mask."""
  return f"mtp_inputs_{k}", f"mtp_targets_{k}", f"mtp_mask_{k}"


def all_field_names(depth: int) -> tuple[str, ...]:
  return tuple(name for k in range(1, depth + 1) for name in field_names(k))


def shifted_fields(batch: dict, depth: int) -> dict:
  """The batch with each depth's fields added (int32 / float32 [b, l], in the natural order):
  the inputs and targets shifted left by k, and a mask of the positions whose shifted target
  exists, lies in the same document and is kept by the batch's `loss_mask`."""
  inputs, targets = batch["inputs"], batch["targets"]
  b, l = inputs.shape
  segments, loss_mask = batch.get("segment_ids"), batch.get("loss_mask")
  out = dict(batch)
  for k in range(1, depth + 1):
    shift = lambda a: jnp.concatenate([a[:, k:], jnp.zeros((b, k), a.dtype)], axis=1)
    keep = jnp.broadcast_to(jnp.arange(l) + k < l, (b, l))
    if segments is not None:
      keep = keep & (shift(segments) == segments)
    mask = keep.astype(jnp.float32)
    if loss_mask is not None:
      mask = mask * shift(loss_mask.astype(jnp.float32))
    names = field_names(k)
    out.update({names[0]: shift(inputs), names[1]: shift(targets), names[2]: mask})
  return out


class MTPModule(nnx.Module):
  """One depth: enorm, hnorm, eh_proj (kernel [2 (embedding, hidden), embed, embed]), the
  block, and head_norm before the shared head (Hugging Face: enorm, hnorm, eh_proj, the
  decoder layer's tensors, shared_head.norm)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = lambda: make_norm(cfg.norm, cfg.d_model, dtype=dt, param_dtype=pdt, eps=cfg.norm_eps)
    self.enorm, self.hnorm = norm(), norm()
    self.eh_proj = DenseGeneral((2, cfg.d_model), cfg.d_model, in_axes=(None, "embed"), out_axes=("embed",),
                                dtype=dt, param_dtype=pdt, quantization=cfg.quantization, rngs=rngs)
    self.block = Block(cfg, moe=cfg.moe is not None, rngs=rngs)
    self.head_norm = norm()

  def combine(self, h: jax.Array, e: jax.Array) -> jax.Array:
    """M_k [RMSNorm_e(e); RMSNorm_h(h)]: [b, l, embed] x 2 -> [b, l, embed]."""
    # The pair keeps the residual's layout, so the projection gathers its weight (FSDP), never
    # the whole batch (what the partitioner chose for moe.deepseek_v3 unconstrained: 56 GiB a chip).
    pair = shard(jnp.stack([self.enorm(e), self.hnorm(h)], axis=-2), ("batch", "length", None, "embed"))
    return shard(self.eh_proj(pair), RESIDUAL)


def depths(modules, cfg: TransformerConfig, h0: jax.Array, embed: Callable, batch: dict,
           positions: jax.Array, segment_ids: jax.Array | None, key: jax.Array | None,
           deterministic: bool):
  """[(h^k [b, l, embed], the block's MoE stats ({} for a dense block)) for k = 1 .. D]: the
  recursion above from h0 = h^0. `embed`: the main model's token embedding; `key`: the step's
  gating key (each depth's block folds its own out of it)."""
  out, h = [], h0
  for k, module in enumerate(modules, start=1):
    x = module.combine(h, embed(batch[field_names(k)[0]]))
    graphdef, state = nnx.split(module.block)
    gate_key = None if key is None else jax.random.fold_in(key, 1_000_003 + k)
    h, stats = block_fn(graphdef, cfg.remat, deterministic=deterministic)(state, x, positions, segment_ids,
                                                                          gate_key)
    out.append((h, stats))
  return out


def moe_terms(stats: list[dict]) -> dict:
  """The MTP blocks' MoE terms: 'aux_loss' and 'z_loss' averaged over the depths, the token
  copies each depth's block routed and dropped ('routed_copies_count', 'dropped_copies_count':
  float32 [D], what the drop report lists after the stack's layers, trainer/moe_drops.py) and,
  where the router's dispatch reports it, 'expert_buffer_overflow' (summed: a count); {} for
  dense blocks."""
  if not stats or not stats[0]:
    return {}
  mean = lambda name: jnp.mean(jnp.stack([s[name] for s in stats]))
  out = {"aux_loss": mean("aux_loss"), "z_loss": mean("z_loss")}
  for name in ("routed_copies_count", "dropped_copies_count"):
    out[name] = jnp.stack([jnp.sum(s[name]).astype(jnp.float32) for s in stats])
  if "expert_buffer_overflow" in stats[0]:
    out["expert_buffer_overflow"] = sum(jnp.sum(s["expert_buffer_overflow"]) for s in stats)
  return out


def set_next_biases(modules, stats: list[dict]) -> None:
  """Writes each depth's next balance bias (bias balancing) into its block, so the model's
  `balance_updates` hands it to the train step with the stack's."""
  for module, s in zip(modules, stats):
    if "next_bias" in s:
      module.block.moe.balance_bias.set_value(jax.lax.stop_gradient(s["next_bias"]))
