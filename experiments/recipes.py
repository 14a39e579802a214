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
from shardax.configs.data import DataConfig
from shardax.configs.schema import (CheckpointConfig, OptimizerConfig, ShardingConfig, TrainConfig,
                                    TransformerConfig)
from shardax.sharding import MeshConfig, libtpu_flags


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


# The MoE pod recipe. Experts split over their own `expert` mesh axis, the tokens over (data,
# expert), so the dropless exchange is an all-to-all within each expert group; every other
# weight (and each expert's embed dim) FSDP-split over what its other dims leave free.
POD_MOE_RULES = (("batch", ("data", "expert")), ("batch", "data"), ("expert", "expert"),
                 ("embed", ("data", "expert")), ("embed", "data"))
# The dropless exchange of the fine-grained pod MoEs: a receive buffer of 2 fair shares per
# (sequence piece, device) block, not the no-overflow bound (DeepSeek-V3's, 32 fair shares, does
# not fit a v5p chip); copies past it are dropped and logged as moe/dropped_copies (a bet on
# balance, which bias balancing steers); async all-to-alls of fixed blocks in 2 pieces, so one
# piece's exchange runs under the other's megablox matmuls. docs/moe.md explains the choice;
# docs/results/moe_pods.md has the dry runs.
PADDED_EXCHANGE = dict(expert_buffer=2.0, expert_overflow="drop", expert_exchange="padded", dispatch_chunks=2,
                       grouped_matmul="megablox")


def pod_moe(shape: TransformerConfig, *, mesh: MeshConfig, global_batch: int, step: dict[str, Any],
            moe: dict[str, Any], rules: tuple = POD_MOE_RULES, seq_len: int = 4096) -> fdl.Config:
  """An MoE pod experiment: `shape` with POD_STEP then `step` (model) and `moe` (its MoE) changes,
  on `mesh` with `rules`, Adafactor, a checkpoint every 1000 steps."""
  return on_pod(model(shape, moe=moe, **{**POD_STEP, **step}), seq_len=seq_len, global_batch=global_batch,
                mesh=mesh, sharding=ShardingConfig(preset=None, rules=rules),
                checkpoint=CheckpointConfig(every=1000))


def every_expert_on_every_chip(shape: TransformerConfig, remat: str, global_batch: int = 256) -> fdl.Config:
  """An MoE model on v5p-256 (128 chips) with FSDP over all of them and every expert on every
  chip (dropless, megablox): nothing exchanged per layer, nothing dropped; the layout that wins
  for experts small enough to gather (docs/moe.md, "How to choose")."""
  fsdp = ("data", "fsdp")
  return pod_moe(
      shape, global_batch=global_batch, step=dict(attention="flash", remat=remat),
      moe=dict(dispatch="dropless", grouped_matmul="megablox"), rules=(("batch", fsdp), ("embed", fsdp)),
      mesh=MeshConfig(topology="v5p:4x4x8", ici=(16, 8), axes=fsdp, libtpu_flags=libtpu_flags.ASYNC_COLLECTIVE_FUSION))
