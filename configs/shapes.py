"""Named model shapes: a model's architecture as one value, kept in one place.

A shape fixes what makes the model that model (depth, width, heads, feed-forward width,
vocabulary, positions, norms, the experts and how tokens pick them) and leaves step settings
(dtype, attention kernel, remat, scanning, the MoE dispatch) at their defaults; a router other
than GShard's top-2 softmax needs dropless dispatch, so its shape says so. An experiment
starts from a shape, changes what it needs with `dataclasses.replace`, and puts the result into
its tree with `registry.config_of`, where `--set model.*` still reaches every field:

    cfg = experiment(model=config_of(dataclasses.replace(LM_1B, dtype="bfloat16")))

Each published shape names its source on one line and what shardax builds differently. The
feed-forward block is gated (3 matrices) unless the shape says `mlp="plain"`; where the source
has a plain 2-matrix MLP of width F, d_ff = 2/3 F keeps its parameters and FLOPs.
"""

from __future__ import annotations

import dataclasses

from shardax.configs.attention import LayerKind
from shardax.configs.mla import MLAConfig
from shardax.configs.moe import MoEConfig
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import TransformerConfig

# Byte-level language models (vocab 256, the TransformerConfig default): CPU sizes.
LM_TINY = TransformerConfig(num_layers=4, d_model=192, num_heads=4, d_ff=512, max_len=128)
LM_SMALL = TransformerConfig(num_layers=12, d_model=768, num_heads=12, d_ff=3072, max_len=512)
# GPT-3 XL's depth and width (24 x 2048, 16 heads of 128) with a gated MLP of d_ff 5632, which
# has the 2 x 4d x d parameters of a plain one: ~1.23B parameters.
LM_1B = TransformerConfig(num_layers=24, d_model=2048, num_heads=16, d_ff=5632, max_len=2048)

# MoE models at CPU size: the MoE layers of a published router on a tiny LM.
# GShard's top-2 of 8 (capacity dispatch) in every second layer of a 4 x 128 LM.
MOE_TINY = TransformerConfig(num_layers=4, d_model=128, num_heads=4, d_ff=512, max_len=128,
                             moe=MoEConfig(num_experts=8, d_ff=256, every=2))
# Mixtral's router on LM_TINY: top-2 of 8 experts of d_ff 256 in every layer (LM_TINY's active width).
MIXTRAL_TINY = TransformerConfig(num_layers=4, d_model=192, num_heads=4, d_ff=512, max_len=128,
                                 moe=MoEConfig(num_experts=8, d_ff=256, every=1, top_k=2))
# DeepSeek-V3's router on LM_TINY: layer 1 dense, then 32 experts of d_ff 64, sigmoid top-7 with
# gates renormalized and x2.5, 1 shared expert, bias balancing (7 + 1 experts of 64: LM_TINY's 512).
DEEPSEEK_TINY = TransformerConfig(
    num_layers=4, d_model=192, num_heads=4, d_ff=512, max_len=128,
    moe=MoEConfig(num_experts=32, d_ff=64, every=1, first_dense_layers=1, top_k=7, num_shared_experts=1,
                  score="sigmoid", gate_scale=2.5, bias_update_rate=1e-3, aux_loss_weight=1e-4,
                  dispatch="dropless"))

# Dense pod LMs (the GSPMD paper's family): d_ff = 4 d_model (gated), heads of 128, vocab 32k,
# untied; 16 d^2 parameters a layer.
_POD_LM = TransformerConfig(vocab_size=32768, tied_embedding=False)
POD_LM_16B = dataclasses.replace(_POD_LM, num_layers=40, d_model=5120, num_heads=40, d_ff=20480)
POD_LM_128B = dataclasses.replace(_POD_LM, num_layers=52, d_model=12288, num_heads=96, d_ff=49152)
POD_LM_512B = dataclasses.replace(_POD_LM, num_layers=76, d_model=20480, num_heads=160, d_ff=81920)
POD_LM_1T = dataclasses.replace(_POD_LM, num_layers=104, d_model=24576, num_heads=192, d_ff=98304)

