"""The jitted train and eval steps.

One optimizer update per call. With `train.microbatches = M > 1` the global
batch is cut into M microbatches whose gradients are summed under `lax.scan`
(activation memory of one microbatch, the update of the whole batch). The
cut takes every M-th row, so each microbatch keeps the batch dim's data
sharding and no example moves between devices.

A non-finite loss or gradient never reaches the weights: the update is
replaced by the old state in-graph (no host sync per step), the step reports
`finite=False`, and the loop applies the configured policy.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from shardax.layers import quantization, transformer
from shardax.sharding import shard
from shardax.sharding.target import target_platform
from shardax.trainer import optimizer
from shardax.trainer.state import Setup

# A model's metrics may carry, under this key, a subtree of its params with new values
# (state the model updates itself, not by gradient: the MoE balance biases of
# layers/transformer.py). The step writes them over the optimizer's result and never logs them.
STATE_UPDATES = transformer.STATE_UPDATES

# Token copies a dropless MoE could not fit in its expert-parallel buffers (the step's
# loss is NaN then): the loop raises `loop.expert_buffer_error` on it, in training and eval.
OVERFLOW = "moe/expert_buffer_overflow"
# Token copies each MoE layer routed to experts and those that got no expert output
# ([moe layers (+ MTP depths in training)] each, counts of the whole batch): trainer/moe_drops.py
# reports them.
ROUTED = "moe/routed_copies_count"
DROPPED = "moe/dropped_copies_count"
COUNTS = (ROUTED, DROPPED)


def loss_fn(setup: Setup) -> Callable[[Any, dict], tuple[jax.Array, dict]]:
  """`(params, batch) -> (loss, metrics)`: the model's own training objective."""
  def loss(params, batch):
    return setup.model(params).loss_and_metrics(batch)
  return loss


def _microbatches(batch: dict, m: int) -> dict:
  def split(x):
    b = x.shape[0]
    x = x.reshape((b // m, m) + x.shape[1:]).swapaxes(0, 1)  # [M, B/M, ...], row i*M+j -> (j, i)
    return shard(x, (None, "batch") + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def grads_and_loss(setup: Setup, params, batch: dict):
  """(loss, grads, metrics), averaged over the microbatches (`COUNTS` summed: they count
  the whole batch's copies)."""
  grad_fn = jax.value_and_grad(loss_fn(setup), has_aux=True)
  m = setup.exp.train.microbatches
  if m == 1:
    (loss, metrics), grads = grad_fn(params, batch)
    return loss, grads, metrics

  def body(acc, mb):
    (l, metrics), g = grad_fn(params, mb)
    total, grads, summed = acc
    # fp8 amax histories: their next values combine by max, not sum (layers/quantization.py).
    return (total + l, quantization.accumulate(grads, g), jax.tree.map(jnp.add, summed, metrics)), None

  shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], _microbatches(batch, m)))
  (_, metrics_shape), _ = shapes
  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape))
  (total, grads, metrics), _ = jax.lax.scan(body, zeros, _microbatches(batch, m))
  metrics = {k: v if k in COUNTS else jax.tree.map(lambda x: x / m, v) for k, v in metrics.items()}
  return total / m, quantization.mean_grads(grads, m), metrics


def train_step_fn(setup: Setup) -> Callable:
  """A jitted `(state, batch) -> (state, metrics)`; the state is donated."""
  lr = optimizer.schedule(setup.exp.optimizer, setup.exp.train.steps)
  # How the guard keeps the old state, by the platform the step compiles for. On a CPU a
  # branch: a select of new vs old keeps the old Adam moments alive beside the new ones and
  # XLA copies every moment each step (tests/test_overhead.py counts the copies).
  # Elsewhere a select: the TPU compiler lays out a scanned stack's update differently under
  # a branch than an unrolled one's (loop-aware costs of the twins 12.6% apart,
  # tests/test_costs.py), and the dry run's depth extrapolation rests on them agreeing; on
  # an H100 XLA fuses the select into the update. Measured overheads: docs/results/code_notes.md.
  guard_by_branch = target_platform(setup.mesh) == "cpu"

  def step(state, batch):
    loss, grads, model_metrics = grads_and_loss(setup, state["params"], batch)
    written = model_metrics.pop(STATE_UPDATES, None)
    # fp8 delayed scaling: the amax histories' "gradients" are their next values
    # (layers/quantization.py); they are written, never seen by the optimizer or the norm.
    grads, histories = quantization.take_histories(grads)
    if histories:
      written = _merge(written or {}, histories)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state):
      updates, opt_state = setup.tx.update(grads, opt_state, params)
      params = optimizer.apply_updates(params, updates, opt_state)
      return overwrite(params, opt_state, written) if written else (params, opt_state)

    if guard_by_branch:
      params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o),
                                       state["params"], state["opt_state"])
    else:
      new = update(state["params"], state["opt_state"])
      params, opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o),
                                       new, (state["params"], state["opt_state"]))
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
    metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr(state["step"]),
               "finite": finite, **model_metrics}
    return new_state, metrics

  return jax.jit(step, in_shardings=(setup.shardings, setup.batch_sharding),
                 out_shardings=(setup.shardings, setup.replicated), donate_argnums=0)


