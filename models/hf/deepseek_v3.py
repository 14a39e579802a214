"""DeepSeek-V3's Hugging Face adapter (transformers' `DeepseekV3ForCausalLM`; V2/Kimi-K2-shaped
configs through the same keys).

Attention: multi-head latent attention (`model.mla`, layers/mla.py) whose params are the
checkpoint's tensors one for one: q_a_proj / q_a_layernorm / q_b_proj (or q_proj when
q_lora_rank is null), kv_a_proj_with_mqa (latent and RoPE key), kv_a_layernorm, kv_b_proj (no-RoPE
keys and values), o_proj; `rope_interleave` (transformers' default true: model.rope_interleave)
rotates adjacent pairs; YaRN rope scaling with its mscale on the softmax scale (models/hf/common.py
`yarn_scaling`). `attention_bias` biases q_a_proj, kv_a_proj_with_mqa and o_proj, as ours.

MoE: the first `first_k_dense_replace` layers dense (intermediate_size), then every layer
(`moe_layer_freq` 1) `n_routed_experts` of `moe_intermediate_size` and `n_shared_experts`
shared ones; the router's sigmoid scores plus `e_score_correction_bias` choose the top
`num_experts_per_tok` within the `topk_group` best of `n_group` groups (layers/routers.py),
gates the unbiased scores renormalized when `norm_topk_prob`, times `routed_scaling_factor`.
The bias is our `balance_bias`, which exists with bias balancing, so the import trains it
at DeepSeek-V3's rate (bias_update_rate 1e-3; --set model.moe.bias_update_rate to change).
transformers computes no balance loss for it: aux_loss_weight 0 (V3's sequence-wise
alpha was 1e-4: --set model.moe.aux_loss_weight).

Checkpoints as published store their linear weights in fp8 with per-128x128-block inverse
scales (`quantization_config`): the import dequantizes them (models/hf/fp8.py); export
writes the model's dtype and no quantization_config.

Multi-token prediction (`num_nextn_predict_layers`, transformers 5's alias `num_mtp_layers`):
`model.mtp` (layers/mtp.py) with that depth, its modules the checkpoint's layers num_hidden_layers
.. + D - 1: enorm, hnorm, eh_proj, shared_head.norm and a whole decoder layer (MLA, the MoE
FFN). Each such layer also stores `embed_tokens` and `shared_head.head`, copies of the main
embedding and head (the paper shares them): the import checks they equal them bit for bit and
reads them no further, and export writes the main tensors under those names again. transformers
builds no MTP module and saves none, so a checkpoint whose weights hold no such layer is imported
with model.mtp=None (experiments/hf.py). loss_weight 0.1, DeepSeek-V3's lambda for its last
4.8T tokens (--set model.mtp.loss_weight to change).

Not imported, by name: other routers (`scoring_func` other than sigmoid, `topk_method` other
than noaux_tc).
"""

from __future__ import annotations

from typing import Any

from shardax.configs.mla import MLAConfig
from shardax.configs.mtp import MTPConfig
from shardax.configs.schema import ConfigError
from shardax.models.hf import common, fp8
from shardax.models.hf.llama import BLOCK, TOP

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}

MAPPED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "tie_word_embeddings", "attention_bias", "attention_dropout", "hidden_act",
          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
          "head_dim", "rope_interleave", "num_nextn_predict_layers", "num_mtp_layers", "auto_map", "ep_size",
          "quantization_config"}
MOE_MAPPED = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
              "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "scoring_func", "topk_method", "aux_loss_alpha", "seq_aux",
              "output_router_logits"}
BIAS_UPDATE_RATE = 1e-3   # DeepSeek-V3's gamma (arXiv 2412.19437 section 4.2)
MTP_LOSS_WEIGHT = 0.1     # DeepSeek-V3's lambda after its first 10T tokens (section 4.2)
# An MTP module's own tensors (its block's are BLOCK_NAMES), inside model.layers.{num_hidden_layers + k}.
MTP_NAMES = {
    ("enorm", "scale"): ("enorm.weight", None),
    ("hnorm", "scale"): ("hnorm.weight", None),
    ("eh_proj", "kernel"): ("eh_proj.weight", 2),
    ("head_norm", "scale"): ("shared_head.norm.weight", None),
}