# GPT-3 175B (arXiv 2005.14165, table 2.1): 96 x 12288, 96 heads, LayerNorm, GELU, 2048 positions;
# its plain FFN of 49152 as a gated one of 32768; vocab 50257 padded to 50304.
GPT3_175B = TransformerConfig(num_layers=96, d_model=12288, num_heads=96, d_ff=32768, vocab_size=50304,
                              max_len=2048, norm="layer", activation="gelu")

# Llama-3.1-8B / -70B (meta-llama config.json): GQA with 8 KV heads of 128, SwiGLU, RoPE theta
# 5e5, vocab 128256, untied. Not its rms_norm_eps (1e-5) nor its llama3 RoPE scaling: shardax's
# defaults (1e-6, none) stand, as the registered experiments were measured with them.
LLAMA3_8B = TransformerConfig(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                              d_ff=14336, vocab_size=128256, rope_theta=500_000.0, tied_embedding=False)
LLAMA3_70B = TransformerConfig(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                               d_ff=28672, vocab_size=128256, rope_theta=500_000.0, tied_embedding=False)
# Mistral-7B v0.2+ (mistralai config.json): Llama-3.1-8B's shape, vocab 32000, RoPE theta 1e6,
# norm eps 1e-5, no sliding window.
MISTRAL_7B = TransformerConfig(
    num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, d_ff=14336, vocab_size=32000,
    rope_theta=1_000_000.0, norm_eps=1e-5, tied_embedding=False)

# GShard's 1T-parameter top-2 MoE (arXiv 2006.16668) at 40 layers: its 2-matrix ReLU expert
# FFN over 60 layers, here gated (3 matrices) over 40, the same size: 2048 experts of d_ff 8192
# in every second layer, ~1.03T parameters (TransformerConfig.param_count()).
GSHARD_1T = TransformerConfig(num_layers=40, d_model=1024, num_heads=16, d_ff=8192, vocab_size=32768,
                              max_len=1024, moe=MoEConfig(num_experts=2048, d_ff=8192, every=2))
# Mixtral-8x7B (arXiv 2401.04088): Mistral-7B's attention, every FFN top-2 of 8 experts of 14336,
# renormalized softmax gates; 46.7B parameters, 12.9B active.
MIXTRAL_8X7B = TransformerConfig(
    num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336, vocab_size=32000,
    rope_theta=1e6, tied_embedding=False, moe=MoEConfig(num_experts=8, d_ff=14336, every=1, top_k=2))
# DeepSeek-V3 (arXiv 2412.19437; deepseek-ai/DeepSeek-V3 config.json, transformers' DeepseekV3Config):
# 61 layers, the first 3 dense (d_ff 18432), then 256 experts of 2048, sigmoid top-8 within the best
# 4 of 8 expert groups, renormalized x2.5, 1 shared expert, bias balancing (and the paper's
# sequence-wise balance loss, alpha 1e-4); multi-head latent attention with the MLAConfig defaults
# (128 heads, q rank 1536, kv rank 512, 128 + 64 RoPE dims, v 128), RoPE of adjacent pairs; YaRN x40
# over 4096 positions with mscale and mscale_all_dim 1 (163,840 positions); untied; 671B parameters.
# Multi-token prediction (its one MTP module, loss weight 0.3) is a step setting: moe.deepseek_v3.
DEEPSEEK_V3 = TransformerConfig(
    num_layers=61, d_model=7168, num_heads=128, d_ff=18432, vocab_size=129280, max_len=163840,
    tied_embedding=False, mla=MLAConfig(), rope_interleave=True,
    rope_scaling=RopeScaling("yarn", factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0),
    moe=MoEConfig(num_experts=256, d_ff=2048, every=1, first_dense_layers=3, top_k=8, num_shared_experts=1,
                  score="sigmoid", gate_scale=2.5, n_group=8, topk_group=4, bias_update_rate=1e-3,
                  aux_loss_weight=1e-4, dispatch="dropless"))
