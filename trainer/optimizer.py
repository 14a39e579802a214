"""The optimizer: AdamW or Adafactor, warmup then cosine decay, global-norm clipping,
per-parameter options by name, and an optional higher-precision master copy.

Per-parameter options (`param_rule`) come from a parameter's path and logical axes,
never from its rank: a scanned model stacks its norm scales as [layers, embed] (a
pipelined one as [stage, layers/stage, embed]), and a rank test would decay them
in the scanned twin and not in the unscanned one.

Layer stacks: the leading `stage` / `repeat` / `layers` dims of a scanned or
pipelined weight hold copies of one layer's weight (and an MoE layer's leading
`expert` dim one matrix per expert). Elementwise rules (AdamW) do
not care, but Adafactor's factored moments, its update clipping and its parameter
scale all look at a whole weight matrix, so Adafactor runs under `per_param`, which
vmaps it over those dims: every layer of a stack is optimized exactly as the same
layer of an unscanned model is.

Master weights (`optimizer.master_dtype`): with bf16 params and a float32 master,
the optimizer state holds a float32 copy of the params (sharded like them); the
update is applied to the copy and the params become the copy cast down, so updates
smaller than a bf16 step accumulate instead of rounding away.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardax.configs.schema import OptimizerConfig

# Leading dims that stack independent weight matrices: copies of one layer, and the experts
# of an MoE layer ([layers, expert, embed, mlp]: Adafactor factors each expert's own
# [embed, mlp] matrix, as GShard's Adafactor factored the last two dims, and its moments keep
# the expert dim's sharding instead of a replicated [embed, mlp] statistic).
STACK_AXES = ("stage", "repeat", "layers", "expert")
NO_DECAY_NAMES = ("scale", "bias")           # norm scales and biases: never decayed
EMBEDDING_NAMES = ("embedding",)             # decayed only with optimizer.decay_embeddings


@dataclasses.dataclass(frozen=True)
class ParamRule:
  """What the optimizer does differently for one parameter."""
  decay: bool          # weight decay applies
  stack_dims: int      # leading layer-stack dims (each index along them is one layer's weight)


def param_rule(path: str, axes: tuple, cfg: OptimizerConfig) -> ParamRule:
  """The options of the parameter at `path` ('layers/blocks/attn_norm/scale') whose dims
  carry the logical names `axes`. The one place these choices are made."""
  name = path.rsplit("/", 1)[-1]
  decay = name not in NO_DECAY_NAMES and (cfg.decay_embeddings or name not in EMBEDDING_NAMES)
  return ParamRule(decay=decay, stack_dims=stack_dims(axes))


def stack_dims(axes: tuple) -> int:
  """How many leading dims of a param named `axes` are layer-stack dims."""
  n = 0
  while n < len(axes) and axes[n] in STACK_AXES:
    n += 1
  return n


def param_rules(param_axes: Any, cfg: OptimizerConfig) -> Any:
  """The params tree with a `ParamRule` per leaf (`param_axes`: logical-axes tuple per param)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(param_axes, is_leaf=_is_axes)
  return treedef.unflatten([param_rule(_path_str(p), tuple(a), cfg) for p, a in flat])


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  decay = cfg.decay_steps or total_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(decay, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.end_learning_rate_fraction)


def make(cfg: OptimizerConfig, total_steps: int, params: Any, param_axes: Any
         ) -> optax.GradientTransformation:
  """The optimizer for params shaped like `params` (arrays or shape structs) with
  logical axes `param_axes`."""
  rules = param_rules(param_axes, cfg)
  lr = schedule(cfg, total_steps)
  if cfg.name == "adamw":
    update = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         mask=jax.tree.map(lambda r: r.decay, rules))
  else:
    update = per_param(lambda rule: _adafactor(cfg, lr, rule.decay), rules)
  tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), update) if cfg.clip_norm else update
  master = jnp.dtype(cfg.master_dtype) if cfg.master_dtype else None
  if master is not None and any(jnp.dtype(p.dtype) != master for p in jax.tree.leaves(params)):
    tx = with_master(tx, master)
  return tx


def _adafactor(cfg: OptimizerConfig, lr: optax.Schedule, decay: bool) -> optax.GradientTransformation:
  """optax's Adafactor for one weight matrix; decoupled decay follows the schedule as
  AdamW's does (each step shrinks the weight by lr(t) * weight_decay)."""
  rate = (lambda count: cfg.weight_decay * lr(count)) if decay and cfg.weight_decay else None
  return optax.adafactor(
      learning_rate=lr, min_dim_size_to_factor=cfg.factored_min_dim, decay_rate=cfg.decay_rate,
      clipping_threshold=cfg.update_clip, multiply_by_parameter_scale=cfg.parameter_scale,
      weight_decay_rate=rate)


# --- per-parameter optimizers over layer stacks -------------------------------------------

