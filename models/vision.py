"""The image and volume families: a 3D U-Net (per-voxel segmentation) and a 2D classifier."""

from __future__ import annotations

from shardax.configs.vision import ClassifierConfig, UNet3DConfig
from shardax.layers.classifier import ImageClassifier
from shardax.layers.unet import UNet3D
from shardax.models.spec import ModelSpec, register

UNET3D = register(ModelSpec(
    name="unet3d",
    config_cls=UNet3DConfig,
    builder=lambda cfg, rngs: UNet3D(cfg, cfg.in_channels, rngs=rngs),
))

CLASSIFIER = register(ModelSpec(
    name="classifier",
    config_cls=ClassifierConfig,
    builder=lambda cfg, rngs: ImageClassifier(cfg, cfg.in_channels, rngs=rngs),
))
