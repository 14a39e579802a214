"""Convolutional models: a 3D U-Net on generated volumes (plain and spatially
partitioned) and a small CNN on scikit-learn's digits. All run on a laptop CPU."""

from shardax.configs import register
from shardax.configs.registry import config_of
from shardax.configs.data import DataConfig
from shardax.configs.schema import CheckpointConfig, OptimizerConfig, TrainConfig
from shardax.configs.vision import ClassifierConfig, UNet3DConfig
from shardax.experiments import recipes
from shardax.sharding import MeshConfig


def _conv(model, data: DataConfig, train: TrainConfig):
  """`model` on `data` with the conv runs' optimizer (no weight decay) and checkpoints."""
  return recipes.experiment_of(model=model, data=data, train=train, checkpoint=CheckpointConfig(every=100),
                               optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=10, weight_decay=0.0))


@register("conv.unet3d_tiny", "3D U-Net (2 levels, 8 channels) segmenting balls vs boxes in 16^3 volumes; CPU, minutes")
def unet3d_tiny():
  return _conv(UNet3DConfig(channels=8, levels=2, groups=4),
               DataConfig(source="shapes3d", image_size=(16, 16, 16)),
               TrainConfig(steps=150, global_batch=8, eval_every=50, eval_batches=4, log_every=10))


@register("conv.unet3d_spatial",
          "conv.unet3d_tiny spatially partitioned: mesh (data=2, spatial=4), volume height over "
          "`spatial` (run with --set mesh.num_cpu_devices=8)")
def unet3d_spatial():
  cfg = unet3d_tiny()
  cfg.mesh = config_of(MeshConfig(ici=(2, 4), axes=("data", "spatial")))
  cfg.sharding.preset = "spatial"
  return cfg


@register("conv.digits", "small 2D CNN classifying scikit-learn's 8x8 digits upsampled to 16x16; CPU, a minute")
def digits():
  return _conv(ClassifierConfig(channels=16, levels=2, groups=4, num_classes=10),
               DataConfig(source="digits", image_size=(16, 16), validation_fraction=0.2),
               TrainConfig(steps=300, global_batch=32, eval_every=50, eval_batches=8, log_every=10))
