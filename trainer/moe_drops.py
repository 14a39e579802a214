"""What MoE routing drops, in plain sight: summed over every step of a logging window,
on the progress line, in a warning, in eval, and as a stated bet in explain and the dry run.

A token copy is one (token, chosen expert) pair. It is dropped when it gets no expert
output (the residual alone carries the token through that layer): past an expert's
capacity C (`dispatch='capacity'`), or past a device's expert-parallel receive buffer with
`expert_overflow='drop'` (`dispatch='dropless'`). Every MoE layer counts, per step, the
copies it routed and those it dropped (`step.ROUTED`, `step.DROPPED`: [MoE layers] each,
layers/moe.py; in training the multi-token prediction modules' MoE blocks follow the stack's
layers, layers/mtp.py). The loop fetches every step's metrics at its log point, so the sums here
cover each step of the window without a device sync per step, and the window's fraction is
exact: dropped over routed, all steps and layers together.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from absl import logging

from shardax.layers.transformer import moe_layer
from shardax.sharding import rules as rules_lib
from shardax.trainer.step import DROPPED, ROUTED

FRACTION = "moe/dropped_copies"          # the window's dropped share, all layers
# + each entry's name (`names`), when any dropped: 'layer_<i>' (the model layer, 0-based),
# 'mtp_<k>' (multi-token prediction depth k's block, 1-based as its mtp/loss_<k>)
PER_LAYER = "moe/dropped_copies/"


@dataclasses.dataclass
class Drops:
  """Token copies routed and dropped, per MoE layer (in the stack's order, then the MTP
  depths' blocks when the counts come from training a model with `model.mtp`)."""
  routed: np.ndarray
  dropped: np.ndarray

  @property
  def fraction(self) -> float:
    total = float(self.routed.sum())
    return float(self.dropped.sum()) / total if total else 0.0


def of_metrics(metrics: list[dict]) -> Drops | None:
  """The copies of every step (or eval batch) in `metrics` (fetched on host), summed; None
  for a model that routes none (dense)."""
  steps = [m for m in metrics if ROUTED in m]
  if not steps:
    return None
  return Drops(np.sum([np.asarray(m[ROUTED], np.float64) for m in steps], axis=0),
               np.sum([np.asarray(m[DROPPED], np.float64) for m in steps], axis=0))


def layers(model) -> list[int]:
  """The 0-based model layer of each MoE layer of the stack the statistics list."""
  return [moe_layer(model, u) for u in range(model.num_moe_layers)]


def _entries(model, n: int) -> list[tuple[str, str]]:
  """(metric name, words) of each of `n` counts: the stack's MoE layers, then, when the counts
  come from training (evaluation runs no MTP), each multi-token prediction depth's block."""
  stack = [(f"layer_{i}", f"layer {i}") for i in layers(model)]
  depth = model.mtp.depth if getattr(model, "mtp", None) is not None else 0
  if n not in (len(stack), len(stack) + depth):
    raise ValueError(f"{n} MoE drop counts for a model of {len(stack)} MoE layers and {depth} "
                     f"MTP depth(s): expected {len(stack)} (evaluation) or {len(stack) + depth} (training)")
  return stack + [(f"mtp_{k}", f"MTP depth {k}") for k in range(1, n - len(stack) + 1)]


def names(model, n: int) -> list[str]:
  """The metric name of each of `n` counts: 'layer_<i>' (the model layer, 0-based) for the
  stack's MoE layers, then 'mtp_<k>' (1-based, as mtp/loss_<k>) for the MTP depths' blocks."""
  return [name for name, _ in _entries(model, n)]


def scalars(drops: Drops, model, prefix: str = "") -> dict[str, float]:
  """What the metrics files get for a window: the fraction, both counts, and each MoE
  layer's (and MTP block's) fraction when anything dropped."""
  out = {prefix + FRACTION: drops.fraction, prefix + DROPPED: float(drops.dropped.sum()),
         prefix + ROUTED: float(drops.routed.sum())}
  if drops.dropped.sum() > 0:
    for name, d, r in zip(names(model, len(drops.routed)), drops.dropped, drops.routed):
      out[f"{prefix}{PER_LAYER}{name}"] = float(d / r) if r else 0.0
  return out


def percent(fraction: float) -> str:
  return f"{fraction:.2%}" if fraction >= 1e-4 else f"{fraction * 100:.2g}%"


def note(fraction: float) -> str:
  """The progress and eval lines' words for a non-zero fraction, else ''."""
  return f" | MoE dropped {percent(fraction)} of token copies" if fraction > 0 else ""


def fields_to_change(moe) -> str:
  """The config fields that decide what this MoE drops."""
  if moe.dispatch == "capacity":
    return (f"raise model.moe.capacity_factor (now {moe.capacity_factor:g}; min_capacity "
            f"{moe.min_capacity}, group_size {moe.group_size})")
  now = "the no-overflow bound" if moe.expert_buffer is None else f"{moe.expert_buffer:g} fair shares"
  return (f"raise model.moe.expert_buffer (now {now}; None: the no-overflow bound, which never "
          f"drops), or set model.moe.expert_overflow='error' to stop instead of dropping")


def worst_layers(drops: Drops, model, top: int = 3) -> str:
  shares = drops.dropped / np.maximum(drops.routed, 1)
  order = [i for i in np.argsort(-shares, kind="stable")[:top] if drops.dropped[i] > 0]
  words = [w for _, w in _entries(model, len(drops.routed))]
  return ", ".join(f"{words[i]} ({percent(float(shares[i]))} of its copies)" for i in order)


class OnceWarning:
  """Warns once per run (this process) when a window's fraction is above
  `model.moe.warn_dropped_fraction`."""

  def __init__(self, model):
    self.model = model
    self.threshold = model.moe.warn_dropped_fraction if getattr(model, "moe", None) else None
    self.warned = False

  def check(self, first: int, last: int, drops: Drops | None) -> str | None:
    """The warning (logged) for steps first..last, or None."""
    if self.warned or self.threshold is None or drops is None or drops.fraction <= self.threshold:
      return None
    self.warned = True
    moe = self.model.moe
    line = (f"MoE routing dropped {percent(drops.fraction)} of the token copies of steps {first}-{last} "
            f"(above model.moe.warn_dropped_fraction={self.threshold:g}); most in "
            f"{worst_layers(drops, self.model)}, counting layers from 0. A dropped copy gets no "
            f"expert output (the residual carries the token). To drop less: {fields_to_change(moe)}; "
            f"to accept it, raise model.moe.warn_dropped_fraction. Warned once per run; every "
            f"window's figure is in metrics.jsonl ({FRACTION}).")
    logging.warning(line)
    return line


def expert_shards(exp, mesh_shape: dict[str, int], rules) -> int:
  """How many ways the rules split the experts over a mesh of `mesh_shape`."""
  moe = exp.model.moe
  spec = rules_lib.logical_to_spec(("expert",), rules, mesh_shape, (moe.num_experts,),
                                   name="MoE experts", allow_uneven=exp.sharding.allow_uneven)
  axes = spec[0] if spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return int(np.prod([mesh_shape[a] for a in axes])) if axes else 1


def bet(exp, mesh_shape: dict[str, int], rules) -> str | None:
  """One line when the experiment bets on balance (token copies past a finite capacity or
  expert-parallel buffer are dropped, or stop the run): the bound, what happens past it,
  and the field that changes it; None when no routing can overflow."""
  moe = getattr(exp.model, "moe", None)
  if moe is None:
    return None
  if moe.dispatch == "capacity":
    s = moe.group_size or exp.data.seq_len
    c = moe.capacity(s)
    if c >= s:
      return None
    fair = 2 * s / moe.num_experts
    return (f"MoE routing bets on balance: each expert takes C={c} token copies per group of {s} tokens "
            f"({c / fair:.3g}x its fair share 2S/E = {fair:.3g}, model.moe.capacity_factor="
            f"{moe.capacity_factor:g}; {s} would hold any routing); "
            f"copies past C are dropped (no expert output, the residual carries them) and "
            f"counted in {FRACTION}. Change it: model.moe.capacity_factor")
  n = expert_shards(exp, mesh_shape, rules)
  bound = n * min(moe.top_k, moe.num_experts // n) / moe.top_k
  if moe.expert_buffer is None or n <= 1 or moe.expert_buffer >= bound:
    return None
  past = ("dropped (no expert output, the residual carries them) and counted in "
          f"{FRACTION}" if moe.expert_overflow == "drop" else "an error that stops the run")
  change = ("model.moe.expert_buffer (None: the bound), or expert_overflow='error' to stop "
            "instead of dropping" if moe.expert_overflow == "drop"
            else "model.moe.expert_buffer (None: the bound), or expert_overflow='drop' to drop and count")
  return (f"MoE routing bets on balance: each device's expert-parallel buffer holds expert_buffer="
          f"{moe.expert_buffer:g} fair shares of its token copies ({n} expert shards, top-"
          f"{moe.top_k} of {moe.num_experts}; the no-overflow bound is {bound:g}); copies past it "
          f"are {past}. Change it: {change}")
