"""gpt-oss's Hugging Face adapter (transformers' `GptOssForCausalLM`).

What gpt-oss is, in the one decoder's options:
  attention   grouped-query with q/k/v/o biases (`attention_bias`), attention sinks (a learned
              logit per query head in the softmax's denominator: `model.attention_sinks`, param
              `attn/sinks` = `self_attn.sinks`), rotate-half RoPE with YaRN (`rope_parameters` /
              `rope_scaling`, `truncate` false as published; without either, transformers' default
              YaRN: factor 32 from 4096 positions, theta 150000);
  layers      `layer_types` ("sliding_attention" / "full_attention") onto `model.layer_pattern`:
              its shortest repeating prefix, a sliding kind with `sliding_window`; one kind
              throughout is the uniform `attention_window` (or none);
  experts     every layer an MoE: the router `mlp.router` has a bias; the top `num_experts_per_tok`
              of its logits get a softmax over themselves, which is the softmax over all experts
              renormalized over the chosen (score 'softmax', renormalize); experts of
              `intermediate_size` with biases (`model.moe.expert_bias`) and the clamped SwiGLU
              (`swiglu_limit`, `swiglu_alpha`: layers/glu.py); dropless (transformers drops nothing).
Tensors: the experts are fused per layer, `mlp.experts.gate_up_proj` [E, embed, 2h] with the gate
and up columns interleaved (gate = [..., 0::2], up = [..., 1::2]) and `down_proj` [E, h, embed],
already input-major like ours; their biases `gate_up_proj_bias` [E, 2h] (interleaved alike) and
`down_proj_bias` [E, embed]. Published checkpoints store the two expert weights in MXFP4
(`quantization_config` quant_method 'mxfp4'); import dequantizes them (models/hf/mxfp4.py).

The balance loss as transformers adds it with output_router_logits: router_aux_loss_coef x its
load_balancing_loss_func (softmax of the biased logits; k times shardax's count, pooled over the
layers), so aux_loss_weight = coef x k with aux_loss_pooling='over_layers' (models/hf/qwen3_moe.py).
"""

from __future__ import annotations

from typing import Any

from shardax.configs.attention import LayerKind
from shardax.configs.schema import ConfigError
from shardax.models.hf import common, mxfp4
from shardax.models.hf.llama import BLOCK, TOP

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}

# initial_context_length: the published config's note of the pretraining length (the YaRN
# original length carries it); transformers' gpt-oss reads neither it nor hidden_act.
MAPPED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
          "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "hidden_act",
          "attention_dropout", "sliding_window", "layer_types", "initial_context_length"}
# `experts_per_token` is the published config's second spelling of num_experts_per_tok.
MOE_MAPPED = {"num_local_experts", "num_experts", "num_experts_per_tok", "experts_per_token",
              "router_aux_loss_coef", "output_router_logits", "swiglu_alpha", "swiglu_limit",
              "quantization_config"}
# transformers' GptOssConfig defaults where config.json leaves a key out.
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
# The MoEConfig fields gpt-oss's router and experts fix.
ROUTER = dict(every=1, first_dense_layers=0, num_shared_experts=0, score="softmax", renormalize=True,
              gate_scale=1.0, bias_update_rate=0.0, router_bias=True, expert_bias=True)
SLIDING, FULL = "sliding_attention", "full_attention"

BLOCK_NAMES = {k: v for k, v in BLOCK.items()
               if k[0] in ("attn_norm", "attn", "mlp_norm") and k[1] not in ("q_norm", "k_norm")}
