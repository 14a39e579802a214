"""Llama 4's Hugging Face adapter, text model (transformers' `Llama4ForCausalLM`, `Llama4TextConfig`).

What a Llama 4 layer computes, and where it lives in the one decoder:
- Attention kinds per layer (`model.layer_pattern`, configs/attention.py LayerKind): layer i
  rotates q and k when `no_rope_layers[i] == 1` (1 means RoPE, 0 NoPE); a `chunked_attention`
  layer (`layer_types`, by default every RoPE layer) attends within its chunk of
  `attention_chunk_size` tokens; a NoPE layer scales q by the temperature log(floor((pos + 1) /
  floor_scale) + 1) * attn_scale + 1 when `attn_temperature_tuning` (model.temperature_*). The
  pattern is the shortest period of the per-layer kinds.
- RoPE of adjacent pairs (transformers' complex-number `apply_rotary_emb`: model.rope_interleave),
  llama3 scaling as the config has it; `use_qk_norm`: q and k of the RoPE layers divided by
  their RMS over the head dim after RoPE, no weight (model.qk_l2_norm, eps rms_norm_eps).
- MoE layers `moe_layers` (default: every `interleave_moe_layer_step`-th, from layer step - 1):
  they must be the stack's (model.moe.every = step, no first dense layers), else an error
  naming them. Router: the top `num_experts_per_tok` (= 1) logit, gate sigmoid(logit), which
  scales the expert's INPUT (model.moe.gate_input); one shared expert of `intermediate_size`,
  as the routed ones; dense layers' MLP of `intermediate_size_mlp`. No balance loss:
  Llama4ForCausalLM's loss is the cross entropy alone (router_aux_loss_coef and
  output_router_logits do not enter it), so aux_loss_weight = 0; dropless dispatch.

Tensors: attention and norms as Llama's (`self_attn.*`, `input_layernorm`,
`post_attention_layernorm`), the FFN under `feed_forward.`: a dense layer's gate/up/down_proj;
an MoE layer's `router.weight` [E, embed], the shared expert's `shared_expert.*_proj.weight`
and the experts as two tensors per layer, stored input dims first: `experts.gate_up_proj`
[E, embed, 2h] (gate columns, then up: our wi_gate and wi_up, common.Table `part`) and
`experts.down_proj` [E, h, embed] (our wo as it is).
"""

from __future__ import annotations

from typing import Any

from shardax.configs.attention import LayerKind
from shardax.configs.schema import ConfigError
from shardax.models.hf import common
from shardax.models.hf.llama import BLOCK, TOP

ARCHITECTURES = {"Llama4ForCausalLM": "llama4"}

MAPPED = {"vocab_size", "hidden_size", "intermediate_size_mlp", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
          "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "hidden_act",
          "attention_dropout", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "layer_types",
          "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm"}
# router_aux_loss_coef / output_router_logits do not enter Llama4ForCausalLM's loss and
# router_jitter_noise is not read by its modeling code: kept on export, no math.
MOE_MAPPED = {"intermediate_size", "num_local_experts", "num_experts_per_tok", "moe_layers",
              "interleave_moe_layer_step", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise"}
# The MoEConfig fields Llama 4's router fixes.
ROUTER = dict(top_k=1, score="sigmoid", renormalize=False, gate_scale=1.0, gate_input=True, num_shared_experts=1,
              first_dense_layers=0, bias_update_rate=0.0, n_group=1)
LAYER_TYPES = ("chunked_attention", "full_attention")

BLOCK_NAMES = {k: (v.replace("mlp.", "feed_forward.", 1), d) for k, (v, d) in BLOCK.items()
               if not (k[0] == "mlp" and k[-1] == "bias")}
BLOCK_NAMES.update({
    ("moe", "router", "kernel"): ("feed_forward.router.weight", 1),
    ("moe", "wi_gate"): ("feed_forward.experts.gate_up_proj", 0, (0, 2, False)),
    ("moe", "wi_up"): ("feed_forward.experts.gate_up_proj", 0, (1, 2, False)),
    ("moe", "wo"): ("feed_forward.experts.down_proj", 0),
    ("moe", "shared", "gate", "kernel"): ("feed_forward.shared_expert.gate_proj.weight", 1),
    ("moe", "shared", "up", "kernel"): ("feed_forward.shared_expert.up_proj.weight", 1),
    ("moe", "shared", "down", "kernel"): ("feed_forward.shared_expert.down_proj.weight", 1),
})


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
  """Each layer's attention kind as transformers computes it (its config defaults included)."""
  n = int(hf["num_hidden_layers"])
  interval = int(hf.get("no_rope_layer_interval", 4))
  uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
  if len(uses_rope) < n or any(v not in (0, 1) for v in uses_rope[:n]):
    raise ConfigError(f"config.json no_rope_layers={uses_rope}: give a 0 (NoPE) or 1 (RoPE) for each of the "
                      f"{n} layers")
  types = hf.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in uses_rope[:n]]
  if len(types) != n or any(t not in LAYER_TYPES for t in types):
    raise ConfigError(f"config.json layer_types={types}: give one of {LAYER_TYPES} for each of the {n} layers")
  chunk = hf.get("attention_chunk_size", 8192)
  if "chunked_attention" in types and not chunk:
    raise ConfigError("config.json layer_types has chunked_attention layers but attention_chunk_size is "
                      f"{chunk!r}: give the chunk size")
  tuning = bool(hf.get("attn_temperature_tuning", True))
  return [LayerKind(chunk=int(chunk) if t == "chunked_attention" else None, rope=bool(r),
                    temperature_tuning=tuning and not r) for r, t in zip(uses_rope[:n], types)]