def per_param(make_one: Callable[[ParamRule], optax.GradientTransformation], rules: Any
              ) -> optax.GradientTransformation:
  """An optimizer that runs `make_one(rule)` on each parameter on its own, vmapped over
  the parameter's layer-stack dims (so it sees one layer's weight at a time).

  The state is the params tree with each param's (stacked) inner state in its place.
  Only for transformations with no cross-parameter coupling (global clipping goes before).
  """
  def over_stack(fn, dims):
    for _ in range(dims):
      fn = jax.vmap(fn)
    return fn

  def init(params):
    return jax.tree.map(lambda p, r: over_stack(make_one(r).init, r.stack_dims)(p), params, rules)

  def update(updates, state, params=None):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    treedef = jax.tree.structure(updates)
    out = [over_stack(make_one(r).update, r.stack_dims)(u, s, p) for u, s, p, r in zip(
        treedef.flatten_up_to(updates), treedef.flatten_up_to(state),
        treedef.flatten_up_to(params), treedef.flatten_up_to(rules), strict=True)]
    return treedef.unflatten([u for u, _ in out]), treedef.unflatten([s for _, s in out])

  return optax.GradientTransformation(init, update)


# --- master weights ------------------------------------------------------------------------

class MasterState(NamedTuple):
  master: Any     # the params in the master dtype, sharded like the params
  inner: Any      # the wrapped optimizer's state, built on the master copy


def with_master(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`inner` run on a `dtype` copy of the params. Use `apply_updates` below to get the
  params (the copy cast down, exactly); `optax.apply_updates` lands within one rounding."""
  cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)

  def init(params):
    master = cast(params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params=None):
    updates, inner_state = inner.update(cast(grads), state.inner, state.master)
    master = optax.apply_updates(state.master, updates)
    param_updates = jax.tree.map(lambda m, p: m - p.astype(dtype), master, params)
    return param_updates, MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any, opt_state: Any) -> Any:
  """The params after an update: the master copy cast to each param's dtype when the
  state holds one, else params + updates. (Decided at trace time: no per-step cost.)"""
  if isinstance(opt_state, MasterState):
    return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params)
  return optax.apply_updates(params, updates)


# --- logical axes of the optimizer state ---------------------------------------------------

def map_state_axes(opt_state: Any, params: Any, param_axes: Any,
                   fn: Callable[[tuple, Any], Any]) -> Any:
  """`fn(logical_axes, leaf)` for every leaf of the optimizer state `opt_state` (shape structs).

  Every subtree shaped like the params (moments, master copy, per-param states) is
  matched param by param: a leaf shaped like its param takes the param's axes; a
  factored moment keeps the axes of the dims it keeps (Adafactor's row statistics of
  an [embed, mlp] kernel are ('embed',), so FSDP splits them as it splits the kernel);
  stacked counters keep the stack dims' axes; everything else (step counts) is replicated.
  """
  treedef = jax.tree.structure(params)
  p_leaves, a_leaves = treedef.flatten_up_to(params), treedef.flatten_up_to(param_axes)

  def walk(node):
    try:
      subtrees = treedef.flatten_up_to(node)
    except (TypeError, ValueError):
      subtrees = None
    if subtrees is not None:
      return treedef.unflatten([_map_one(s, p, tuple(a), fn)
                                for s, p, a in zip(subtrees, p_leaves, a_leaves, strict=True)])
    if hasattr(node, "shape"):
      return fn((None,) * len(node.shape), node)
    children, node_def = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    return node_def.unflatten([walk(c) for c in children])

  return walk(opt_state)


def _map_one(sub: Any, param: Any, axes: tuple, fn: Callable) -> Any:
  """Axes of the state leaves that belong to one param (see `map_state_axes`)."""
  stack = stack_dims(axes)
  pshape = tuple(param.shape)

  def one(path, leaf):
    shape = tuple(leaf.shape)
    if shape == pshape:
      return fn(axes, leaf)
    if shape[:stack] != pshape[:stack]:
      return fn((None,) * len(shape), leaf)
    local, plocal = shape[stack:], pshape[stack:]
    kept = _kept_dims(plocal, local, _field(path))
    if kept is not None:
      return fn(axes[:stack] + tuple(axes[stack + d] for d in kept), leaf)
    return fn(axes[:stack] + (None,) * len(local), leaf)

  return jax.tree_util.tree_map_with_path(one, sub)


def _kept_dims(pshape: tuple, shape: tuple, field: str | None) -> tuple[int, ...] | None:
  """Which dims of a weight of shape `pshape` a factored moment of shape `shape` keeps
  (None: `shape` is no weight shape with one dim averaged away, e.g. a placeholder).

  optax factors the two largest dims (d1 second largest, d0 largest, by argsort):
  `v_row` averages d0 away, `v_col` d1. Equal sizes make the shape ambiguous, so the
  field name decides, and the shape is checked against optax's choice.
  """
  candidates = [d for d in range(len(pshape)) if pshape[:d] + pshape[d + 1:] == shape]
  if len(pshape) < 2 or not candidates:
    return None
  order = np.argsort(pshape)
  drop = {"v_row": int(order[-1]), "v_col": int(order[-2])}.get(field)
  if drop is None and len(candidates) == 1:
    drop = candidates[0]
  if drop not in candidates:
    raise ValueError(f"optimizer state {field or '?'} of shape {shape} does not match a weight of "
                     f"shape {pshape} with one dim averaged away (optax's factoring rule changed?)")
  return tuple(d for d in range(len(pshape)) if d != drop)


def _field(path) -> str | None:
  names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
  return names[-1] if names else None


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")
