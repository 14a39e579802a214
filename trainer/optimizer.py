"""The optimizer: AdamW, linear warmup then cosine decay, global-norm clipping.

Weight decay applies to matrices only (ndim >= 2): decaying norm scales pulls
them toward zero, which only hurts.
"""

from __future__ import annotations

import jax
import optax

from shardax.configs.schema import OptimizerConfig


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  decay = cfg.decay_steps or total_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(decay, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.end_learning_rate_fraction)


def make(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  parts = []
  if cfg.clip_norm:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay,
                           mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
  return optax.chain(*parts)
