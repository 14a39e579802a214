"""Gemma 2 and Gemma 3 (text) Hugging Face adapter (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`).

What the decoder computes for them (options of the one LM, configs/schema.py):
  norm='rms_plus_one'        every RMSNorm scales by (1 + w) and the checkpoint stores w, so the
                             tensors copy as they are (layers/norm.py);
  post_norms                 input_layernorm -> attention -> post_attention_layernorm, then
                             pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm;
  qk_norm                    Gemma 3's q_norm / k_norm (also 1 + w); Gemma 2 has none;
  query_pre_attn_scalar      the softmax scale query_pre_attn_scalar^-1/2;
  activation='gelu'          jax.nn.gelu is the tanh form, transformers' gelu_pytorch_tanh;
  scale_embedding            rows x sqrt(hidden_size) in the compute dtype (transformers casts the
                             normalizer to the weights' dtype);
  attention_softcap, final_logit_softcap   attn_logit_softcapping, final_logit_softcapping.
Local and global layers: `layer_types` (or, in older configs, `sliding_window_pattern`: layer i
slides iff (i + 1) % pattern) becomes `model.layer_pattern`, its shortest repeating prefix (the
last repetition may be cut: a tail); a list that does not repeat is refused. A sliding kind
has `window=sliding_window`. RoPE per layer type (transformers 5: `rope_parameters` keyed by
type; the hub's Gemma 3 configs: rope_theta for global layers, rope_local_base_freq for local
ones, rope_scaling for the global ones only): the global base is model.rope_theta, a local
base that differs is its kind's rope_theta, and a type without scaling is `rope_scaled=False`
under the model's scaling (Gemma 3's linear factor 8 on global layers).
"""

from __future__ import annotations

from typing import Any

from shardax.configs.attention import LayerKind
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError
from shardax.models.hf import common
from shardax.models.hf.llama import BLOCK as LLAMA_BLOCK, TOP

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3_text"}
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6}       # transformers' layer_types when absent
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # Gemma 3's rope bases when absent

# `hidden_act`: Gemma 2's hub configs carry it beside hidden_activation, which alone picks the
# MLP's activation. `cache_implementation`: which decode cache transformers builds (no math).
# `sliding_window_size`: Gemma 2's hub configs repeat sliding_window under this name.
MAPPED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_activation", "hidden_act", "max_position_embeddings",
          "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
          "rope_local_base_freq", "attention_bias", "attention_dropout", "query_pre_attn_scalar",
          "sliding_window", "sliding_window_pattern", "_sliding_window_pattern", "layer_types",
          "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
          "cache_implementation", "sliding_window_size"}
ACTIVATIONS = ("gelu_pytorch_tanh",)

BLOCK = {k: v for k, v in LLAMA_BLOCK.items() if k[0] != "mlp" or k[-1] != "bias"}
BLOCK.update({
    ("attn_post_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", None),
    ("mlp_post_norm", "scale"): ("post_feedforward_layernorm.weight", None),
})


def layer_types(hf: dict[str, Any], arch: str) -> list[str]:
  """config.json's per-layer types, or transformers' from `sliding_window_pattern`."""
  n = int(hf["num_hidden_layers"])
  types = hf.get("layer_types")
  if types is None:
    every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or DEFAULT_PATTERN[arch])
    types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
  bad = sorted(set(types) - {SLIDING, FULL})
  if len(types) != n or bad:
    raise ConfigError(f"config.json layer_types: {len(types)} entries for num_hidden_layers={n}"
                      f"{f' with unknown types {bad}' if bad else ''}; Gemma layers are {SLIDING!r} or {FULL!r}")
  return list(types)


def period(types: list[str]) -> int:
  """The shortest p with types[i] == types[i - p] for every i >= p: the repeating pattern's
  length. A ConfigError naming layer_types when nothing repeats (p would be the whole list)."""
  n, p = len(types), 1
  for p in range(1, n + 1):
    if all(types[i] == types[i - p] for i in range(p, n)):
      break
  if p == n and n > 1:
    raise ConfigError(f"config.json layer_types={types} is not a repeating pattern; shardax's decoder "
                      f"repeats one unit of layer kinds (model.layer_pattern) with at most a cut tail")
  return p


