"""A train step written by hand in plain jax + optax: the yardstick for shardax's own cost.

It trains the same model as shardax's `TransformerLM` (embed, pre-norm blocks with RoPE
grouped-query attention and a gated MLP under `lax.scan`, tied head) over the same
param tree, with the same optimizer (clip + AdamW + warmup-cosine schedule, decay on
matrices only), and nothing else: `value_and_grad`, `tx.update`, `apply_updates`.

On a mesh it says where every tensor lives *directly*, as a jax user would without a
framework: the `PartitionSpec` of every parameter and of every constrained activation
is written out below for each sharding mode (`SPECS`), and the step is a plain
`jax.jit` with those in/out shardings and `with_sharding_constraint` at the points
where the model code annotates. No shardax code builds or runs this step; shardax is
only used by the caller to check that both steps agree (same specs, same losses, same
collectives), which is what makes a ratio of their step times a measure of the
framework's overhead and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.checkpoint_dots,
            "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

# Where each tensor lives, by hand. Params: a spec per leaf name (leading `layers` dim
# of the scanned blocks replicated). Activations: residual [b, l, d], attention heads
# [b, l, n, k], MLP hidden [b, l, f], logits [b, l, v], batch [b, l].
SPECS: dict[str, dict[str, P]] = {
    "1": {},   # one device: nothing to say
    # GSPMD paper 2D recipe on (data, model): weights [data, model], activations [data, None, model].
    "2d": {
        "embedding": P("model", "data"), "scale": P(None, "data"), "final_scale": P("data"),
        "query": P(None, "data", "model", None), "key": P(None, "data", "model", None),
        "value": P(None, "data", "model", None), "out": P(None, "model", None, "data"),
        "gate": P(None, "data", "model"), "up": P(None, "data", "model"), "down": P(None, "model", "data"),
        "residual": P("data", None, "model"), "heads": P("data", None, "model", None),
        "hidden": P("data", None, "model"), "logits": P("data", None, "model"), "batch": P("data", None),
    },
    # FSDP on (data,): batch and every weight's embed dim split over `data`.
    "fsdp": {
        "embedding": P(None, "data"), "scale": P(None, "data"), "final_scale": P("data"),
        "query": P(None, "data", None, None), "key": P(None, "data", None, None),
        "value": P(None, "data", None, None), "out": P(None, None, None, "data"),
        "gate": P(None, "data", None), "up": P(None, "data", None), "down": P(None, None, "data"),
        "residual": P("data", None, None), "heads": P("data", None, None, None),
        "hidden": P("data", None, None), "logits": P("data", None, None), "batch": P("data", None),
    },
}


def param_specs(mode: str) -> dict:
  """The params tree's PartitionSpecs (shardax's pure-dict layout of TransformerLM)."""
  s = SPECS[mode]
  g = lambda k: s.get(k, P())
  return {
      "embed": {"embedding": g("embedding")},
      "final_norm": {"scale": g("final_scale")},
      "layers": {"blocks": {
          "attn_norm": {"scale": g("scale")}, "mlp_norm": {"scale": g("scale")},
          "attn": {k: {"kernel": g(k)} for k in ("query", "key", "value", "out")},
          "mlp": {k: {"kernel": g(k)} for k in ("gate", "up", "down")}}},
  }


def optimizer(lr: float, warmup: int, decay_steps: int, end_fraction: float, clip: float,
              b1: float, b2: float, eps: float, weight_decay: float) -> optax.GradientTransformation:
  """Clip by global norm, AdamW on a warmup + cosine schedule, no decay on vectors."""
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(decay_steps, warmup + 1),
                                             lr * end_fraction)
  adamw = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
  return optax.chain(*([optax.clip_by_global_norm(clip)] if clip else []), adamw)


def _rms_norm(x, scale, dt):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(dt)


def _rope(x, positions, theta):
  d = x.shape[-1]
  inv = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  ang = positions.astype(jnp.float32)[..., None] * inv
  sin, cos = jnp.sin(ang)[..., None, :], jnp.cos(ang)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _attention(q, k, v, fused):
  if fused:
    # cuDNN's flash attention on a GPU (jax's default there is XLA's unfused softmax)
    impl = "cudnn" if jax.default_backend() == "gpu" and q.dtype == jnp.bfloat16 else None
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  b, l, n, d = q.shape
  kv = k.shape[2]
  s = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, l, kv, n // kv, d), k,
                 preferred_element_type=jnp.float32) * jnp.float32(d ** -0.5)
  s = jnp.where(jnp.tril(jnp.ones((l, k.shape[1]), bool)), s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(b, l, n, d)


def loss_fn(cfg: Any, mode: str):
  """(params, batch) -> mean next-token cross entropy, with `mode`'s activation constraints."""
  dt = jnp.dtype(cfg.dtype)
  specs = SPECS[mode]
  pin = (lambda x, name: jax.lax.with_sharding_constraint(x, specs[name])) if specs else (lambda x, _: x)
  c = lambda w: w.astype(dt)
  dot = lambda x, w, n: jax.lax.dot_general(  # contract x's trailing n dims with w's leading n
      x.astype(dt), c(w), ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())),
      preferred_element_type=dt)

  def block(x, p, positions):
    x = pin(x, "residual")
    a = p["attn"]
    h = _rms_norm(x, p["attn_norm"]["scale"], dt)
    q = pin(_rope(dot(h, a["query"]["kernel"], 1), positions, cfg.rope_theta), "heads")
    k = pin(_rope(dot(h, a["key"]["kernel"], 1), positions, cfg.rope_theta), "heads")
    v = pin(dot(h, a["value"]["kernel"], 1), "heads")
    o = pin(_attention(q, k, v, cfg.attention == "fused"), "heads")
    x = pin(x + dot(o, a["out"]["kernel"], 2), "residual")
    m = p["mlp"]
    h = _rms_norm(x, p["mlp_norm"]["scale"], dt)
    hidden = pin(jax.nn.silu(dot(h, m["gate"]["kernel"], 1)) * dot(h, m["up"]["kernel"], 1), "hidden")
    return pin(x + dot(hidden, m["down"]["kernel"], 1), "residual")

  if cfg.remat != "none":
    block = jax.checkpoint(block, policy=POLICIES[cfg.remat], prevent_cse=False)

  def loss(params, batch):
    tokens = batch["inputs"]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    table = c(params["embed"]["embedding"])
    if table.shape[0] <= 4096:  # a small vocab: one-hot matmul, whose gradient is no scatter-add
      rows = jnp.einsum("...v,vd->...d", jax.nn.one_hot(tokens, table.shape[0], dtype=dt), table,
                        precision=jax.lax.Precision.HIGHEST)
    else:
      rows = jnp.take(table, tokens, axis=0)
    x = pin(rows * jnp.asarray(math.sqrt(cfg.d_model), dt), "residual")
    x, _ = jax.lax.scan(lambda h, p: (block(h, p, positions), None), x, params["layers"]["blocks"])
    x = _rms_norm(x, params["final_norm"]["scale"], dt)
    logits = pin(jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32), "logits")
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  return loss


def train_step(cfg: Any, tx: optax.GradientTransformation, mesh, mode: str, opt_state_abstract):
  """jit of `((params, opt_state), batch) -> ((params, opt_state), loss)`, state donated,
  in/out shardings from `SPECS[mode]` (optimizer moments sharded like their params)."""
  named = lambda spec: NamedSharding(mesh, spec)
  params_sh = jax.tree.map(named, param_specs(mode), is_leaf=lambda x: isinstance(x, P))
  opt_sh = optax.tree_utils.tree_map_params(tx, lambda _, s: s, opt_state_abstract, params_sh,
                                            transform_non_params=lambda _: named(P()))
  batch_sh = {"inputs": named(SPECS[mode].get("batch", P())),
              "targets": named(SPECS[mode].get("batch", P()))}
  loss_of = loss_fn(cfg, mode)

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_of)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(step, in_shardings=((params_sh, opt_sh), batch_sh),
                 out_shardings=((params_sh, opt_sh), named(P())), donate_argnums=0)