def pattern_of(kinds: list[LayerKind]) -> tuple[LayerKind, ...]:
  """The shortest period of `kinds` (() when every layer is plain attention with RoPE)."""
  if all(k == LayerKind() for k in kinds):
    return ()
  p = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
  return tuple(kinds[:p])


def moe_step(hf: dict[str, Any]) -> int:
  """model.moe.every of a config.json whose MoE layers (`moe_layers`, else every
  interleave_moe_layer_step-th) are the stack's: the last of each unit of `every` layers."""
  n = int(hf["num_hidden_layers"])
  step = int(hf.get("interleave_moe_layer_step", 1))
  if step < 1:
    raise ConfigError(f"config.json interleave_moe_layer_step={step} must be >= 1")
  given = hf.get("moe_layers")
  want = list(range(step - 1, n, step)) if given is None else [int(i) for i in given]
  every = want[0] + 1 if want else 0
  if not want or n % every or want != list(range(every - 1, n, every)):
    raise ConfigError(
        f"config.json moe_layers={given} (interleave_moe_layer_step={step}, num_hidden_layers={n}) makes "
        f"layers {want} MoE; shardax's decoder repeats (every - 1) dense layers and one MoE layer, so the "
        f"MoE layers must be every-1, 2*every-1, ... up to the last layer (a dense Llama 4 is not imported)")
  return every


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields for a Llama 4 text config.json (ConfigError naming a key we lack)."""
  arch = common.arch_name(hf, ARCHITECTURES)
  common.check_keys(hf, arch, MAPPED, MOE_MAPPED)
  common.check_silu_without_dropout(hf)
  heads = int(hf["num_attention_heads"])
  bias = bool(hf.get("attention_bias", False))
  head_dim = hf.get("head_dim")
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]), d_model=int(hf["hidden_size"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim) if head_dim else None, d_ff=int(hf.get("intermediate_size_mlp", 16384)),
      max_len=int(hf.get("max_position_embeddings", 131072)), attention_window=None, norm="rms",
      tied_embedding=bool(hf.get("tie_word_embeddings", False)), activation="silu", mlp="gated",
      parallel_block=False, norm_eps=float(hf.get("rms_norm_eps", 1e-5)), scale_embedding=False,
      qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=False, qk_l2_norm=bool(hf.get("use_qk_norm", True)),
      rope_interleave=True, layer_pattern=pattern_of(layer_kinds(hf)),
      temperature_floor_scale=float(hf.get("floor_scale", 8192)), temperature_scale=float(hf.get("attn_scale", 0.1)),
      **common.rope(hf, default_theta=500000.0))


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """MoEConfig fields: top-1 sigmoid gates on the expert's input, one shared expert, the
  layout (`moe_step`), dropless, no balance loss (transformers' Llama 4 loss has none)."""
  k = int(hf.get("num_experts_per_tok", 1))
  if k != 1:
    raise ConfigError(f"config.json num_experts_per_tok={k}: shardax's Llama 4 router (the gate scales the "
                      f"expert's input, model.moe.gate_input) is implemented for 1 expert per token")
  e = int(hf.get("num_local_experts", 16))
  if e < 2:
    raise ConfigError(f"config.json num_local_experts={e}: a mixture of experts needs at least 2")
  return dict(num_experts=e, d_ff=int(hf.get("intermediate_size", 8192)), every=moe_step(hf), **ROUTER,
              dispatch="dropless", aux_loss_weight=0.0, z_loss_weight=0.0)


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for our model config: the source's no-math keys and router bookkeeping, its
  max_position_embeddings unless model.max_len is above it; the per-layer lists written out."""
  source = source or {}
  t, m = model, model.moe
  n = t.num_layers
  kinds = [t.layer_kind(i) or LayerKind() for i in range(n)]
  chunks = {k.chunk for k in kinds if k.chunk is not None}
  out = {k: v for k, v in source.items() if k in common.METADATA}
  out.update(
      architectures=["Llama4ForCausalLM"], model_type="llama4_text", vocab_size=t.vocab_size,
      hidden_size=t.d_model, intermediate_size_mlp=t.d_ff, intermediate_size=m.d_ff, num_hidden_layers=n,
      num_attention_heads=t.num_heads, num_key_value_heads=t.kv_heads, head_dim=t.dim_per_head,
      max_position_embeddings=max(t.max_len, int(source.get("max_position_embeddings", 0))),
      rms_norm_eps=t.norm_eps, tie_word_embeddings=t.tied_embedding, hidden_act="silu", attention_dropout=0.0,
      attention_bias=t.qkv_bias, use_qk_norm=t.qk_l2_norm, dtype=t.param_dtype,
      no_rope_layers=[int(k.rope) for k in kinds], no_rope_layer_interval=int(source.get("no_rope_layer_interval", 4)),
      layer_types=["chunked_attention" if k.chunk is not None else "full_attention" for k in kinds],
      attention_chunk_size=chunks.pop() if chunks else source.get("attention_chunk_size", 8192),
      attn_temperature_tuning=any(k.temperature_tuning for k in kinds) if not all(k.rope for k in kinds)
      else bool(source.get("attn_temperature_tuning", True)),
      floor_scale=_number(t.temperature_floor_scale), attn_scale=t.temperature_scale,
      num_local_experts=m.num_experts, num_experts_per_tok=m.top_k, interleave_moe_layer_step=m.every,
      moe_layers=list(range(m.every - 1, n, m.every)),
      router_aux_loss_coef=source.get("router_aux_loss_coef", 0.001),
      router_jitter_noise=source.get("router_jitter_noise", 0.0),
      output_router_logits=bool(source.get("output_router_logits", False)), **common.rope_keys(t))
  return out


def _number(x: float) -> float | int:
  return int(x) if float(x).is_integer() else x


def check_exportable(model, arch: str) -> None:
  """The options Llama 4's config.json can express; anything else would export another model."""
  bad = common.router_mismatches(model, arch, "Llama 4", ROUTER)
  if model.norm != "rms" or model.mlp != "gated" or model.activation != "silu" or model.parallel_block:
    bad.append("norm/mlp/activation/parallel_block other than rms/gated/silu/False")
  if model.scale_embedding or model.mlp_bias or model.qk_norm or model.qkv_bias != model.out_bias:
    bad.append(f"scale_embedding={model.scale_embedding}, mlp_bias={model.mlp_bias}, qk_norm={model.qk_norm}, "
               f"qkv_bias={model.qkv_bias}, out_bias={model.out_bias} (Llama 4: False, False, False, "
               f"q/k/v and o biases together)")
  if not model.rope_interleave:
    bad.append("model.rope_interleave=False (Llama 4 rotates adjacent pairs)")
  if model.attention_window is not None or model.attention_softcap is not None or model.mla is not None:
    bad.append(f"attention_window={model.attention_window}, attention_softcap={model.attention_softcap}, mla")
  kinds = [model.layer_kind(i) or LayerKind() for i in range(model.num_layers)]
  tuned = any(k.temperature_tuning for k in kinds)   # one attn_temperature_tuning for every NoPE layer
  if len({k.chunk for k in kinds if k.chunk is not None}) > 1 or any(
      k.window is not None or k.rope_theta is not None or not getattr(k, "rope_scaled", True)
      or k.temperature_tuning != (tuned and not k.rope) for k in kinds):
    bad.append("layer kinds beyond one chunk size, NoPE and the NoPE layers' temperature (windows, own RoPE "
               "bases or scaling)")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")


def weight_names(model_cfg, arch: str) -> common.WeightNames:
  """Llama 4's tensor names: Llama's for attention, norms and the head; the FFN under `feed_forward.`."""
  return common.WeightNames(top=TOP, block=BLOCK_NAMES)
