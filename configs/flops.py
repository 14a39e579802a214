"""Model FLOPs per step: the one formula benchmarks, metrics and dry runs share.

Pure arithmetic on a model config's fields, so it lives with the configs (a leaf that imports
nothing of layers/ or trainer/); perf/flops.py re-exports it.

Training a dense Transformer costs 6 FLOPs per matmul parameter per token
(2 forward, 4 backward) plus attention's two score matmuls (QK^T and AV), which
grow with sequence length and have no parameters: per layer and token
2 x 2 x seq_len x (heads x head_dim) forward, x3 with backward, halved for a
causal mask because half the scores are never needed. The output head counts as
a matmul (d_model x vocab) even when tied to the embedding; the embedding lookup
itself is a gather and counts nothing. This is the convention of the PaLM paper
(appendix B) and MaxText, so MFU figures compare.

Multi-head latent attention (`cfg.mla`) counts its own projections (q down/up or plain,
the kv latent and RoPE key, the k/v up projections, the output) and scores of its own
widths: QK^T over qk_nope + qk_rope dims, AV over v_head_dim, per head (as training runs
it, expanded; decoding's absorbed form is not a training FLOP).

Multi-token prediction (`cfg.mtp`, layers/mtp.py) is counted in the model FLOPs: each depth's
block (its attention scores too; an MoE block's active experts and router), its eh_proj
(2 d_model x d_model) and its pass through the shared head (d_model x vocab) are matmuls every
training step runs for the loss, like the main model's. DeepSeek-V3's report quotes parameters
without the MTP module (671B of 685B) and gives no FLOP convention; `mtp_params` and
`mtp_flops_per_token` say how much of either figure MTP is (--mode=explain prints both).
"""

from __future__ import annotations

# How every "model FLOPs" / MFU figure in shardax is counted, said where it is shown.
CONVENTION = "6N + attention, causal-halved (PaLM app. B)"


def _attention_params(cfg) -> int:
  d, h = cfg.d_model, cfg.num_heads
  m = getattr(cfg, "mla", None)
  if m is not None:
    q = d * h * m.qk_head_dim if m.q_lora_rank is None else (d + h * m.qk_head_dim) * m.q_lora_rank
    latent = d * (m.kv_lora_rank + m.qk_rope_head_dim)
    return q + latent + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d
  kv, dh = cfg.kv_heads, cfg.dim_per_head
  return d * h * dh + 2 * d * kv * dh + h * dh * d


def score_width(cfg) -> int:
  """Per head, the QK^T contraction plus the AV output width: 2 x head_dim, or MLA's own."""
  m = getattr(cfg, "mla", None)
  return 2 * cfg.dim_per_head if m is None else m.qk_head_dim + m.v_head_dim


def _mlp_params(cfg) -> int:
  """One dense MLP's matrices: 2 (plain) or 3 (gated) of d_model x d_ff."""
  return (2 if getattr(cfg, "mlp", "gated") == "plain" else 3) * cfg.d_model * cfg.d_ff


def matmul_params(cfg) -> int:
  """Parameters in matmuls of a `TransformerConfig` (the head counted even when tied)."""
  return cfg.num_layers * (_attention_params(cfg) + _mlp_params(cfg)) + cfg.d_model * cfg.vocab_size


def per_token(cfg, seq_len: int, causal: bool = True) -> float:
  """Training FLOPs per token; causal=False counts every attention score (MaxText before
  2023-11-29, Megatron's and many papers' figures). An MoE model (`cfg.moe`) counts the
  experts a token activates (`_moe_swap`)."""
  attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * score_width(cfg) / (2 if causal else 1)
  return 6 * (matmul_params(cfg) + _moe_swap(cfg)) + attention + mtp_flops_per_token(cfg, seq_len, causal)


def _mtp_depths(cfg) -> int:
  m = getattr(cfg, "mtp", None)
  return 0 if m is None else m.depth


