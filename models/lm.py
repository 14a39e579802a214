"""The language-model family: one decoder (dense or MoE feed-forward blocks), Hugging Face
checkpoints in and out through one adapter per architecture family (models/hf/)."""

from __future__ import annotations

from shardax.configs.schema import TransformerConfig
from shardax.layers.transformer import TransformerLM
from shardax.models import hf
from shardax.models.spec import HFAdapter, ModelSpec, register

LM = register(ModelSpec(
    name="lm",
    config_cls=TransformerConfig,
    builder=lambda cfg, rngs: TransformerLM(cfg, rngs=rngs),
    hf=HFAdapter(architectures=tuple(hf.ARCHITECTURES), adapter_for=hf.adapter_for),
))
