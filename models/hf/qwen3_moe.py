"""Qwen3-MoE's Hugging Face adapter (transformers' `Qwen3MoeForCausalLM`).

Qwen3's attention (q/k RMSNorm over each head, `attention_bias` on q/k/v/o alike, rotate-half
RoPE) in the one decoder with MoE feed-forward blocks (`model.moe`): a softmax router over
`num_experts`, the top `num_experts_per_tok`, their gates renormalized over the k when
`norm_topk_prob` (else the raw softmax scores), experts of `moe_intermediate_size`, no shared
expert; dropless dispatch (transformers drops nothing).

Which layers are MoE: transformers makes layer i MoE when (i + 1) % decoder_sparse_step == 0
and i is not in `mlp_only_layers`; the others have a dense MLP of `intermediate_size`. The
decoder's stack is `first_dense_layers` dense layers, then units of `every - 1` dense layers
and one MoE layer (layers/blocks.py), so a config.json imports when its MoE layers are that
pattern (`layout`): every = decoder_sparse_step and first_dense_layers from where the first
MoE layer is, e.g. mlp_only_layers [0] with step 1 (first_dense_layers 1), or [1] with step 2
(first_dense_layers 2). Any other list is an error naming it.

Tensors: the dense layers' as Llama's (`mlp.gate_proj` ...); an MoE layer's router kernel
[embed, E] is `mlp.gate.weight` [E, embed] and its experts stack over E: `wi_gate` [E, embed,
h] is the E tensors `mlp.experts.{e}.gate_proj.weight` [h, embed] (up_proj: wi_up, down_proj:
wo), the hub's layout (transformers 5 fuses them in memory and saves them split).

The balance loss: transformers adds router_aux_loss_coef x its balance loss when
output_router_logits; that loss counts each expert's share of the k x tokens assignments
against tokens (k times shardax's), so aux_loss_weight = coef x k, and it averages the shares
and mean probabilities over all MoE layers before their product (aux_loss_pooling=
'over_layers'), as for Mixtral (models/hf/llama.py `moe_fields`).
"""

from __future__ import annotations

from typing import Any

from shardax.configs.schema import ConfigError
from shardax.models.hf import common
from shardax.models.hf.llama import BLOCK, TOP

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}

MAPPED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
          "attention_bias", "hidden_act", "attention_dropout", "sliding_window", "use_sliding_window"}
# `num_experts` is the hub's spelling, `num_local_experts` what transformers 5 saves.
# output_router_logits only decides whether transformers' forward adds the balance loss; kept on export.
MOE_MAPPED = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
              "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
              "output_router_logits"}
# The MoEConfig fields Qwen3-MoE's router fixes.
ROUTER = dict(num_shared_experts=0, score="softmax", gate_scale=1.0, bias_update_rate=0.0)

BLOCK_NAMES = {k: v for k, v in BLOCK.items() if not (k[0] == "mlp" and k[-1] == "bias")}
BLOCK_NAMES.update({
    ("moe", "router", "kernel"): ("mlp.gate.weight", 1),
    ("moe", "wi_gate"): ("mlp.experts.{e}.gate_proj.weight", 1),
    ("moe", "wi_up"): ("mlp.experts.{e}.up_proj.weight", 1),
    ("moe", "wo"): ("mlp.experts.{e}.down_proj.weight", 1),
})


def moe_layers(num_layers: int, step: int, mlp_only: list[int]) -> list[int]:
  """transformers' MoE layers: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
  return [i for i in range(num_layers) if (i + 1) % step == 0 and i not in set(mlp_only)]


def stack_moe_layers(num_layers: int, every: int, first_dense: int) -> list[int]:
  """The decoder's MoE layers: after `first_dense` dense ones, the last of each `every`."""
  return [i for i in range(first_dense, num_layers) if (i - first_dense + 1) % every == 0]


def layout(hf: dict[str, Any]) -> tuple[int, int]:
  """(moe.every, moe.first_dense_layers) whose MoE layers are transformers' for this
  config.json; a ConfigError naming mlp_only_layers / decoder_sparse_step otherwise."""
  n, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step", 1))
  mlp_only = [int(i) for i in hf.get("mlp_only_layers") or []]
  if step < 1:
    raise ConfigError(f"config.json decoder_sparse_step={step} must be >= 1")
  want = moe_layers(n, step, mlp_only)
  first = want[0] - (step - 1) if want else -1
  if first < 0 or (n - first) % step or stack_moe_layers(n, step, first) != want:
    raise ConfigError(
        f"config.json mlp_only_layers={mlp_only} with decoder_sparse_step={step} and num_hidden_layers={n} "
        f"makes layers {want} MoE; shardax's decoder keeps its dense layers first (model.moe."
        f"first_dense_layers) and then repeats (step - 1) dense + 1 MoE layer, so mlp_only_layers must "
        f"be the first layers (e.g. [0, 1, ..., k-1] with k a multiple of decoder_sparse_step) or empty")
  return step, first


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """TransformerConfig fields for a Qwen3-MoE config.json (ConfigError naming a key we lack)."""
  arch = common.arch_name(hf, ARCHITECTURES)
  common.check_keys(hf, arch, MAPPED, MOE_MAPPED)
  common.check_silu_without_dropout(hf)
  if hf.get("use_sliding_window"):
    raise ConfigError("config.json use_sliding_window=true: Qwen3-MoE's sliding window is not imported; "
                      "set it to false (the published checkpoints do)")
  heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim")
  bias = bool(hf.get("attention_bias", False))
  return dict(
      vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]),
      d_model=int(hf["hidden_size"]), num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim) if head_dim else None, d_ff=int(hf.get("intermediate_size", 6144)),
      max_len=int(hf.get("max_position_embeddings", 32768)), attention_window=None, norm="rms",
      tied_embedding=bool(hf.get("tie_word_embeddings", False)), activation="silu", mlp="gated",
      parallel_block=False, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), scale_embedding=False,
      qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=True, **common.rope(hf))


