"""Cross-slice transfers of a multi-slice TPU program: the megascale host transfers.

The TPU compiler keeps every HLO collective inside a slice and moves the cross-slice (DCN)
part in host transfers, `send`/`recv` pairs with `is_host_transfer=true` run by the
megascale runtime. Their frontend attributes say what each is:

  _xla_megascale_transfer_type   ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, ONE_TO_ONE
  _xla_host_transfer_rendezvous  the name a send and its recv share
  _xla_megascale_target          the slices it spans, in one of two forms:
      "{1,2}x{0:3}"                  slices 1 and 2, devices 0 to 3 of each (a collective);
      "{{100000->200000},...}"       pairs of slice x 100000 + device (one-to-one sends).
"""

from __future__ import annotations

import re

from shardax.perf.hlo.module import Instruction

KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
         "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}
_SLICES = re.compile(r"^\{([\d,]+)\}x")
_SOURCE, _DEST = re.compile(r"(\d+)->"), re.compile(r"->(\d+)")


def kind(inst: Instruction) -> str:
  """The collective a megascale send performs ("" for any other instruction): its transfer
  type in the collectives' spelling (an unknown type lower-cased)."""
  t = inst.frontend_attributes.get("_xla_megascale_transfer_type", "")
  return KINDS.get(t, t.lower())


def rendezvous(inst: Instruction) -> str:
  return inst.frontend_attributes.get("_xla_host_transfer_rendezvous", "")


def target(inst: Instruction) -> str:
  return inst.frontend_attributes.get("_xla_megascale_target", "")


def senders(target_text: str) -> set[int]:
  """The slices that send in a pairs target (empty for the collective form)."""
  return {int(x) // 100000 for x in _SOURCE.findall(target_text)}


def span(target_text: str) -> int:
  """How many slices a transfer spans: those listed, else those in its pairs, else 2."""
  if s := _SLICES.match(target_text):
    return len(s.group(1).split(","))
  return len(senders(target_text) | {int(x) // 100000 for x in _DEST.findall(target_text)}) or 2