# Llama 4 Maverick (meta-llama config.json text_config, transformers' Llama4TextConfig): 48 layers
# alternating dense (d_ff 16384) and MoE (128 experts of 8192, the top-1 logit's sigmoid scaling the
# expert's input, 1 shared expert); 40 heads of 128 with 8 KV heads; every 4th layer NoPE with
# attention temperature tuning (floor 8192, scale 0.1), the others RoPE of adjacent pairs (theta
# 5e5) in 8192-token chunks; no q/k norm (transformers: the 128E model has none), RMSNorm eps
# 1e-5, untied; 400B parameters, 17B active. Not its early-fusion vision. The stack's unit is
# lcm(4-layer pattern, moe.every 2) = 4 layers. Balance loss 1e-3 (config.json's
# router_aux_loss_coef; transformers' text model adds none).
_CHUNKED, _NOPE = LayerKind(chunk=8192), LayerKind(rope=False, temperature_tuning=True)
MAVERICK = TransformerConfig(
    num_layers=48, d_model=5120, num_heads=40, num_kv_heads=8, head_dim=128, d_ff=16384,
    vocab_size=202048, tied_embedding=False, rope_theta=5e5, norm_eps=1e-5, scale_embedding=False,
    rope_interleave=True, layer_pattern=(_CHUNKED, _CHUNKED, _CHUNKED, _NOPE),
    temperature_floor_scale=8192.0, temperature_scale=0.1,
    moe=MoEConfig(num_experts=128, d_ff=8192, every=2, top_k=1, num_shared_experts=1, score="sigmoid",
                  renormalize=False, gate_input=True, aux_loss_weight=1e-3, dispatch="dropless"))
# Qwen3-235B-A22B (Qwen config.json): 94 layers, every FFN an MoE of 128 experts of 1536, softmax
# top-8 renormalized (norm_topk_prob), no shared expert; 64 q heads and 4 KV heads of 128 with q/k
# RMSNorm, RoPE theta 1e6, vocab 151936, untied; balance loss 1e-3 x k (transformers' coefficient
# on its k-summed loss); 235B parameters, 22B active. Its dense intermediate_size 12288 is unused.
QWEN3_235B = TransformerConfig(
    num_layers=94, d_model=4096, num_heads=64, num_kv_heads=4, head_dim=128, d_ff=12288,
    vocab_size=151936, rope_theta=1e6, qk_norm=True, tied_embedding=False,
    moe=MoEConfig(num_experts=128, d_ff=1536, every=1, top_k=8, renormalize=True, aux_loss_weight=8e-3,
                  dispatch="dropless"))

# Gemma-3-27B (text) as published (google/gemma-3-27b-pt text_config): 62 layers of 5 local
# (1024-token window, RoPE base 1e4) then 1 global (base 1e6, linear scaling x8) layers, so 10
# units of 6 and a tail of 2; GQA 32/16 heads of 128 with (1 + w) q/k norms, softmax scale
# 168^-1/2 (query_pre_attn_scalar), pre and post norms, GELU-tanh, embedding x sqrt(5376), tied.
GEMMA3_27B = TransformerConfig(
    num_layers=62, d_model=5376, num_heads=32, num_kv_heads=16, head_dim=128, d_ff=21504,
    vocab_size=262208, max_len=131072, norm="rms_plus_one", norm_eps=1e-6, post_norms=True, qk_norm=True,
    query_pre_attn_scalar=168.0, activation="gelu", scale_embedding=True, tied_embedding=True,
    rope_theta=1e6, rope_scaling=RopeScaling("linear", factor=8.0),
    layer_pattern=(LayerKind(window=1024, rope_theta=1e4, rope_scaled=False),) * 5 + (LayerKind(),))
