"""The Llama family's Hugging Face adapter: Llama, Mistral, Qwen2, Qwen3 and Mixtral.

Dense (Llama, Mistral, Qwen2, Qwen3) -> TransformerConfig fields (`model_fields`); Mixtral
-> the same fields plus MoEConfig fields (`moe_fields`) for the model's `moe` section (one
decoder, whose feed-forward blocks are dense MLPs or MoE). Both use the rotate-half RoPE
convention, so q/k need no permutation.

Mixtral (layers/blocks.py, every layer an MoE block): the stack is `layers/blocks/moe_block/...`
(scanned) or `layers/blocks/{i}/moe_block/...`; the router kernel [embed, E] is `block_sparse_moe.
gate.weight` [E, embed]; an expert weight is stacked over experts too: `wi_gate` [E, embed, h]
is the E tensors `block_sparse_moe.experts.{e}.w1.weight` [h, embed] (w3: wi_up, w2: wo).
"""

from __future__ import annotations

from typing import Any

from shardax.configs.schema import ConfigError
from shardax.models.hf import common

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MixtralForCausalLM": "mixtral"}
MOE = ("mixtral",)
# transformers' defaults where they differ from Llama's (a config.json may omit a key).
DEFAULTS = {"mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6}}

MAPPED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
          "attention_bias", "mlp_bias", "hidden_act", "attention_dropout", "sliding_window",
          "use_sliding_window", "layer_types"}
# Mixtral's router keys. output_router_logits only decides whether transformers' own forward
# returns router logits and adds the balance loss to its training loss; the logits and
# tokens are the same either way, so it is kept on export and otherwise unused.
MOE_MAPPED = {"num_local_experts", "num_experts_per_tok", "router_jitter_noise",
              "router_aux_loss_coef", "output_router_logits"}

# Block-relative path -> (Hugging Face name inside `model.layers.{i}.`, input dims of a kernel).
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
# Mixtral's MoE Block: attention and norms as above, then the router and the experts.
MOE_BLOCK = {k: v for k, v in BLOCK.items() if k[0] in ("attn_norm", "attn", "mlp_norm")}
MOE_BLOCK.update({
    ("moe", "router", "kernel"): ("block_sparse_moe.gate.weight", 1),
    ("moe", "wi_gate"): ("block_sparse_moe.experts.{e}.w1.weight", 1),
    ("moe", "wi_up"): ("block_sparse_moe.experts.{e}.w3.weight", 1),
    ("moe", "wo"): ("block_sparse_moe.experts.{e}.w2.weight", 1),
})
TOP = {
    ("embed", "embedding"): ("model.embed_tokens.weight", 0),
    ("final_norm", "scale"): ("model.norm.weight", None),
    ("head", "kernel"): ("lm_head.weight", 1),
}
# The MoEConfig fields Mixtral's config.json cannot express (its router is fixed).
MIXTRAL_ROUTER = dict(every=1, first_dense_layers=0, num_shared_experts=0, score="softmax",
                      renormalize=True, gate_scale=1.0, bias_update_rate=0.0)


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields for a config.json (raises ConfigError naming a key we lack)."""
  arch = common.arch_name(hf, ARCHITECTURES)
  defaults = DEFAULTS.get(arch, {})
  common.check_keys(hf, arch, MAPPED, MOE_MAPPED if arch in MOE else set())
  common.check_silu_without_dropout(hf, "gated MLP")
  if hf.get("use_sliding_window"):
    raise ConfigError(f"config.json use_sliding_window=true: Qwen2's window (on the layers from "
                      f"max_window_layers={hf.get('max_window_layers')} on) is not imported; shardax's "
                      f"sliding-window attention (model.attention_window, what Mistral's and Mixtral's "
                      f"sliding_window map onto) windows every layer alike")
  types = set(hf.get("layer_types") or ["full_attention"])
  if types != {"full_attention"}:
    raise ConfigError(f"config.json layer_types={sorted(types)}: per-layer attention types are not imported; "
                      f"shardax attends alike in every layer (full, or model.attention_window for Mistral's "
                      f"and Mixtral's sliding_window)")
  max_len = int(hf.get("max_position_embeddings", 2048))
  # Mistral/Mixtral's sliding window: every attention path (training kernels and the decode
  # cache) masks keys outside it. Qwen2's sliding_window is unused without use_sliding_window.
  window = hf.get("sliding_window") if arch in ("mistral", "mixtral") else None
  heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim")
  attention_bias = bool(hf.get("attention_bias", False))
  if arch == "qwen2":
    if "attention_bias" in hf:
      raise ConfigError("config.json attention_bias: Qwen2 always has q/k/v biases; the key is not expected")
    qkv_bias, out_bias = True, False
  else:
    qkv_bias = out_bias = attention_bias
  eps = float(hf.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)))
  if arch in MOE and hf.get("mlp_bias"):
    raise ConfigError("config.json mlp_bias=true: shardax's MoE experts (and Mixtral's) have no biases")
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]),
      d_model=int(hf["hidden_size"]), num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim) if head_dim else None, d_ff=int(hf["intermediate_size"]),
      max_len=max_len, attention_window=None if window is None else int(window), norm="rms",
      tied_embedding=bool(hf.get("tie_word_embeddings", arch not in ("llama", "mistral", "mixtral"))),
      activation="silu", mlp="gated", parallel_block=False, norm_eps=eps,
      scale_embedding=False, qkv_bias=qkv_bias, out_bias=out_bias,
      mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=arch == "qwen3",
      **common.rope(hf, defaults.get("rope_theta", 10000.0)))


def moe_fields(hf: dict[str, Any]) -> dict[str, Any] | None:
  """MoEConfig fields of a Mixtral config.json (None for a dense architecture).

  transformers' Mixtral: router logits -> softmax over all experts (float32) -> the top k,
  renormalized over the chosen k -> each expert's w2(silu(w1 x) * w3 x), summed with those
  gates. That is `dispatch='dropless'` (nothing dropped), `score='softmax'`, `renormalize`.
  Its balance loss is num_experts * sum over the k slots and experts of (fraction of tokens
  routed there) * (mean router probability): k times shardax's (routers.route counts the
  k * tokens assignments together), so aux_loss_weight = router_aux_loss_coef * k; and it
  averages the fractions and probabilities over all MoE layers before their product
  (aux_loss_pooling='over_layers'): the same training loss. (transformers adds it only with output_router_logits=true; shardax
  trains with it always: --set model.moe.aux_loss_weight=0 to leave it out.)"""
  if common.arch_name(hf, ARCHITECTURES) not in MOE:
    return None
  jitter = hf.get("router_jitter_noise", 0.0)
  if jitter:
    raise ConfigError(f"config.json router_jitter_noise={jitter}: multiplicative router noise in training "
                      f"is not implemented; set it to 0 (it does not change inference)")
  k = int(hf.get("num_experts_per_tok", 2))
  return dict(num_experts=int(hf.get("num_local_experts", 8)), top_k=k, d_ff=int(hf["intermediate_size"]),
              **MIXTRAL_ROUTER, dispatch="dropless", aux_loss_pooling="over_layers",
              aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) * k, z_loss_weight=0.0)


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for our model config (`arch` as `ARCHITECTURES` names it).

  Keys of the imported `source` config that carry no math (ids, ...) are kept, and so is
  its `max_position_embeddings`: the experiment caps model.max_len at 4096 for what it
  trains on, which must not shrink what the exported model declares (a Llama 3.1 would go
  out at 4096 instead of 131072). A model.max_len above the source's (a context extended by
  training) is written instead. `sliding_window` is the model's attention_window."""
  cls = {v: k for k, v in ARCHITECTURES.items()}[arch]
  source = source or {}
  t = model
  out = common.decoder_keys(t, source, cls, arch, t.kv_heads)
  out.update(
      dtype=t.param_dtype, **common.rope_keys(t))
  if t.head_dim is not None:   # else transformers derives it as hidden_size // heads, as we do
    out["head_dim"] = t.head_dim
  if arch in ("llama", "qwen3") or (arch == "mixtral" and t.qkv_bias):
    out["attention_bias"] = t.qkv_bias
  if arch == "llama":
    out["mlp_bias"] = t.mlp_bias
  if arch in ("mistral", "mixtral"):
    out["sliding_window"] = t.attention_window
  if arch in MOE:
    m = model.moe
    out.update(intermediate_size=m.d_ff, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
               router_jitter_noise=0.0, router_aux_loss_coef=m.aux_loss_weight / m.top_k,
               output_router_logits=bool(source.get("output_router_logits", False)))
  return out