BLOCK_NAMES.update({
    ("attn", "sinks"): ("self_attn.sinks", None),
    ("moe", "router", "kernel"): ("mlp.router.weight", 1),
    ("moe", "router", "bias"): ("mlp.router.bias", None),
    ("moe", "wi_gate"): ("mlp.experts.gate_up_proj", 0, (0, 2, True)),
    ("moe", "wi_up"): ("mlp.experts.gate_up_proj", 0, (1, 2, True)),
    ("moe", "wo"): ("mlp.experts.down_proj", 0),
    ("moe", "wi_gate_bias"): ("mlp.experts.gate_up_proj_bias", 0, (0, 2, True)),
    ("moe", "wi_up_bias"): ("mlp.experts.gate_up_proj_bias", 0, (1, 2, True)),
    ("moe", "wo_bias"): ("mlp.experts.down_proj_bias", 0),
})


def layer_types(hf: dict[str, Any]) -> list[str]:
  """config.json's layer_types, or transformers' default (sliding on even layers, full on odd)."""
  n = int(hf["num_hidden_layers"])
  types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
  if len(types) != n or set(types) - {SLIDING, FULL}:
    raise ConfigError(f"config.json layer_types={types}: give num_hidden_layers={n} entries of "
                      f"{SLIDING!r} / {FULL!r}")
  return list(types)


def attention_layout(hf: dict[str, Any]) -> dict[str, Any]:
  """attention_window / layer_pattern for the layer types: the shortest prefix the types repeat
  (layers past its last whole repeat are the stack's tail)."""
  types = layer_types(hf)
  window = hf.get("sliding_window")
  if SLIDING in types and not window:
    raise ConfigError(f"config.json layer_types has {SLIDING!r} layers but sliding_window={window!r}")
  period = next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
  if period == 1:
    return {"attention_window": int(window) if types[0] == SLIDING else None, "layer_pattern": ()}
  kinds = {SLIDING: LayerKind(window=int(window or 0) or None), FULL: LayerKind()}
  return {"attention_window": None, "layer_pattern": tuple(kinds[t] for t in types[:period])}


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields for a gpt-oss config.json (ConfigError naming a key we lack)."""
  arch = common.arch_name(hf, ARCHITECTURES)
  common.check_keys(hf, arch, MAPPED, MOE_MAPPED)
  if hf.get("attention_dropout", 0.0):
    raise ConfigError(f"config.json attention_dropout={hf['attention_dropout']}: dropout is not implemented")
  if hf.get("quantization_config") and not mxfp4.is_mxfp4(hf):
    raise ConfigError(f"config.json quantization_config={hf['quantization_config']}: shardax dequantizes "
                      f"gpt-oss's quant_method 'mxfp4' expert weights only")
  heads = int(hf["num_attention_heads"])
  bias = bool(hf.get("attention_bias", True))
  rope_src = hf if hf.get("rope_parameters") or hf.get("rope_scaling") else {
      **hf, "rope_parameters": {**DEFAULT_YARN, "rope_theta": hf.get("rope_theta", 150000.0)}}
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]), d_model=int(hf["hidden_size"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or 64), d_ff=int(hf.get("intermediate_size", 2880)),
      max_len=int(hf.get("max_position_embeddings", 131072)), norm="rms",
      tied_embedding=bool(hf.get("tie_word_embeddings", False)), activation="silu", mlp="gated",
      parallel_block=False, norm_eps=float(hf.get("rms_norm_eps", 1e-5)), scale_embedding=False,
      qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=False, attention_sinks=True,
      **attention_layout(hf), **common.rope(rope_src, default_theta=150000.0))


def top_k(hf: dict[str, Any]) -> int:
  both = {int(hf[k]) for k in ("num_experts_per_tok", "experts_per_token") if k in hf}
  if len(both) > 1:
    raise ConfigError(f"config.json num_experts_per_tok={hf['num_experts_per_tok']} and experts_per_token="
                      f"{hf['experts_per_token']} disagree; keep one")
  return both.pop() if both else 4


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """MoEConfig fields: softmax over the chosen top-k (renormalized softmax), router and expert
  biases, the clamped SwiGLU, dropless; the balance loss as transformers computes it."""
  both = {int(hf[k]) for k in ("num_local_experts", "num_experts") if k in hf}
  if len(both) > 1:
    raise ConfigError(f"config.json num_local_experts and num_experts disagree ({sorted(both)}); keep one")
  k = top_k(hf)
  return dict(num_experts=both.pop() if both else 128, top_k=k, d_ff=int(hf.get("intermediate_size", 2880)),
              **ROUTER, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
              swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), dispatch="dropless",
              aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.9)) * k, aux_loss_pooling="over_layers",
              z_loss_weight=0.0)


def _types_of(model) -> tuple[list[str], int | None]:
  """(layer_types, sliding_window) of a TransformerConfig (check_exportable: one window)."""
  windows = []
  for i in range(model.num_layers):
    kind = model.layer_kind(i)
    windows.append(model.attention_window if kind is None else kind.window)
  found = {w for w in windows if w is not None}
  return [FULL if w is None else SLIDING for w in windows], (found.pop() if found else None)


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for our model config: the source's no-math keys and spellings, the layer
  types of the layer pattern, the experts' weights unquantized (no quantization_config)."""
  source = source or {}
  t, m = model, model.moe
  types, window = _types_of(t)
  out = {k: v for k, v in source.items() if k in common.METADATA | {"initial_context_length"}}
  out.update(
      architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=t.vocab_size,
      hidden_size=t.d_model, intermediate_size=m.d_ff, num_hidden_layers=t.num_layers,
      num_attention_heads=t.num_heads, num_key_value_heads=t.kv_heads, head_dim=t.dim_per_head,
      max_position_embeddings=max(t.max_len, int(source.get("max_position_embeddings", 0))),
      rms_norm_eps=t.norm_eps, tie_word_embeddings=t.tied_embedding, hidden_act=source.get("hidden_act", "silu"),
      attention_dropout=0.0, attention_bias=t.qkv_bias, sliding_window=window or source.get("sliding_window"),
      layer_types=types, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
      router_aux_loss_coef=m.aux_loss_weight / m.top_k, swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha,
      output_router_logits=bool(source.get("output_router_logits", False)), dtype=t.param_dtype,
      **common.rope_keys(t))
  if "experts_per_token" in source:
    out["experts_per_token"] = m.top_k
  return out