MLA_BLOCK = {
    ("attn", "query", "kernel"): ("self_attn.q_proj.weight", 1),
    ("attn", "q_down", "kernel"): ("self_attn.q_a_proj.weight", 1),
    ("attn", "q_down", "bias"): ("self_attn.q_a_proj.bias", None),
    ("attn", "q_norm", "scale"): ("self_attn.q_a_layernorm.weight", None),
    ("attn", "q_up", "kernel"): ("self_attn.q_b_proj.weight", 1),
    ("attn", "kv_down", "kernel"): ("self_attn.kv_a_proj_with_mqa.weight", 1),
    ("attn", "kv_down", "bias"): ("self_attn.kv_a_proj_with_mqa.bias", None),
    ("attn", "kv_norm", "scale"): ("self_attn.kv_a_layernorm.weight", None),
    ("attn", "kv_up", "kernel"): ("self_attn.kv_b_proj.weight", 1),
    ("attn", "out", "kernel"): ("self_attn.o_proj.weight", 2),
    ("attn", "out", "bias"): ("self_attn.o_proj.bias", None),
}
BLOCK_NAMES = {k: v for k, v in BLOCK.items() if k[0] in ("attn_norm", "mlp_norm")
               or (k[0] == "mlp" and k[-1] == "kernel")}
BLOCK_NAMES.update(MLA_BLOCK)
BLOCK_NAMES.update({
    ("moe", "router", "kernel"): ("mlp.gate.weight", 1),
    ("moe", "balance_bias"): ("mlp.gate.e_score_correction_bias", None),
    ("moe", "wi_gate"): ("mlp.experts.{e}.gate_proj.weight", 1),
    ("moe", "wi_up"): ("mlp.experts.{e}.up_proj.weight", 1),
    ("moe", "wo"): ("mlp.experts.{e}.down_proj.weight", 1),
    ("moe", "shared", "gate", "kernel"): ("mlp.shared_experts.gate_proj.weight", 1),
    ("moe", "shared", "up", "kernel"): ("mlp.shared_experts.up_proj.weight", 1),
    ("moe", "shared", "down", "kernel"): ("mlp.shared_experts.down_proj.weight", 1),
})


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def mla_config(hf: dict[str, Any]) -> MLAConfig:
  q = hf.get("q_lora_rank", 1536)
  m = MLAConfig(q_lora_rank=None if q is None else int(q), kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
                qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
                qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)), v_head_dim=int(hf.get("v_head_dim", 128)))
  for key, want in (("qk_head_dim", m.qk_head_dim), ("head_dim", m.qk_rope_head_dim)):
    _require(hf.get(key, want) == want, f"config.json {key}={hf.get(key)}: DeepSeek-V3 derives it as {want} "
                                        f"(qk_nope_head_dim + qk_rope_head_dim, and qk_rope_head_dim)")
  return m