def check_exportable(model, arch: str) -> None:
  """The options `arch` can express; anything else would export a different model."""
  bad = []
  moe = getattr(model, "moe", None)
  if (moe is not None) != (arch in MOE):
    raise ConfigError(f"cannot export as {arch}: the model {'is' if moe else 'is not'} a mixture of experts")
  if moe is not None:
    bad += [f"model.moe.{k}={getattr(moe, k)!r} (Mixtral: {v!r})"
            for k, v in MIXTRAL_ROUTER.items() if getattr(moe, k) != v]
  if model.norm != "rms" or model.mlp != "gated" or model.activation != "silu" or model.parallel_block:
    bad.append("norm/mlp/activation/parallel_block other than rms/gated/silu/False")
  if model.scale_embedding:
    bad.append("scale_embedding=True")
  together = arch in ("llama", "mixtral")   # one attention_bias key: q/k/v and o biases alike
  want = {"qwen2": (True, False)}.get(arch, (model.qkv_bias,) * 2 if together else (False, False))
  if (model.qkv_bias, model.out_bias) != want:
    bad.append(f"qkv_bias={model.qkv_bias}, out_bias={model.out_bias}"
               + (f" ({arch}'s attention_bias sets q/k/v and o biases together)" if together else ""))
  if model.mlp_bias and arch != "llama":
    bad.append("mlp_bias")
  if model.qk_norm != (arch == "qwen3"):
    bad.append(f"qk_norm={model.qk_norm}")
  if model.attention_window is not None and arch not in ("mistral", "mixtral"):
    bad.append(f"attention_window={model.attention_window} ({arch} has no sliding_window)")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")


def weight_names(model_cfg, arch: str) -> common.WeightNames:
  """The tensor names of `model_cfg`'s params: dense blocks, or Mixtral's MoE block in every
  layer (a ConfigError for an MoE layout Mixtral's tensors cannot hold)."""
  moe = getattr(model_cfg, "moe", None)
  if moe is not None and (moe.every != 1 or moe.first_dense_layers or moe.num_shared_experts):
    raise ConfigError(f"Hugging Face MoE weights (Mixtral) have an MoE FFN in every layer and no shared "
                      f"experts; the model has model.moe.every={moe.every}, first_dense_layers="
                      f"{moe.first_dense_layers}, num_shared_experts={moe.num_shared_experts}")
  return common.WeightNames(top=TOP, block=MOE_BLOCK if moe is not None else BLOCK)