def _merge(a: dict, b: dict) -> dict:
  """Two subtrees of the params as one (their leaves never overlap)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = _merge(out[k], v) if k in out and isinstance(v, dict) else v
  return out


def overwrite(params, opt_state, written: dict):
  """params with the leaves of `written` (a subtree of params) set, in the optimizer's master
  copy too where it keeps one (else the next step would cast the old value back)."""
  def put(tree, sub):
    if not isinstance(sub, dict):
      return jnp.asarray(sub, tree.dtype)
    return {k: put(tree[k], sub[k]) if k in sub else v for k, v in tree.items()}
  params = put(params, written)
  if isinstance(opt_state, optimizer.MasterState):
    opt_state = opt_state._replace(master=put(opt_state.master, written))
  return params, opt_state


def eval_loss_fn(setup: Setup) -> Callable[[Any, dict], tuple[jax.Array, jax.Array]]:
  """`(params, batch) -> (loss, weight)` as evaluation reports it: the loss is the mean
  per target token of the batch and `weight` the number of targets it averages (its
  loss mask's sum on packed text, else every target; 1 for a model that reports no
  `loss_weight`), so a caller weighs batches, and padding, by what they hold.

  The loss measures the model, not the training objective: the model's `eval_loss`
  where it has one (the LM: cross entropy alone, MoE routing deterministic, no balance or
  z-loss), else its training loss without regularizers (`ce_loss` where the model reports it)."""
  def loss(params, batch):
    value, metrics = eval_loss_and_metrics(setup)(params, batch)
    return value, metrics["loss_weight"]
  return loss


def eval_loss_and_metrics(setup: Setup) -> Callable[[Any, dict], tuple[jax.Array, dict]]:
  """`eval_loss_fn` with its metrics: 'loss_weight'; for a dropless MoE, the token
  copies that did not fit the expert-parallel buffers ('moe/expert_buffer_overflow', 0
  else), which turn the loss NaN: the caller raises on them as training does; for an MoE
  model, each layer's routed and dropped copies (`COUNTS`), which the caller reports."""
  def loss(params, batch):
    model = setup.model(params)
    if hasattr(model, "eval_loss"):
      value, metrics = model.eval_loss(batch)
    else:
      value, metrics = model.loss_and_metrics(batch)
      value = metrics.get("ce_loss", value)
    return value, {"loss_weight": jnp.asarray(metrics.get("loss_weight", 1.0), jnp.float32),
                   OVERFLOW: jnp.asarray(metrics.get(OVERFLOW, 0.0), jnp.float32),
                   **{k: jnp.asarray(metrics[k], jnp.float32) for k in COUNTS if k in metrics}}
  return loss


def eval_step_fn(setup: Setup) -> Callable:
  """A jitted `(params, batch) -> mean eval loss` of one batch (see `eval_loss_fn`)."""
  return jax.jit(lambda params, batch: eval_loss_fn(setup)(params, batch)[0],
                 in_shardings=(setup.shardings["params"], setup.batch_sharding),
                 out_shardings=setup.replicated)


def abstract_batch(setup: Setup) -> dict:
  exp = setup.exp
  return {k: jax.ShapeDtypeStruct((exp.train.global_batch,) + tuple(shape), jnp.dtype(dtype),
                                  sharding=setup.batch_sharding[k])
          for k, (shape, dtype, _) in exp.model.batch_fields(exp.data).items()}


def lower_train_step(setup: Setup):
  """The lowered train step from abstract shapes only (`compile_train_step` compiles it; the
  dry run keeps its text and compiles it with its own compiler options).

  Call under the experiment's mesh and rules (`jax.set_mesh`, `use_rules`).
  """
  return train_step_fn(setup).lower(setup.abstract, abstract_batch(setup))


def compile_train_step(setup: Setup):
  """The compiled train step from abstract shapes only: nothing is allocated.

  Call under the experiment's mesh and rules (`jax.set_mesh`, `use_rules`).
  """
  return lower_train_step(setup).compile()
