"""The language-model family: one decoder (dense or MoE feed-forward blocks), Hugging Face
Llama, Mistral, Qwen2, Qwen3 and Mixtral checkpoints in and out (trainer/hf/)."""

from __future__ import annotations

from shardax.configs.schema import TransformerConfig
from shardax.layers.transformer import TransformerLM
from shardax.models.spec import HFAdapter, ModelSpec, register
from shardax.trainer.hf import config as hf_config
from shardax.trainer.hf import weights as hf_weights

LM = register(ModelSpec(
    name="lm",
    config_cls=TransformerConfig,
    builder=lambda cfg, rngs: TransformerLM(cfg, rngs=rngs),
    hf=HFAdapter(architectures=tuple(hf_config.ARCHITECTURES), config=hf_config, weights=hf_weights),
))