def mtp_flops_per_token(cfg, seq_len: int, causal: bool = True) -> float:
  """Training FLOPs per token of the multi-token prediction modules (0 without `cfg.mtp`): per
  depth, one block's matmuls (an MoE block's router and active experts), its attention
  scores, eh_proj and the shared head."""
  depth = _mtp_depths(cfg)
  if not depth:
    return 0.0
  m = getattr(cfg, "moe", None)
  d = cfg.d_model
  ffn = _mlp_params(cfg) if m is None else d * m.num_experts + (m.top_k + m.num_shared_experts) * 3 * d * m.d_ff
  matmuls = _attention_params(cfg) + ffn + 2 * d * d + d * cfg.vocab_size
  scores = 6 * seq_len * cfg.num_heads * score_width(cfg) / (2 if causal else 1)
  return depth * (6 * matmuls + scores)


def per_step(cfg, global_batch: int, seq_len: int) -> float:
  return per_token(cfg, seq_len) * global_batch * seq_len


def _moe_swap(cfg) -> int:
  """Matmul parameters a token activates in the MoE layers beyond the dense MLPs they replace.

  In each MoE layer: the router (d_model x E) plus the FFNs of its top_k chosen and its
  shared experts, minus the dense MLP `matmul_params` counted there. Not counted: the experts
  it did not choose, and the dispatch/combine einsums (data movement written as matmuls, not
  model compute; about 4 x S x E x C x d_model per group and layer forward, which the
  compiler's own FLOP count does include). Dropped tokens and skipped second experts are
  counted as if processed, so the figure does not depend on the routing. 0 for a dense model.
  """
  m = getattr(cfg, "moe", None)
  if m is None:
    return 0
  active = m.top_k + m.num_shared_experts   # routed + shared experts a token goes through
  d = cfg.d_model
  return cfg.num_moe_layers * (d * m.num_experts + active * 3 * d * m.d_ff - _mlp_params(cfg))


def param_count(cfg) -> int:
  """Total parameters of a `TransformerConfig` (every expert, MLA's latent norms and the post
  norms counted; biases and q/k norms not)."""
  d, n_moe, m = cfg.d_model, cfg.num_moe_layers, cfg.moe
  norm = d * (2 if cfg.norm == "layer" else 1)
  norms = (1 if cfg.parallel_block else 2) * norm + (2 * norm if getattr(cfg, "post_norms", False) else 0)
  mla = getattr(cfg, "mla", None)
  if mla is not None:
    norms += (mla.q_lora_rank or 0) + mla.kv_lora_rank
  dense_ffn = (cfg.num_layers - n_moe) * _mlp_params(cfg)
  moe_ffn = 0 if m is None else n_moe * (
      d * m.num_experts + (m.num_experts + m.num_shared_experts) * 3 * d * m.d_ff
      + (m.num_experts if m.bias_update_rate else 0))
  head = 0 if cfg.tied_embedding else d * cfg.vocab_size
  main = cfg.num_layers * (_attention_params(cfg) + norms) + dense_ffn + moe_ffn + cfg.vocab_size * d + head + norm
  return main + mtp_params(cfg)


def mtp_params(cfg) -> int:
  """Parameters of the multi-token prediction modules (0 without `cfg.mtp`): per depth a block
  (an MoE one when the model has `moe`), enorm, hnorm, head_norm and eh_proj; the embedding
  and head are the main model's."""
  depth = _mtp_depths(cfg)
  if not depth:
    return 0
  d, m = cfg.d_model, cfg.moe
  norm = d * (2 if cfg.norm == "layer" else 1)
  norms = (1 if cfg.parallel_block else 2) * norm + (2 * norm if getattr(cfg, "post_norms", False) else 0)
  mla = getattr(cfg, "mla", None)
  if mla is not None:
    norms += (mla.q_lora_rank or 0) + mla.kv_lora_rank
  ffn = _mlp_params(cfg) if m is None else (d * m.num_experts + (m.num_experts + m.num_shared_experts) * 3 * d * m.d_ff
                                            + (m.num_experts if m.bias_update_rate else 0))
  return depth * (_attention_params(cfg) + norms + ffn + 3 * norm + 2 * d * d)
