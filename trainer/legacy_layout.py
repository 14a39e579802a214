"""Checkpoints in the former MoE layout restore onto today's model.

In that layout the MoE LM was a model of its own, with its layer stack at the top of the
params: `units/...` (the repeating units) and `first_dense/...` (DeepSeek-style leading dense
layers). It is now the one TransformerLM, whose stack lives under `layers/`:
`layers/blocks/...` and `layers/first_dense/...`; everything below those names is the same
(a unit is still `dense/{i}` + `moe_block/{attn, attn_norm, mlp_norm, moe}`). The same
renaming applies wherever the params' tree appears (the optimizer's moments, a master copy).
The checkpointer reads such a step through `to_legacy` of the wanted tree and hands back
`from_legacy` of what it read: nothing is rewritten on disk.
"""

from __future__ import annotations

from typing import Any, Callable


def is_legacy(stored_paths) -> bool:
  """Whether a checkpoint's leaf paths (tuples of names) hold the old MoE layout."""
  return any("units" in p for p in stored_paths) and not any("layers" in p for p in stored_paths)


def _map_dicts(tree: Any, fn: Callable[[dict], dict]) -> Any:
  """`tree` with `fn` applied to every dict (bottom-up through dicts, lists, tuples and
  namedtuples; other leaves as they are)."""
  if isinstance(tree, dict):
    return fn({k: _map_dicts(v, fn) for k, v in tree.items()})
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(_map_dicts(v, fn) for v in tree))
  if isinstance(tree, (list, tuple)):
    return type(tree)(_map_dicts(v, fn) for v in tree)
  return tree


def _old(d: dict) -> dict:
  if "embed" not in d or not isinstance(d.get("layers"), dict) or "blocks" not in d["layers"]:
    return d
  out = {k: v for k, v in d.items() if k != "layers"}
  out["units"] = d["layers"]["blocks"]
  if d["layers"].get("first_dense") is not None:
    out["first_dense"] = d["layers"]["first_dense"]
  return out


def _new(d: dict) -> dict:
  if "embed" not in d or "units" not in d:
    return d
  out = {k: v for k, v in d.items() if k not in ("units", "first_dense")}
  out["layers"] = {"blocks": d["units"]}
  if "first_dense" in d:
    out["layers"]["first_dense"] = d["first_dense"]
  return out


def to_legacy(tree: Any) -> Any:
  """Today's state tree (abstract or real) in the old MoE layout."""
  return _map_dicts(tree, _old)


def from_legacy(tree: Any) -> Any:
  """A state tree read in the old MoE layout, in today's."""
  return _map_dicts(tree, _new)
