"""Logical axis names -> mesh axes.

Model code names the dims of params and activations logically (`batch`, `embed`,
`mlp`, `heads`, ...). An experiment picks rules: an ordered list of
(logical name, mesh axis | tuple of mesh axes | None). For each dim of a tensor,
in order, the first rule for its name whose mesh axes are still unused by the
tensor's earlier dims wins; None means "replicated, stop looking". That one
ordering trick is what lets one rule list say "weights [data, model],
activations [data, None, model]": `embed` goes to `data` in a weight
(embed, mlp), but in an activation (batch, length, embed) `batch` took `data`
first, so `embed` falls through to its next rule, `model`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator, Sequence

from jax.sharding import PartitionSpec

Rule = tuple[str, Any]  # (logical name, None | "axis" | ("axis", "axis", ...))
Rules = tuple[Rule, ...]

_MEGATRON = (("mlp", "model"), ("heads", "model"), ("kv_heads", "model"), ("vocab", "model"))


def _LOW_RANK(axes) -> Rules:
  """Multi-head latent attention's low-rank dims (layers/mla.py) FSDP-split like `embed`: the up
  projections [q_lora | kv_lora, heads, kv] have no embed dim, and would else be whole on every
  device. In a weight with an embed dim (the down projections) or an activation with a batch
  dim, that dim takes the axis first and the rank stays whole."""
  return (("q_lora", axes), ("kv_lora", axes))

PRESETS: dict[str, Rules] = {
    # Batch split over `data`; weights replicated; one gradient all-reduce per step.
    "dp": (("batch", "data"),),
    # ZeRO-3 / weight-update sharding: weights and optimizer state also split over `data`
    # (on their `embed` dim, which nearly every weight has; MLA's up projections, which have
    # none, on their rank dim: _LOW_RANK); all-gather before use, reduce-scatter of gradients.
    "fsdp": (("batch", "data"), ("embed", "data")) + _LOW_RANK("data"),
    # Megatron tensor parallelism: hidden, heads and vocab split over `model`.
    "tp": (("batch", "data"),) + _MEGATRON,
    # The GSPMD paper's 2D recipe: weights [data, model], activations [data, None, model].
    "2d": (("batch", "data"), ("embed", "data"), ("embed", "model")) + _LOW_RANK("data") + _MEGATRON,
    # Three axes: plain data parallel over `data`, FSDP over `fsdp`, Megatron over `model`.
    "dp_fsdp_tp": (("batch", ("data", "fsdp")), ("embed", "fsdp")) + _LOW_RANK("fsdp") + _MEGATRON,
    # GShard expert parallelism: experts split over the same `data` axis as the batch, so
    # moving tokens from group-split to expert-split (and back) is an all-to-all.
    "expert": (("batch", "data"), ("expert", "data")),
    # Experts on their own `expert` axis: the batch is split over both axes, so tokens
    # all-to-all within an expert group; tensors whose `expert` dim took that axis keep
    # the batch on `data` alone (the second batch rule).
    "expert_axis": (("batch", ("data", "expert")), ("batch", "data"), ("expert", "expert")),
    # Spatial partitioning (GSPMD paper's 3D U-Net): image rows over `spatial`; each conv
    # exchanges k//2 border rows with its neighbours (collective-permute, the halo).
    "spatial": (("batch", "data"), ("height", "spatial")),
    # ... rows over `spatial` and columns over `spatial_w`: 2D tiles, halos along both.
    "spatial_hw": (("batch", "data"), ("height", "spatial"), ("width", "spatial_w")),
}

# Pipeline parallelism (shardax.pipeline): the stage-stacked weights' and the stage
# buffer's leading `stage` dim on the `stage` mesh axis, combined with the modes above
# (the expert ones for MoE models: each stage's all-to-alls stay inside its stage group).
PRESETS.update({f"pp_{name}": (("stage", "stage"),) + PRESETS[name]
                for name in ("dp", "tp", "2d", "expert", "expert_axis")})

# The decode KV cache [cache_batch, cache_length, kv_heads, kv] (layers/attention.py):
# its batch dim goes where the preset sends `batch` (data), its kv heads follow the
# `kv_heads` rule (model, in the Megatron presets); its length and head dim stay whole.
PRESETS = {name: rules + tuple(("cache_batch", axes) for n, axes in rules if n == "batch")
           for name, rules in PRESETS.items()}


def split_over_stages(rules: Rules) -> Rules:
  """A pipeline's rules with the batch also split over `stage` outside the stage loop: the
  embedding, an MoE model's first dense layers, the final norm, head and loss then run on
  1/S of the rows in each stage group instead of all of them in every group (the head of
  a 200k vocabulary is ~6% of a Llama-4-sized model's FLOPs). Tensors with a stage dim (the
  loop's buffers) and the stage body (`within_stage`) keep the batch on its other axes, as
  does a batch whose rows the stage groups do not divide (`logical_to_spec`)."""
  first = next((axes for name, axes in rules if name == "batch"), None)
  first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
  if not first or "stage" in first:
    return rules
  return (("batch", ("stage",) + first),) + tuple(rules)


PRESETS.update({name: split_over_stages(rules) for name, rules in PRESETS.items() if name.startswith("pp_")})


def without_stages(rules: Rules, axis: str = "stage") -> Rules:
  """A pipeline's rules as the same layout without the pipeline: `axis` taken out of every
  rule (rules that name only it dropped, with the duplicates that leaves; the inverse of
  `split_over_stages` plus a ("stage", "stage") rule). Used by the planner (plan.py)."""
  out = []
  for name, axes in rules:
    kept = tuple(a for a in _axes_tuple(axes) if a != axis)
    if axes is not None and not kept:
      continue
    rule = (name, None if axes is None else kept[0] if len(kept) == 1 else kept)
    if rule not in out:
      out.append(rule)
  return tuple(out)

# (rules, allow_uneven) in force for `shard()`; set by `use_rules`.
_current: contextvars.ContextVar[tuple[Rules | None, bool]] = contextvars.ContextVar(
    "shardax_rules", default=(None, False))


def resolve(preset: str | None = None, rules: Sequence[Rule] | None = None) -> Rules:
  """The rule list an experiment asked for: explicit rules win over the preset."""
  if rules is not None:
    return normalize(rules)
  if preset not in PRESETS:
    raise ValueError(f"unknown sharding preset {preset!r}; choose one of {sorted(PRESETS)} "
                     f"or give sharding.rules explicitly")
  return PRESETS[preset]


def normalize(rules: Sequence[Rule]) -> Rules:
  out = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"sharding rule {rule!r} must be (logical_name, mesh_axis | (axes...) | None)")
    name, axes = rule
    if isinstance(axes, list):
      axes = tuple(axes)
    out.append((name, axes))
  return tuple(out)


@contextlib.contextmanager
def use_rules(rules: Rules | None, allow_uneven: bool = False) -> Iterator[Rules | None]:
  """Make `rules` the ones `shard()` uses inside this block (e.g. while tracing a step)."""
  token = _current.set((None if rules is None else normalize(rules), allow_uneven))
  try:
    yield _current.get()[0]
  finally:
    _current.reset(token)


def current_rules() -> Rules | None:
  return _current.get()[0]


@contextlib.contextmanager
def within_stage(axis: str = "stage") -> Iterator[Rules | None]:
  """Inside a pipeline stage body (vmapped with spmd_axis_name=`axis`): the rules with `axis`
  taken out of every rule that splits another logical dim over it. The vmap puts the stage
  dim on that axis itself; outside the loop a pp_ preset also splits the batch over it
  (`PRESETS`), which inside would name the axis twice."""
  rules, uneven = _current.get()
  if rules is not None:
    rules = tuple((name, axes if name == axis else tuple(a for a in _axes_tuple(axes) if a != axis) or None)
                  for name, axes in rules)
  token = _current.set((rules, uneven))
  try:
    yield rules
  finally:
    _current.reset(token)


def allow_uneven() -> bool:
  return _current.get()[1]


def _axes_tuple(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules,
                    mesh_shape: dict[str, int] | None = None,
                    shape: Sequence[int] | None = None, name: str = "tensor",
                    allow_uneven: bool = False) -> PartitionSpec:
  """PartitionSpec for a tensor whose dims are named `logical_axes`.

  With `mesh_shape` (axis name -> size) the rules are checked against the mesh; with
  `shape` too, every split dim must be divisible by its mesh axes unless `allow_uneven`.
  """
  if shape is not None and len(shape) != len(logical_axes):
    raise ValueError(f"{name}: logical axes {tuple(logical_axes)} name {len(logical_axes)} dims "
                     f"but the shape {tuple(shape)} has {len(shape)}")
  used: set[str] = set()
  spec = []
  for dim, logical in enumerate(logical_axes):
    chosen: tuple[str, ...] = ()
    for rule_name, rule_axes in rules:
      if rule_name != logical:
        continue
      axes = _axes_tuple(rule_axes)
      if mesh_shape is not None:
        for a in axes:
          if a not in mesh_shape:
            raise ValueError(f"sharding rule ({rule_name!r}, {rule_axes!r}) names mesh axis {a!r}, "
                             f"but the mesh has axes {tuple(mesh_shape)}; add it to mesh.axes "
                             f"or change the rule")
      if used.intersection(axes):
        continue
      if ("stage" in axes and logical != "stage" and shape is not None and mesh_shape is not None
          and shape[dim] % math.prod(mesh_shape[a] for a in axes)):
        continue   # `split_over_stages`: a batch the stages do not divide keeps its other rule
      chosen = axes
      break
    if chosen and shape is not None and mesh_shape is not None:
      parts = math.prod(mesh_shape[a] for a in chosen)
      if shape[dim] % parts and not allow_uneven:
        raise ValueError(
            f"{name}: dim {dim} ({logical!r}) has size {shape[dim]}, which mesh axes {chosen} "
            f"(total size {parts}) do not divide; change the model size, the mesh, or the rule "
            f"for {logical!r} (or --set sharding.allow_uneven=True to let the compiler pad)")
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return PartitionSpec(*spec)


# Context parallelism (layers/context_parallel.py): the sequence (`length`) of every
# activation also split, over a `context` axis; attention then runs by all-gathered or
# ring-passed K/V. `name_cp` is preset `name` plus that rule; `fsdp_cp` also splits the
# weights over `context` (ZeRO-3 over both axes: the context devices would otherwise
# each hold the data axis's whole weight shard).
PRESETS.update({f"{name}_cp": PRESETS[name] + (("length", "context"),) for name in ("dp", "tp", "2d")})
PRESETS["fsdp_cp"] = (("batch", "data"), ("embed", ("data", "context")), ("length", "context"),
                      ("cache_batch", "data")) + _LOW_RANK(("data", "context"))