def check_exportable(model, arch: str) -> None:
  """The options gpt-oss's config.json can express; anything else would export another model."""
  bad = common.router_mismatches(model, arch, "gpt-oss", ROUTER)
  m = model.moe
  if m.swiglu_limit is None:
    bad.append("model.moe.swiglu_limit=None (gpt-oss's experts clamp)")
  if not model.attention_sinks:
    bad.append("attention_sinks=False")
  if model.norm != "rms" or model.parallel_block or model.scale_embedding or model.mlp_bias or model.qk_norm:
    bad.append("norm/parallel_block/scale_embedding/mlp_bias/qk_norm other than rms/False/False/False/False")
  if model.qkv_bias != model.out_bias:
    bad.append(f"qkv_bias={model.qkv_bias}, out_bias={model.out_bias} (one attention_bias key)")
  if model.attention_softcap is not None or getattr(model, "mla", None) is not None:
    bad.append(f"attention_softcap={model.attention_softcap} or multi-head latent attention")
  plain = LayerKind()
  for kind in model.layer_pattern:
    if {**kind.__dict__, "window": None} != plain.__dict__:
      bad.append(f"layer kind {kind} (gpt-oss's layers differ by their window only)")
  windows = {model.attention_window if k is None else k.window for k in map(model.layer_kind, range(model.num_layers))}
  if len(windows - {None}) > 1:
    bad.append(f"sliding windows {sorted(windows - {None})} (gpt-oss has one sliding_window)")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")


def weight_names(model_cfg, arch: str) -> common.WeightNames:
  """gpt-oss's tensor names: Llama's attention and norms, the sinks, the router and the fused experts."""
  return common.WeightNames(top=TOP, block=BLOCK_NAMES)
