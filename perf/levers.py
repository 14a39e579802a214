"""What would make a dry run fit: the memory levers a config has not used, ranked by the bytes
each would free, read from the compiled program's buffer list (perf/buffers.py).

Each lever looks for the buffers it removes in the list (device temp blocks, largest first):
  model.loss_chunk    the [batch, length, vocab] logits blocks (and their gradient): chunked,
                      one chunk of them remains (layers/transformer.py `head_losses`);
  model.remat         'offload': blocks stacked over the layers ([layers, batch, length, ...]:
                      the activations the scan saves for the backward pass), or in a pipeline
                      over its iterations ([iterations, stage, rows, length, ...]: the saved
                      stage inputs), move to host; never offered where the config would refuse
                      it (configs/pipeline.py `remat_refusal`);
  train.microbatches  2: the blocks that hold the sequence ([..., length, ...]) halve, less
                      the f32 gradient accumulator (the params' bytes) that accumulation adds;
  FSDP width          weights and optimizer state over twice the chips (a slice twice as
                      large at the same per-chip batch), or over all chips with
                      sharding.preset='fsdp' where the preset keeps them replicated.
The figures are estimates from the listed (largest) blocks, not a recompile: a lower bound
where the list is cut short, and a ranking, which is what a user needs to pick what to try.
"""

from __future__ import annotations

import dataclasses

from shardax.configs.pipeline import remat_refusal
from shardax.configs.schema import Experiment
from shardax.pipeline.schedule import Schedule

_FSDP = ("fsdp", "fsdp_cp", "2d")
_KEEPS_INPUTS = ("none", "full", "dots", "dots_no_batch")
_OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class Lever:
  setting: str   # what to set (a --set flag, or the change to make)
  saves: int     # bytes per device it would free (estimate from the buffer list)
  why: str       # the buffers it removes


def _shape(b) -> str:
  return f"{b['dtype']}[{','.join(map(str, b['shape']))}]"


def _sum(blocks: list[dict]) -> int:
  return sum(b["bytes"] for b in blocks)


def _named(blocks: list[dict]) -> str:
  more = f" and {len(blocks) - 1} more" if len(blocks) > 1 else ""
  return f"{_shape(blocks[0])}{more}"


def _chunk(seq_len: int) -> int:
  """A chunk of about an eighth of the sequence that divides it (at least 128 positions)."""
  c = max(128, seq_len // 8)
  while seq_len % c and c > 1:
    c -= 1
  return c


def rank(exp: Experiment, mem: dict, buffers: list[dict]) -> list[Lever]:
  """The unused levers that would free memory on this config, largest saving first."""
  m, seq = exp.model, exp.data.seq_len
  device = [b for b in buffers if b["space"] == "device" and b["shape"]]
  out = []
  logits = [b for b in device if len(b["shape"]) >= 2 and b["shape"][-2] == seq
            and b["shape"][-1] * 64 >= m.vocab_size and m.vocab_size % b["shape"][-1] == 0]
  if logits and not 0 < getattr(m, "loss_chunk", 0) < seq:
    c = _chunk(seq)
    out.append(Lever(f"model.loss_chunk={c}", int(_sum(logits) * (1 - c / seq)), f"logits {_named(logits)}"))
  p = getattr(m, "pipeline", None)
  stages = p.stages if p is not None else 1
  saved_over = {m.num_layers} if stages == 1 else {
      Schedule(p.stages, p.microbatches, p.circular_repeats, p.delay_shift).iterations}
  stacked = [b for b in device if len(b["shape"]) >= 3 and b["shape"][0] in saved_over and seq in b["shape"][1:]]
  if stacked and m.remat in _KEEPS_INPUTS and remat_refusal(_OFFLOAD, stages) is None:
    out.append(Lever(f"model.remat={_OFFLOAD!r}", _sum(stacked), f"saved activations {_named(stacked)}"))
  sequence = [b for b in device if seq in b["shape"]]
  if sequence and exp.train.microbatches == 1 and exp.train.global_batch > 1:
    saves = _sum(sequence) // 2 - (mem.get("params") or 0)
    if saves > 0:
      out.append(Lever("train.microbatches=2", saves, f"activations {_named(sequence)}"))
  state = (mem.get("params") or 0) + (mem.get("optimizer_state") or 0)
  if state:
    if exp.sharding.preset in _FSDP:
      out.append(Lever("a slice twice as wide at the same per-chip batch (FSDP width x2)", state // 2,
                       "params and optimizer state"))
    else:
      out.append(Lever("sharding.preset='fsdp'", state // 2, "params and optimizer state (at least half)"))
  return sorted(out, key=lambda l: -l.saves)


def hint(levers: list[Lever]) -> str:
  """The ranked levers as one line for the dry run's hint."""
  return "levers this config has not used, by the memory each frees (from the buffer list): " + "; ".join(
      f"{l.setting}: ~{l.saves / 2**30:.2f} GiB ({l.why})" for l in levers)
