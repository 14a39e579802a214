"""Convolutional models: a 3D U-Net on generated volumes (plain and spatially
partitioned) and a small CNN on scikit-learn's digits. All run on a laptop CPU."""

from shardax.configs import experiment, register
from shardax.configs.registry import config_tree
from shardax.configs.vision import ClassifierConfig, UNet3DConfig


def _common(cfg):
  cfg.optimizer.learning_rate = 3e-3
  cfg.optimizer.warmup_steps = 10
  cfg.optimizer.weight_decay = 0.0
  cfg.train.eval_every = 50
  cfg.train.eval_batches = 4
  cfg.train.log_every = 10
  cfg.checkpoint.every = 100
  return cfg


@register("conv.unet3d_tiny", "3D U-Net (2 levels, 8 channels) segmenting balls vs boxes in 16^3 volumes; CPU, minutes")
def unet3d_tiny():
  cfg = _common(experiment())
  cfg.model = config_tree(UNet3DConfig, channels=8, levels=2, groups=4)
  cfg.data.source = "shapes3d"
  cfg.data.image_size = (16, 16, 16)
  cfg.train.steps = 150
  cfg.train.global_batch = 8
  return cfg


@register("conv.unet3d_spatial",
          "conv.unet3d_tiny spatially partitioned: mesh (data=2, spatial=4), volume height over "
          "`spatial` (run with --set mesh.num_cpu_devices=8)")
def unet3d_spatial():
  cfg = unet3d_tiny()
  cfg.mesh.ici = (2, 4)
  cfg.mesh.axes = ("data", "spatial")
  cfg.sharding.preset = "spatial"
  return cfg


@register("conv.digits", "small 2D CNN classifying scikit-learn's 8x8 digits upsampled to 16x16; CPU, a minute")
def digits():
  cfg = _common(experiment())
  cfg.model = config_tree(ClassifierConfig, channels=16, levels=2, groups=4, num_classes=10)
  cfg.data.source = "digits"
  cfg.data.image_size = (16, 16)
  cfg.data.validation_fraction = 0.2
  cfg.train.steps = 300
  cfg.train.global_batch = 32
  cfg.train.eval_batches = 8
  return cfg
