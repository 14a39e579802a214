"""What a bet on balance was measured to drop, for the dry run to print beside the bet.

An MoE whose expert-parallel receive buffer is below the no-overflow bound drops the token
copies past it (trainer/moe_drops.py `bet` states the bound). How many depends on the
router, which a dry run does not run. benchmarks/moe_drops.py `--from_step0 --record`
trains a small model with the same router from initialization, prices every training
step's routing against a virtual layout of the same shape (experts per device, senders per
expert group) and writes `MEASURED` (perf/measured_drops.json, package data): one entry per
bet, keyed by the exchange and the buffer. `line` reads it: a measurement on a CPU-sized
model, quoted with what it was measured on, not a prediction for the pod's router.
"""

from __future__ import annotations

import json
import os

MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured_drops.json")


def entries(path: str = MEASURED) -> list[dict]:
  """The recorded measurements ([] without the file)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)


def matching(moe, path: str = MEASURED) -> dict | None:
  """The measurement of `moe`'s bet (a dropless MoE dropping past a finite expert_buffer with
  the exchange and buffer measured), or None."""
  if moe is None or moe.dispatch != "dropless" or moe.expert_buffer is None or moe.expert_overflow != "drop":
    return None
  return next((e for e in entries(path) if e["expert_exchange"] == moe.expert_exchange
               and e["expert_buffer"] == moe.expert_buffer), None)


def line(moe, path: str = MEASURED) -> str | None:
  """One line for the dry run: what the bet dropped over a whole small run from step 0."""
  e = matching(moe, path)
  if e is None:
    return None
  curve = ", ".join(f"{f:.1%} over steps {a}-{b}" if a != b else f"{f:.1%} at step {a}" for a, b, f in e["windows"])
  settled = (f"under 0.01% from step {e['under_from_step']}" if e["under_from_step"] <= e["steps"]
             else "not yet under 0.01% at the last step")
  return (f"measured bet ({e['expert_exchange']} exchange, buffer {e['expert_buffer']:g}): a "
          f"{e['steps']}-step run from initialization of {e['model']} ({e['experts_per_device']} experts a "
          f"device, {e['group']} senders of {e['tokens_per_sender']} tokens an expert group) dropped "
          f"{e['run_fraction']:.2%} of its token copies ({curve}), {e['worst_step'][1]:.2%} in its worst "
          f"step ({e['worst_step'][0]}), {e['worst_layer_any_step']:.1%} in the worst layer of any step; "
          f"{settled} (benchmarks/moe_drops.py --from_step0, {e['measured']})")