def rope_by_type(hf: dict[str, Any], arch: str) -> dict[str, dict[str, Any]]:
  """{layer type: {'rope_type', 'rope_theta'[, 'factor']}} from either spelling."""
  params = dict(hf.get("rope_parameters") or {})
  if arch == "gemma2":   # one RoPE for every layer
    one = common.rope(hf)
    if set(one) - {"rope_theta"}:
      raise ConfigError(f"config.json rope scaling {hf.get('rope_parameters') or hf.get('rope_scaling')}: "
                        f"shardax's Gemma 2 import rotates every layer without scaling, as Gemma 2 does")
    return {t: {"rope_type": "default", "rope_theta": one["rope_theta"]} for t in (SLIDING, FULL)}
  if params and not set(params) <= {SLIDING, FULL}:
    raise ConfigError(f"config.json rope_parameters={params}: Gemma 3's are keyed by layer type "
                      f"({SLIDING!r}, {FULL!r})")
  if not params:   # the hub's spelling
    full = {"rope_type": "default", **dict(hf.get("rope_scaling") or {})}
    full["rope_theta"] = hf.get("rope_theta", DEFAULT_THETA[FULL])
    local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", DEFAULT_THETA[SLIDING])}
    params = {FULL: full, SLIDING: local}
  out = {}
  for kind in (SLIDING, FULL):
    p = dict(params.get(kind) or {})
    rope_type = p.pop("rope_type", p.pop("type", "default"))
    theta = float(p.pop("rope_theta", DEFAULT_THETA[kind]))
    factor = p.pop("factor", None)
    if rope_type not in ("default", "linear") or p or (rope_type == "linear") != (factor is not None):
      raise ConfigError(f"config.json rope for {kind} layers {params.get(kind)}: shardax's Gemma import "
                        f"implements rope_type 'default' and 'linear' (with its factor)")
    out[kind] = {"rope_type": rope_type, "rope_theta": theta, **({"factor": float(factor)} if factor else {})}
  return out


def rope_fields(ropes: dict[str, dict[str, Any]], window: int) -> tuple[dict[str, Any], dict[str, LayerKind]]:
  """(model RoPE fields, {layer type: its LayerKind}): the global type's base and scaling are
  the model's; the local type's base (when it differs) and no scaling (when only the global
  type scales) are its kind's."""
  full = ropes[FULL]
  scaled = {t: r for t, r in ropes.items() if r["rope_type"] == "linear"}
  factors = {r["factor"] for r in scaled.values()}
  if len(factors) > 1:
    raise ConfigError(f"config.json rope: linear factors {sorted(factors)} differ between layer types; "
                      f"shardax scales every scaled layer by the one model.rope_scaling.factor")
  fields = {"rope_theta": full["rope_theta"],
            "rope_scaling": RopeScaling("linear", factor=factors.pop()) if scaled else None}
  def kind(t, **mask):
    theta = None if ropes[t]["rope_theta"] == full["rope_theta"] else ropes[t]["rope_theta"]
    return LayerKind(**mask, rope_theta=theta, rope_scaled=t in scaled or not scaled)

  return fields, {SLIDING: kind(SLIDING, window=window), FULL: kind(FULL)}


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields of a Gemma 2 / Gemma 3 text config.json (a ConfigError naming a
  key or value shardax does not compute)."""
  arch = common.arch_name(hf, ARCHITECTURES)
  common.check_keys(hf, arch, MAPPED)
  act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
  if act not in ACTIVATIONS:
    raise ConfigError(f"config.json hidden_activation={act!r}: shardax's Gemma MLP implements "
                      f"{ACTIVATIONS} (jax.nn.gelu's tanh form)")
  for key in ("attention_dropout", "use_bidirectional_attention"):
    if hf.get(key):
      raise ConfigError(f"config.json {key}={hf[key]!r}: not implemented (shardax's decoder is causal, "
                        f"without dropout); set it to {0.0 if key == 'attention_dropout' else False}")
  types = layer_types(hf, arch)
  window = hf.get("sliding_window")
  if hf.get("sliding_window_size", window) != window:
    raise ConfigError(f"config.json sliding_window={window} and sliding_window_size={hf['sliding_window_size']} "
                      f"disagree; keep one")
  if SLIDING in types and not window:
    raise ConfigError(f"config.json layer_types has {SLIDING!r} layers but sliding_window={window!r}")
  rope, kinds = rope_fields(rope_by_type(hf, arch), int(window or 1))
  heads = int(hf["num_attention_heads"])
  head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
  bias = bool(hf.get("attention_bias", False))
  cap = lambda key: None if hf.get(key) is None else float(hf[key])
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=len(types), d_model=int(hf["hidden_size"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
      d_ff=int(hf["intermediate_size"]), max_len=int(hf.get("max_position_embeddings", 8192)),
      norm="rms_plus_one", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), post_norms=True,
      tied_embedding=bool(hf.get("tie_word_embeddings", True)), activation="gelu", mlp="gated",
      parallel_block=False, scale_embedding=True, qkv_bias=bias, out_bias=bias, mlp_bias=False,
      qk_norm=arch == "gemma3_text", query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
      attention_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"),
      attention_window=None, layer_pattern=tuple(kinds[t] for t in types[:period(types)]), **rope)


def moe_fields(hf: dict[str, Any]) -> None:
  """Gemma 2 and 3 are dense."""
  return None


def _types_and_ropes(model) -> tuple[list[str], dict[str, dict[str, Any]], int | None]:
  """(layer_types, {type: its rope parameters}, sliding_window) of a Gemma-expressible model
  (`check_exportable` has passed)."""
  kinds = model.layer_pattern or (LayerKind(window=model.attention_window),)
  types = [SLIDING if kinds[i % len(kinds)].window else FULL for i in range(model.num_layers)]
  ropes = {}
  for t in (SLIDING, FULL):
    kind = next((k for k in kinds if bool(k.window) == (t == SLIDING)), LayerKind())
    rope = {"rope_type": "default", "rope_theta": model.rope_theta if kind.rope_theta is None else kind.rope_theta}
    if model.rope_scaling is not None and kind.rope_scaled:   # linear (check_exportable)
      rope.update(rope_type="linear", factor=model.rope_scaling.factor)
    ropes[t] = rope
  window = next((k.window for k in kinds if k.window), None)
  return types, ropes, window


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json of our model: transformers 5's keys (layer_types, rope_parameters per type for
  Gemma 3), the source's no-math keys and legacy RoPE / pattern keys (written with our values),
  its max_position_embeddings unless model.max_len is above it."""
  source = source or {}
  t = model
  types, ropes, window = _types_and_ropes(t)
  out = {k: v for k, v in source.items() if k in common.METADATA or k == "cache_implementation"}
  out.update(
      architectures=[{v: k for k, v in ARCHITECTURES.items()}[arch]], model_type=MODEL_TYPES[arch],
      vocab_size=t.vocab_size, hidden_size=t.d_model, intermediate_size=t.d_ff, num_hidden_layers=t.num_layers,
      num_attention_heads=t.num_heads, num_key_value_heads=t.kv_heads, head_dim=t.dim_per_head,
      hidden_activation="gelu_pytorch_tanh", max_position_embeddings=max(t.max_len, int(source.get("max_position_embeddings", 0))),
      rms_norm_eps=t.norm_eps, tie_word_embeddings=t.tied_embedding, attention_bias=t.qkv_bias,
      attention_dropout=0.0, query_pre_attn_scalar=t.query_pre_attn_scalar or t.dim_per_head,
      sliding_window=window, layer_types=types, attn_logit_softcapping=t.attention_softcap,
      final_logit_softcapping=t.final_logit_softcap, dtype=t.param_dtype)
  if isinstance(out["query_pre_attn_scalar"], float) and out["query_pre_attn_scalar"].is_integer():
    out["query_pre_attn_scalar"] = int(out["query_pre_attn_scalar"])   # transformers' type: int
  if arch == "gemma2":
    out.update(rope_parameters=ropes[FULL], rope_theta=ropes[FULL]["rope_theta"])
  else:
    out["rope_parameters"] = ropes
    legacy = {"rope_theta": ropes[FULL]["rope_theta"], "rope_local_base_freq": ropes[SLIDING]["rope_theta"],
              "rope_scaling": {k: v for k, v in ropes[FULL].items() if k != "rope_theta"}
              if ropes[FULL]["rope_type"] != "default" else None}
    out.update({k: v for k, v in legacy.items() if k in source})
  if "sliding_window_size" in source:
    out["sliding_window_size"] = window
  for key in ("hidden_act", "use_bidirectional_attention", "sliding_window_pattern", "_sliding_window_pattern"):
    if key in source:   # no math (hidden_act), off (bidirectional), or superseded by layer_types
      out[key] = source[key]
  return out