def mtp_config(hf: dict[str, Any]) -> MTPConfig | None:
  """model.mtp for `num_nextn_predict_layers` (or its alias `num_mtp_layers`); None for 0."""
  depths = {hf[k] for k in ("num_nextn_predict_layers", "num_mtp_layers") if hf.get(k) is not None}
  _require(len(depths) <= 1, f"config.json num_nextn_predict_layers={hf.get('num_nextn_predict_layers')} and "
                             f"num_mtp_layers={hf.get('num_mtp_layers')} (its alias) disagree; keep one")
  depth = int(depths.pop()) if depths else 0
  return MTPConfig(depth=depth, loss_weight=MTP_LOSS_WEIGHT) if depth else None


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields for a DeepSeek-V3 config.json (ConfigError naming a key we lack)."""
  arch = common.arch_name(hf, ARCHITECTURES)
  common.check_keys(hf, arch, MAPPED, MOE_MAPPED)
  fp8.check(hf.get("quantization_config"))   # block-scaled fp8 weights: dequantized on import
  common.check_silu_without_dropout(hf)
  heads = int(hf["num_attention_heads"])
  _require(int(hf.get("num_key_value_heads") or heads) == heads,
           f"config.json num_key_value_heads={hf.get('num_key_value_heads')}: multi-head latent attention "
           f"has one key and value per query head (num_attention_heads={heads})")
  bias = bool(hf.get("attention_bias", False))
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]), d_model=int(hf["hidden_size"]),
      num_heads=heads, num_kv_heads=None, head_dim=None, d_ff=int(hf.get("intermediate_size", 18432)),
      max_len=int(hf.get("max_position_embeddings", 4096)), attention_window=None, norm="rms",
      tied_embedding=bool(hf.get("tie_word_embeddings", False)), activation="silu", mlp="gated",
      parallel_block=False, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), scale_embedding=False,
      qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=False, mla=mla_config(hf), mtp=mtp_config(hf),
      rope_interleave=bool(hf.get("rope_interleave", True)), **common.rope(hf))


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """MoEConfig fields: sigmoid top-k with the selection bias, group-limited, dropless."""
  for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
    _require(hf.get(key, want) == want, f"config.json {key}={hf.get(key)!r}: shardax imports DeepSeek-V3's "
                                        f"router ({key}={want!r})")
  _require(hf.get("n_routed_experts") is not None, "config.json n_routed_experts is null: a dense DeepSeek "
                                                   "model is not an MoE import")
  return dict(num_experts=int(hf["n_routed_experts"]), top_k=int(hf.get("num_experts_per_tok", 8)),
              d_ff=int(hf.get("moe_intermediate_size", 2048)), every=1,
              first_dense_layers=int(hf.get("first_k_dense_replace", 3)),
              num_shared_experts=int(hf.get("n_shared_experts") or 0), score="sigmoid",
              renormalize=bool(hf.get("norm_topk_prob", True)), gate_scale=float(hf.get("routed_scaling_factor", 2.5)),
              n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
              bias_update_rate=BIAS_UPDATE_RATE, dispatch="dropless", aux_loss_weight=0.0, z_loss_weight=0.0)


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for our model config: the source's no-math keys and its max_position_embeddings
  unless model.max_len is above it."""
  source = source or {}
  t, m, a = model, model.moe, model.mla
  out = common.decoder_keys(t, source, "DeepseekV3ForCausalLM", "deepseek_v3", t.num_heads)
  out.update(
      attention_bias=t.qkv_bias, dtype=t.param_dtype, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
      qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
      rope_interleave=t.rope_interleave, n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k,
      moe_intermediate_size=m.d_ff, n_shared_experts=m.num_shared_experts, first_k_dense_replace=m.first_dense_layers,
      n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.renormalize, routed_scaling_factor=m.gate_scale,
      head_dim=a.qk_rope_head_dim, qk_head_dim=a.qk_head_dim,
      output_router_logits=bool(source.get("output_router_logits", False)),
      num_nextn_predict_layers=t.mtp.depth if t.mtp is not None else int(source.get("num_nextn_predict_layers", 0)),
      **common.rope_keys(t))
  return out


def check_exportable(model, arch: str) -> None:
  """The options DeepSeek-V3's config.json can express; anything else would export another model."""
  m = model.moe
  bad = []
  if model.mla is None or m is None:
    raise ConfigError(f"cannot export as {arch}: the model needs model.mla and model.moe "
                      f"(has mla={model.mla is not None}, moe={m is not None})")
  want = dict(every=1, score="sigmoid", dispatch="dropless")
  bad += [f"model.moe.{k}={getattr(m, k)!r} (DeepSeek-V3: {v!r})" for k, v in want.items() if getattr(m, k) != v]
  if not m.bias_update_rate:
    bad.append("model.moe.bias_update_rate=0 (no selection bias: e_score_correction_bias has nothing to hold)")
  if model.norm != "rms" or model.mlp != "gated" or model.activation != "silu" or model.parallel_block:
    bad.append("norm/mlp/activation/parallel_block other than rms/gated/silu/False")
  if model.scale_embedding or model.mlp_bias or model.qkv_bias != model.out_bias:
    bad.append(f"scale_embedding={model.scale_embedding}, mlp_bias={model.mlp_bias}, qkv_bias={model.qkv_bias}, "
               f"out_bias={model.out_bias} (DeepSeek-V3: False, False, attention_bias on both)")
  if model.attention_window is not None or model.attention_softcap is not None:
    bad.append(f"attention_window={model.attention_window}, attention_softcap={model.attention_softcap}")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")


def weight_names(model_cfg, arch: str) -> common.WeightNames:
  """DeepSeek-V3's tensor names: MLA attention in every layer, Llama's dense MLP names in the
  first dense layers, the router, its bias, the experts and the shared experts under `mlp.`;
  the MTP modules' (MTP_NAMES and their blocks') and the copies of the embedding and head
  each MTP layer stores."""
  copies = {}
  for k in range(0, model_cfg.mtp.depth if model_cfg.mtp is not None else 0):
    layer = common.LAYER_PREFIX.format(i=model_cfg.num_layers + k)
    copies[layer + "embed_tokens.weight"] = "model.embed_tokens.weight"
    copies[layer + "shared_head.head.weight"] = "model.embed_tokens.weight" if model_cfg.tied_embedding else "lm_head.weight"
  return common.WeightNames(top=TOP, block=BLOCK_NAMES, mtp=MTP_NAMES, copies=copies)
