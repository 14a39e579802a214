"""Framework overhead: the shardax train step vs a minimal hand-written jax + optax step.

    JAX_PLATFORMS=cpu python benchmarks/overhead.py                 # reduced lm.small
    JAX_PLATFORMS=cpu python benchmarks/overhead.py --set model.attention='fused'

Both steps train the same model on one device: the shardax step is
`trainer.step.train_step_fn` (the one `--mode=train` runs); the minimal step is a
pure-jax reimplementation of TransformerLM's forward (embed, pre-norm blocks with
RoPE grouped-query attention and a gated MLP under `lax.scan`, tied head) over the
same param tree, with the same optax chain (clip + AdamW + schedule), batch, dtype,
remat policy and buffer donation, and nothing else: `value_and_grad`, `tx.update`,
`apply_updates`. What shardax adds is the grad-norm / learning-rate metrics, the
in-graph non-finite guard, sharding annotations (no-ops on one device) and the nnx
module structure (gone after tracing).

Both start from the same state and see the same batches, so their losses must agree
step for step: the script checks that before it reports a ratio. The two then
alternate, `--steps` steps each per round for `--rounds` rounds, every step timed to
`block_until_ready`; the ratio is shardax median / minimal median step time, also
given as the median of per-pair ratios (each shardax step against the minimal step
right after it, which sees the same machine load: the robust figure on a shared
machine) and as the ratio of the best steps. On a CPU shared with other jobs the wall
clock swings by tens of percent; the CPU seconds the process spent per step (all its
threads, `time.process_time`) swing far less, and their ratio is printed too.

The default model is lm.small reduced to fit a small CPU (see REDUCED): lm.small's
width (d_model 768, 12 heads, d_ff 3072, vocab 256), but 2 layers, seq_len 128 and a
batch of 8. `--set` overrides apply on top (`--set model.num_layers=12` etc.).
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardax import configs  # noqa: E402
from shardax.sharding import make_mesh, use_rules  # noqa: E402
from shardax.trainer.data import inputs  # noqa: E402
from shardax.trainer import state as state_lib  # noqa: E402
from shardax.trainer import step as step_lib  # noqa: E402

REDUCED = ["model.num_layers=2", "data.seq_len=128", "model.max_len=128", "train.global_batch=8",
           "data.source='synthetic'"]
POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.checkpoint_dots,
            "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def rms_norm(x, scale, dtype):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(dtype)


def rope(x, theta):
  d = x.shape[-1]
  inv = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv          # [l, d/2]
  sin, cos = jnp.sin(ang)[:, None, :], jnp.cos(ang)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def attention(q, k, v, fused):
  if fused:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  b, l, n, d = q.shape
  kv = k.shape[2]
  qg = q.reshape(b, l, kv, n // kv, d)
  s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
  s = jnp.where(jnp.tril(jnp.ones((l, l), bool)), s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(b, l, n, d)


def make_loss(cfg):
  """(params, batch) -> mean next-token cross entropy, the TransformerLM forward by hand."""
  dt = jnp.dtype(cfg.dtype)
  fused = cfg.attention == "fused"
  c = lambda w: w.astype(dt)

  def block(x, p):
    h = rms_norm(x, p["attn_norm"]["scale"], dt)
    a = p["attn"]
    q = rope(jnp.einsum("bld,dhk->blhk", h, c(a["query"]["kernel"])), cfg.rope_theta)
    k = rope(jnp.einsum("bld,dhk->blhk", h, c(a["key"]["kernel"])), cfg.rope_theta)
    v = jnp.einsum("bld,dhk->blhk", h, c(a["value"]["kernel"]))
    x = x + jnp.einsum("blhk,hkd->bld", attention(q, k, v, fused), c(a["out"]["kernel"]))
    h = rms_norm(x, p["mlp_norm"]["scale"], dt)
    m = p["mlp"]
    g = jax.nn.silu(h @ c(m["gate"]["kernel"])) * (h @ c(m["up"]["kernel"]))
    return x + g @ c(m["down"]["kernel"]), None

  if cfg.remat != "none":
    block = jax.checkpoint(block, policy=POLICIES[cfg.remat], prevent_cse=False)

  def loss(params, batch):
    table = c(params["embed"]["embedding"])
    x = table[batch["inputs"]] * jnp.asarray(math.sqrt(cfg.d_model), dt)
    x, _ = jax.lax.scan(block, x, params["layers"]["blocks"])
    x = rms_norm(x, params["final_norm"]["scale"], dt)
    logits = jnp.einsum("bld,vd->blv", x, table, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  return loss


def minimal_step(cfg, tx):
  loss_fn = make_loss(cfg)

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss
  return jax.jit(step, donate_argnums=0)


def timed(fn, state, batch):
  """(state, out, wall seconds, CPU seconds of this process's threads)."""
  t0, c0 = time.perf_counter(), time.process_time()
  state, out = fn(state, batch)
  jax.block_until_ready((state, out))
  return state, out, time.perf_counter() - t0, time.process_time() - c0


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--exp", default="lm.small")
  ap.add_argument("--set", action="append", default=[], help="extra config override PATH=VALUE")
  ap.add_argument("--full", action="store_true", help="do not apply the REDUCED overrides")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=3, help="steps of each step function per round")
  args = ap.parse_args()

  cfg = configs.get(args.exp)
  configs.apply_overrides(cfg, ([] if args.full else REDUCED) + args.set)
  exp = configs.build(cfg)
  if not (exp.model.scan_layers and exp.train.microbatches == 1 and exp.model.norm == "rms"
          and exp.model.tied_embedding and exp.model.activation == "silu"):
    raise SystemExit("the hand-written step covers scanned, tied, rms/silu models without microbatches")
  mesh = make_mesh(exp.mesh, jax.devices()[:1])
  setup = state_lib.create(exp, mesh)
  with jax.set_mesh(mesh), use_rules(setup.rules, False):
    ours = step_lib.train_step_fn(setup)
    state = state_lib.init_fn(setup)(jax.random.key(0))
    data = inputs.Batches(exp.data, "train", exp.train.global_batch, setup.batch_sharding,
                          seed=0, vocab_size=exp.model.vocab_size)
    ring = [next(data) for _ in range(4)]
    theirs = minimal_step(exp.model, setup.tx)
    copy = lambda t: jax.tree.map(jnp.copy, t)
    a_state = copy(state)
    b_state = (copy(state["params"]), copy(state["opt_state"]))
    times = {"shardax": [], "minimal": []}
    cpu = {"shardax": [], "minimal": []}
    losses = {"shardax": [], "minimal": []}
    i = 0
    for r in range(args.rounds + 1):       # round 0 compiles and warms up, untimed
      for _ in range(args.steps):
        batch = ring[i % len(ring)]
        a_state, metrics, ta, ca = timed(ours, a_state, batch)
        b_state, loss, tb, cb = timed(theirs, b_state, batch)
        losses["shardax"].append(float(metrics["loss"]))
        losses["minimal"].append(float(loss))
        if r:
          times["shardax"].append(ta)
          times["minimal"].append(tb)
          cpu["shardax"].append(ca)
          cpu["minimal"].append(cb)
        i += 1
  diff = np.max(np.abs(np.subtract(losses["shardax"], losses["minimal"])))
  print(f"model: {exp.name} {'' if args.full else '(reduced) '}{state_lib.count_params(setup):,} params, "
        f"layers {exp.model.num_layers}, d_model {exp.model.d_model}, seq {exp.data.seq_len}, "
        f"batch {exp.train.global_batch}, dtype {exp.model.dtype}, attention {exp.model.attention}, "
        f"remat {exp.model.remat}; device {jax.devices()[0].device_kind}")
  print(f"losses agree over {i} steps: max |diff| {diff:.2e} "
        f"(first {losses['shardax'][0]:.4f}, last {losses['shardax'][-1]:.4f})")
  if not diff < 1e-3 * max(1.0, abs(losses["minimal"][0])):
    raise SystemExit("the two steps compute different losses: not the same model; no ratio")
  med = {k: float(np.median(v)) for k, v in times.items()}
  for k, v in times.items():
    print(f"{k:<8} step time median {med[k]:.4f} s  p10 {np.percentile(v, 10):.4f}  "
          f"p90 {np.percentile(v, 90):.4f}  ({len(v)} steps)")
  paired = np.divide(times["shardax"], times["minimal"])
  print(f"ratio shardax / minimal = {med['shardax'] / med['minimal']:.3f} (medians); "
        f"{np.median(paired):.3f} (median of back-to-back pairs); "
        f"{min(times['shardax']) / min(times['minimal']):.3f} (best steps)")
  cmed = {k: float(np.median(v)) for k, v in cpu.items()}
  print(f"CPU seconds per step (all threads of this process): shardax {cmed['shardax']:.3f}, "
        f"minimal {cmed['minimal']:.3f}; ratio {cmed['shardax'] / cmed['minimal']:.3f}")


if __name__ == "__main__":
  main()