def check_exportable(model, arch: str) -> None:
  """The options a Gemma config.json can express; anything else would export another model."""
  bad = []
  want = dict(norm="rms_plus_one", post_norms=True, mlp="gated", activation="gelu", parallel_block=False,
              scale_embedding=True, mlp_bias=False, qk_norm=arch == "gemma3_text", moe=None, mla=None)
  bad += [f"{k}={getattr(model, k, None)!r} (Gemma: {v!r})" for k, v in want.items() if getattr(model, k, None) != v]
  for field in ("attention_sinks", "qk_l2_norm", "rope_interleave"):
    if getattr(model, field, False):
      bad.append(f"{field}=True")
  if model.qkv_bias != model.out_bias:
    bad.append(f"qkv_bias={model.qkv_bias}, out_bias={model.out_bias} (attention_bias sets both)")
  if model.rope_scaling is not None and model.rope_scaling.kind != "linear":
    bad.append(f"rope_scaling.kind={model.rope_scaling.kind!r}")
  kinds = model.layer_pattern or (LayerKind(window=model.attention_window),)
  if any(k.chunk or not k.rope or k.temperature_tuning for k in kinds):
    bad.append("a layer kind with chunked attention, NoPE or temperature tuning")
  for sliding in (True, False):
    same = {(k.window, k.rope_theta, k.rope_scaled) for k in kinds if bool(k.window) == sliding}
    if len(same) > 1:
      bad.append(f"{'sliding' if sliding else 'global'} layer kinds that differ ({sorted(map(str, same))}): "
                 f"Gemma has one window and one RoPE per layer type")
  if arch == "gemma2" and any(k.rope_theta is not None or not k.rope_scaled for k in kinds):
    bad.append("a RoPE base or scaling per layer kind (Gemma 2 has one RoPE)")
  if arch == "gemma2" and model.rope_scaling is not None:
    bad.append(f"rope_scaling.kind={model.rope_scaling.kind!r} (Gemma 2 has none)")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")


def weight_names(model_cfg, arch: str) -> common.WeightNames:
  """Llama's attention and MLP names, and Gemma's four norms around them."""
  return common.WeightNames(top=TOP, block=BLOCK)
