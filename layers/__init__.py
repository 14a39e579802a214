"""flax NNX layers; params carry logical axis names (`logical_axes` metadata), never mesh axes."""

from shardax.layers.attention import (Attention, apply_rope, default_positions, fused_attention,
                                      xla_attention)
from shardax.layers.embedding import Embed
from shardax.layers.linear import DenseGeneral, fan_in_init
from shardax.layers.mlp import GatedMLP
from shardax.layers.norm import LayerNorm, RMSNorm, make_norm
from shardax.layers.transformer import (REMAT_POLICIES, Block, LayerStack, TransformerLM,
                                        apply_layers, block_fn, stacked_blocks)

__all__ = [
    "REMAT_POLICIES", "Attention", "Block", "DenseGeneral", "Embed", "GatedMLP", "LayerNorm",
    "LayerStack", "RMSNorm", "TransformerLM", "apply_layers", "apply_rope", "block_fn",
    "default_positions", "fan_in_init", "fused_attention", "make_norm", "stacked_blocks",
    "xla_attention",
]
