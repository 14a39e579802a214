"""flax NNX layers; params carry logical axis names (`logical_axes` metadata), never mesh axes."""

from shardax.layers.attention import (Attention, apply_rope, default_positions, fused_attention,
                                      xla_attention)
from shardax.layers.classifier import ImageClassifier
from shardax.layers.conv import Conv, ConvBlock, ConvTranspose, GroupNorm, activation_axes
from shardax.layers.embedding import Embed
from shardax.layers.linear import DenseGeneral, fan_in_init
from shardax.layers.mlp import GatedMLP
from shardax.layers.moe import Gating, MoEFeedForward, top2_gating
from shardax.layers.norm import LayerNorm, RMSNorm, make_norm
from shardax.layers.blocks import apply_layers, block_fn, stacked_blocks
from shardax.layers.transformer import REMAT_POLICIES, Block, LayerStack, TransformerLM
from shardax.layers.unet import UNet3D

__all__ = [
    "REMAT_POLICIES", "Attention", "Block", "DenseGeneral", "Embed", "GatedMLP", "Gating",
    "LayerNorm", "LayerStack", "MoEFeedForward", "RMSNorm", "TransformerLM",
    "apply_layers", "apply_rope", "block_fn", "default_positions", "fan_in_init",
    "fused_attention", "make_norm", "stacked_blocks", "top2_gating", "xla_attention",
    "Conv", "ConvBlock", "ConvTranspose", "GroupNorm", "ImageClassifier", "UNet3D", "activation_axes",
]