def num_experts(hf: dict[str, Any]) -> int:
  both = {hf[k] for k in ("num_experts", "num_local_experts") if k in hf}
  if len(both) > 1:
    raise ConfigError(f"config.json num_experts={hf['num_experts']} and num_local_experts="
                      f"{hf['num_local_experts']} disagree; keep one")
  e = int(both.pop()) if both else 128
  if e < 2:
    raise ConfigError(f"config.json num_experts={e}: a Qwen3-MoE without experts is a dense Qwen3; "
                      f"import it as Qwen3ForCausalLM")
  return e


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """MoEConfig fields: softmax top-k, renormalized when norm_topk_prob, dropless; the layer
  layout (`layout`); the balance loss as transformers computes it: weight router_aux_loss_coef
  x k (its loss sums over the k slots) and the expert shares pooled over the MoE layers
  (aux_loss_pooling='over_layers'). shardax trains with it whatever output_router_logits says:
  --set model.moe.aux_loss_weight=0 to leave it out."""
  every, first = layout(hf)
  k = int(hf.get("num_experts_per_tok", 8))
  return dict(num_experts=num_experts(hf), top_k=k, d_ff=int(hf.get("moe_intermediate_size", 768)),
              every=every, first_dense_layers=first, renormalize=bool(hf.get("norm_topk_prob", False)),
              **ROUTER, dispatch="dropless", aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) * k,
              aux_loss_pooling="over_layers", z_loss_weight=0.0)


def to_hf(model, arch: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for our model config: the source's no-math keys, its max_position_embeddings
  unless model.max_len is above it, its spelling of the expert count, and its mlp_only_layers
  when they make the model's layout (else the first dense layers listed)."""
  source = source or {}
  t, m = model, model.moe
  out = common.decoder_keys(t, source, "Qwen3MoeForCausalLM", "qwen3_moe", t.kv_heads)
  out.update(
      attention_bias=t.qkv_bias, use_sliding_window=False, sliding_window=None, dtype=t.param_dtype,
      num_experts_per_tok=m.top_k, moe_intermediate_size=m.d_ff, norm_topk_prob=m.renormalize,
      decoder_sparse_step=m.every, router_aux_loss_coef=m.aux_loss_weight / m.top_k,
      output_router_logits=bool(source.get("output_router_logits", False)), **common.rope_keys(t))
  out["num_local_experts" if "num_local_experts" in source else "num_experts"] = m.num_experts
  if t.head_dim is not None:
    out["head_dim"] = t.head_dim
  mlp_only = source.get("mlp_only_layers") or []
  same = moe_layers(t.num_layers, m.every, mlp_only) == stack_moe_layers(t.num_layers, m.every, m.first_dense_layers)
  out["mlp_only_layers"] = list(mlp_only) if same else list(range(m.first_dense_layers))
  return out


def check_exportable(model, arch: str) -> None:
  """The options Qwen3-MoE's config.json can express; anything else would export another model."""
  bad = common.router_mismatches(model, arch, "Qwen3-MoE", ROUTER)
  m = model.moe
  if m.first_dense_layers % m.every:
    bad.append(f"model.moe.first_dense_layers={m.first_dense_layers} not a multiple of model.moe.every="
               f"{m.every} (transformers puts the MoE layers at (i + 1) % decoder_sparse_step == 0)")
  if model.norm != "rms" or model.mlp != "gated" or model.activation != "silu" or model.parallel_block:
    bad.append("norm/mlp/activation/parallel_block other than rms/gated/silu/False")
  if model.scale_embedding or model.mlp_bias or not model.qk_norm or model.qkv_bias != model.out_bias:
    bad.append(f"scale_embedding={model.scale_embedding}, mlp_bias={model.mlp_bias}, qk_norm={model.qk_norm}, "
               f"qkv_bias={model.qkv_bias}, out_bias={model.out_bias} (Qwen3-MoE: False, False, True, "
               f"q/k/v and o biases together)")
  if model.attention_window is not None or model.attention_softcap is not None:
    bad.append(f"attention_window={model.attention_window}, attention_softcap={model.attention_softcap}")
  if getattr(model, "layer_pattern", ()) or getattr(model, "mla", None) is not None:
    bad.append("a layer pattern or multi-head latent attention")
  if bad:
    raise ConfigError(f"cannot export as {arch}: the model has {', '.join(bad)}")


def weight_names(model_cfg, arch: str) -> common.WeightNames:
  """Qwen3-MoE's tensor names: Llama's for the attention, norms and dense layers; the router
  and experts under `mlp.` of an MoE layer."""
  return common.WeightNames(top=TOP, block=BLOCK_NAMES)
