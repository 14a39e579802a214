"""Step recipes several experiments share, as values and the few functions that combine them.

An experiment is written as data: a named shape (configs/shapes.py) with its step settings
replaced, plus the sections that say where and how it runs. `experiment_of` turns those values
into the config tree (each section as a tree, so `--set` reaches every field); the recipes here
are the values that more than one experiment starts from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import fiddle as fdl

from shardax.configs import experiment
from shardax.configs.registry import config_of
from shardax.configs.schema import (CheckpointConfig, DataConfig, OptimizerConfig, ShardingConfig, TrainConfig,
                                    TransformerConfig)
from shardax.sharding import MeshConfig


def experiment_of(**sections: Any) -> fdl.Config:
  """The experiment tree whose sections are the given dataclass values (the rest at defaults)."""
  return experiment(**{name: config_of(value) if dataclasses.is_dataclass(value) else value
                       for name, value in sections.items()})


def model(shape: TransformerConfig, *, moe: dict[str, Any] | None = None, **changes: Any) -> TransformerConfig:
  """`shape` with its step settings `changes` and, for an MoE shape, `moe`'s changes to its MoE."""
  if moe is not None:
    if shape.moe is None:
      raise ValueError("recipes.model(moe=...) needs a shape with an MoE (shape.moe is None)")
    changes["moe"] = dataclasses.replace(shape.moe, **moe)
  return dataclasses.replace(shape, **changes)


# lm.tiny's run: a few minutes on a laptop CPU. The tiny MoEs train on it too, so their eval
# bits per byte compare with lm.tiny's.
TINY_DATA = DataConfig(seq_len=128)
TINY_TRAIN = TrainConfig(steps=250, global_batch=32, eval_every=50, eval_batches=8, log_every=10)
TINY_OPTIMIZER = OptimizerConfig(learning_rate=3e-3, warmup_steps=30)
TINY_CHECKPOINT = CheckpointConfig(every=100)


def tiny_run(shape: TransformerConfig, *, learning_rate: float = 3e-3, **sections: Any) -> fdl.Config:
  """`shape` trained on lm.tiny's run at `learning_rate`; `sections` replace whole sections."""
  return experiment_of(**{"model": shape, "data": TINY_DATA, "train": TINY_TRAIN, "checkpoint": TINY_CHECKPOINT,
                          "optimizer": dataclasses.replace(TINY_OPTIMIZER, learning_rate=learning_rate),
                          **sections})


# The pod recipe's step settings: bf16 weights and compute, each scanned layer fully
# rematerialized (only its input kept for the backward pass).
POD_STEP = dict(dtype="bfloat16", param_dtype="bfloat16", remat="full", scan_layers=True)
# Adafactor as the GSPMD paper and GShard trained: factored second moments, updates clipped
# at RMS 1 and relative to each weight's RMS (so the peak rate is 1e-2, not AdamW's 1e-4).
ADAFACTOR = OptimizerConfig(name="adafactor", learning_rate=1e-2, warmup_steps=2000)


def on_pod(shape: TransformerConfig, *, seq_len: int, global_batch: int, mesh: MeshConfig,
           sharding: ShardingConfig, optimizer: OptimizerConfig = ADAFACTOR,
           checkpoint: CheckpointConfig = CheckpointConfig()) -> fdl.Config:
  """A pod experiment, a dry-run target for `mesh.topology`: `shape` at `seq_len` tokens of
  synthetic data, 100,000 steps of `global_batch` sequences."""
  return experiment_of(model=dataclasses.replace(shape, max_len=seq_len),
                       data=DataConfig(source="synthetic", seq_len=seq_len),
                       train=TrainConfig(steps=100_000, global_batch=global_batch),
                       mesh=mesh, sharding=sharding, optimizer=optimizer, checkpoint=checkpoint)
