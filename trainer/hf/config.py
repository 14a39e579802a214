"""config.json <-> TransformerConfig fields, for the dense decoder architectures we implement.

Every key of config.json is accounted for: mapped onto a field, checked against the one value
we implement (e.g. `hidden_act` must be silu), or known to leave the math alone (ids, dtype,
bookkeeping). Anything else is an error naming the key, never silently ignored: a model whose
config says something we do not compute must not load as a different model.

Both spellings of RoPE are read: `rope_theta` + `rope_scaling` (transformers 4) and
`rope_parameters` (transformers 5, which also writes it); export writes both.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardax.configs.schema import ConfigError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
NOT_YET = {"MixtralForCausalLM": "mixture-of-experts models are not supported by the importer yet "
                                 "(they wait for the MoE layers)"}

# Keys that do not change what the model computes (bookkeeping, ids, generation defaults).
METADATA = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
            "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
            "pretraining_tp", "max_window_layers", "_name_or_path", "output_attentions",
            "output_hidden_states", "return_dict", "tie_encoder_decoder", "is_decoder",
            "_attn_implementation_autoset", "unk_token_id", "sep_token_id", "decoder_start_token_id",
            "task_specific_params", "problem_type", "id2label", "label2id", "use_return_dict"}
MAPPED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
          "attention_bias", "mlp_bias", "hidden_act", "attention_dropout", "sliding_window",
          "use_sliding_window", "layer_types"}


def read(model_dir: str) -> dict[str, Any]:
  path = os.path.join(os.path.expanduser(model_dir), "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"hf:{model_dir}: no config.json there; give a Hugging Face model directory "
                      f"(config.json, *.safetensors, tokenizer.json)")
  with open(path) as f:
    return json.load(f)


def architecture(hf: dict[str, Any]) -> str:
  archs = hf.get("architectures") or []
  for a in archs:
    if a in NOT_YET:
      raise ConfigError(f"config.json architectures={archs}: {a}: {NOT_YET[a]}")
  known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
  if len(archs) != 1 or not known:
    raise ConfigError(f"config.json architectures={archs}: shardax imports exactly one of "
                      f"{sorted(ARCHITECTURES)}")
  return known[0]


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
  """rope_theta and llama3 scaling fields, from either spelling."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
  src = params if params.get("rope_type", params.get("type")) == kind and kind != "default" else scaling
  out: dict[str, Any] = {"rope_theta": float(theta)}
  if kind == "default":
    extra = set(params) - {"rope_type", "type"}
    if extra:
      raise ConfigError(f"config.json rope_parameters has {sorted(extra)} that plain RoPE does not use")
    return out
  if kind != "llama3":
    raise ConfigError(f"config.json rope scaling type {kind!r} is not implemented (shardax has "
                      f"'default' and 'llama3')")
  known = {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
           "original_max_position_embeddings", "rope_theta"}
  extra = set(src) - known
  if extra:
    raise ConfigError(f"config.json llama3 rope scaling has keys {sorted(extra)} shardax does not implement")
  out.update(rope_scaling="llama3", rope_scaling_factor=float(src["factor"]),
             rope_low_freq_factor=float(src["low_freq_factor"]),
             rope_high_freq_factor=float(src["high_freq_factor"]),
             rope_original_max_len=int(src["original_max_position_embeddings"]))
  return out


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields for a config.json (raises ConfigError naming a key we lack)."""
  arch = architecture(hf)
  unknown = sorted(set(hf) - METADATA - MAPPED)
  if unknown:
    raise ConfigError(f"config.json key(s) {unknown} are not implemented by shardax's {arch} import; "
                      f"a key that changes the math cannot be ignored (remove it only if it does not)")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ConfigError(f"config.json hidden_act={act!r}: shardax's gated MLP implements 'silu'")
  if hf.get("attention_dropout", 0.0):
    raise ConfigError(f"config.json attention_dropout={hf['attention_dropout']}: dropout is not implemented")
  if hf.get("use_sliding_window"):
    raise ConfigError("config.json use_sliding_window=true: sliding-window attention is not implemented")
  types = set(hf.get("layer_types") or ["full_attention"])
  if types != {"full_attention"}:
    raise ConfigError(f"config.json layer_types={sorted(types)}: only full attention is implemented")
  max_len = int(hf.get("max_position_embeddings", 2048))
  window = hf.get("sliding_window") if arch == "mistral" else None
  if window is not None:  # equal to full attention up to the window: cap the length there
    max_len = min(max_len, int(window))
  heads = int(hf["num_attention_heads"])
  d_model = int(hf["hidden_size"])
  head_dim = hf.get("head_dim")
  attention_bias = bool(hf.get("attention_bias", False))
  if arch == "qwen2":
    if "attention_bias" in hf:
      raise ConfigError("config.json attention_bias: Qwen2 always has q/k/v biases; the key is not expected")
    qkv_bias, out_bias = True, False
  else:
    qkv_bias = out_bias = attention_bias
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]), d_model=d_model,
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim) if head_dim else None, d_ff=int(hf["intermediate_size"]),
      max_len=max_len, norm="rms", tied_embedding=bool(hf.get("tie_word_embeddings", arch != "llama" and arch != "mistral")),
      activation="silu", mlp="gated", parallel_block=False, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      scale_embedding=False, qkv_bias=qkv_bias, out_bias=out_bias,
      mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=arch == "qwen3", **_rope(hf))


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for our model config (`arch` as `architecture` names it). Keys of the
  imported `source` config that carry no math (ids, ...) are kept."""
  cls = {v: k for k, v in ARCHITECTURES.items()}[arch]
  out = {k: v for k, v in (source or {}).items() if k in METADATA}
  rope = {"rope_type": "default", "rope_theta": model.rope_theta}
  if model.rope_scaling == "llama3":
    rope = {"rope_type": "llama3", "rope_theta": model.rope_theta, "factor": model.rope_scaling_factor,
            "low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_len}
  out.update(
      architectures=[cls], model_type=arch, vocab_size=model.vocab_size, hidden_size=model.d_model,
      intermediate_size=model.d_ff, num_hidden_layers=model.num_layers,
      num_attention_heads=model.num_heads, num_key_value_heads=model.kv_heads,
      max_position_embeddings=model.max_len,
      rms_norm_eps=model.norm_eps, tie_word_embeddings=model.tied_embedding, hidden_act="silu",
      rope_parameters=rope, rope_theta=model.rope_theta, dtype=model.param_dtype)
  if model.rope_scaling == "llama3":
    out["rope_scaling"] = rope
  if model.head_dim is not None:   # else transformers derives it as hidden_size // heads, as we do
    out["head_dim"] = model.head_dim
  if arch in ("llama", "qwen3"):
    out["attention_bias"] = model.qkv_bias
  if arch == "llama":
    out["mlp_bias"] = model.mlp_bias
  if arch == "mistral":
    out["sliding_window"] = None
  return out


def check_exportable(model, arch: str) -> None:
  """The options `arch` can express; anything else would export a different model."""
  bad = []
  if model.norm != "rms" or model.mlp != "gated" or model.activation != "silu" or model.parallel_block:
    bad.append("norm/mlp/activation/parallel_block other than rms/gated/silu/False")
  if model.scale_embedding:
    bad.append("scale_embedding=True")
  want = {"llama": (model.qkv_bias, model.qkv_bias), "qwen2": (True, False)}.get(arch, (False, False))
  if (model.qkv_bias, model.out_bias) != want and arch != "llama":
    bad.append(f"qkv_bias={model.qkv_bias}, out_bias={model.out_bias}")
  if arch == "llama" and model.qkv_bias != model.out_bias:
    bad.append("Llama's attention_bias sets q/k/v and o biases together")
  if model.mlp_bias and arch != "llama":
    bad.append("mlp_bias")
  if model.qk_norm != (arch == "qwen3"):
    bad.append(f"qk_norm={model.qk_norm}")
  if model.rope_scaling != "none" and arch != "llama":
    bad.append("rope_scaling")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")
