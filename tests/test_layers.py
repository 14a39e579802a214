"""Single-device semantics of shardax.layers (no mesh: `shard` is a no-op here).

Speed: most tests build the model abstractly (nnx.eval_shape) and fill the params
from numpy, because compiling the random initializers costs ~3 s on CPU; one test
(bfloat16) goes through the real jitted init.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax.configs.schema import TransformerConfig
from shardax.layers import (REMAT_POLICIES, Attention, TransformerLM, apply_rope, fused_attention,
                            xla_attention)

TINY = TransformerConfig(vocab_size=256, num_layers=2, d_model=32, num_heads=4, d_ff=64,
                         max_len=32)
B, L = 2, 12


def tiny(**kw) -> TransformerConfig:
  return dataclasses.replace(TINY, **kw)


def random_state(module_fn, seed=0):
  """(graphdef, state) of `module_fn()` with numpy-random params, without compiling init."""
  graphdef, state = nnx.split(nnx.eval_shape(module_fn))
  rng = np.random.default_rng(seed)

  def fill(path, v):
    noise = rng.normal(size=v.shape).astype(np.float32)
    base = 1.0 if path[-1] == "scale" else 0.0
    return jnp.asarray(base + 0.2 * noise, v.dtype)

  pure = nnx.to_pure_dict(state)
  pure = jax.tree_util.tree_map_with_path(
      lambda p, v: fill(tuple(getattr(k, "key", k) for k in p), v), pure)
  nnx.replace_by_pure_dict(state, pure)
  return graphdef, state


def lm_state(cfg, seed=0):
  return random_state(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)), seed)


def lm_forward(graphdef):
  return jax.jit(lambda state, tokens, positions=None: nnx.merge(graphdef, state)(tokens, positions))


def tokens(seed=0, batch=B, length=L, vocab=TINY.vocab_size):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


# ---------------------------------------------------------------- parameters

@pytest.mark.parametrize("scan", [True, False])
def test_every_param_has_logical_axes_matching_rank(scan):
  cfg = tiny(scan_layers=scan, tied_embedding=False, norm="layer")
  model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
  params = list(nnx.to_flat_state(nnx.state(model)))
  assert all(type(var) is nnx.Param for _, var in params)  # no rng or other state left behind
  assert len(params) > 10
  for path, var in params:
    axes = var.get_metadata().get("logical_axes")
    assert isinstance(axes, tuple) and len(axes) == var.ndim, (path, axes, var.shape)
    stacked = scan and path[0] == "layers"
    assert (axes[0] == "layers") == stacked, (path, axes)
    if stacked:
      assert var.shape[0] == cfg.num_layers
  names = {path: var.logical_axes for path, var in params}
  assert names[("embed", "embedding")] == ("vocab", "embed")
  assert names[("head", "kernel")] == ("embed", "vocab")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_param_shapes_and_runs(kv_heads):
  cfg = tiny(num_kv_heads=kv_heads, num_layers=1)
  graphdef, state = lm_state(cfg)
  attn = nnx.to_pure_dict(state)["layers"]["blocks"]["attn"]
  hd = cfg.dim_per_head
  assert attn["query"]["kernel"].shape == (1, 32, 4, hd)
  assert attn["key"]["kernel"].shape == (1, 32, kv_heads, hd)
  assert attn["value"]["kernel"].shape == (1, 32, kv_heads, hd)
  assert attn["out"]["kernel"].shape == (1, 4, hd, 32)
  logits = lm_forward(graphdef)(state, tokens())
  assert logits.shape == (B, L, cfg.vocab_size) and bool(jnp.isfinite(logits).all())


def test_bfloat16_params_are_stored_in_bfloat16():
  model = nnx.eval_shape(lambda: TransformerLM(tiny(param_dtype="bfloat16"), rngs=nnx.Rngs(0)))
  assert {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("bfloat16")}


# ---------------------------------------------------------------- attention

def reference_attention(x, wq, wk, wv, wo, positions, theta):
  """numpy float64: RoPE via complex rotation, k/v heads repeated for GQA, causal softmax."""
  x, wq, wk, wv, wo = (np.asarray(a, np.float64) for a in (x, wq, wk, wv, wo))
  q, k, v = (np.einsum("bld,dhe->blhe", x, w) for w in (wq, wk, wv))
  d = q.shape[-1]
  freq = theta ** (-np.arange(d // 2) * 2.0 / d)
  rot = np.exp(1j * np.asarray(positions, np.float64)[:, :, None, None] * freq)

  def rope(t):
    z = (t[..., : d // 2] + 1j * t[..., d // 2:]) * rot
    return np.concatenate([z.real, z.imag], axis=-1)

  q, k = rope(q), rope(k)
  groups = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  s = np.einsum("bqhe,bshe->bhqs", q, k) / np.sqrt(d)
  length = x.shape[1]
  s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("bhqs,bshe->bqhe", p, v)
  return np.einsum("bqhe,hed->bqd", o, wo)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_matches_numpy_reference(kv_heads):
  graphdef, state = random_state(
      lambda: Attention(32, 4, kv_heads, 8, rope_theta=100.0, rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(B, L, 32)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(L) + 3, (B, L))
  got = jax.jit(lambda s, x, p: nnx.merge(graphdef, s)(x, p))(state, x, positions)
  w = nnx.to_pure_dict(state)
  want = reference_attention(x, w["query"]["kernel"], w["key"]["kernel"],
                             w["value"]["kernel"], w["out"]["kernel"], positions, 100.0)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_fused_attention_equals_xla(kv_heads):
  rng = np.random.default_rng(kv_heads)
  q = jnp.asarray(rng.normal(size=(B, L, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, L, kv_heads, 8)), jnp.float32) for _ in range(2))
  both = jax.jit(lambda q, k, v: (xla_attention(q, k, v), fused_attention(q, k, v)))
  xla_out, fused_out = both(q, k, v)
  np.testing.assert_allclose(xla_out, fused_out, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, L, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, L, 2, 16)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(L), (B, L))

  @jax.jit
  def scores(shift):
    qr, kr = apply_rope(q, pos + shift), apply_rope(k, pos + shift)
    return jnp.einsum("bqhd,bkhd->bhqk", qr, kr)

  base = scores(0)
  np.testing.assert_allclose(scores(37), base, rtol=1e-4, atol=1e-4)
  # ...and the rotation is not the identity: unrotated scores differ.
  assert not np.allclose(jnp.einsum("bqhd,bkhd->bhqk", q, k), base, atol=1e-2)


# ---------------------------------------------------------------- the LM

def test_causal_and_position_shift_invariance():
  cfg = tiny(norm="layer")
  graphdef, state = lm_state(cfg)
  fwd = lm_forward(graphdef)
  toks = tokens()
  t = 5
  changed = toks.at[:, t].set((toks[:, t] + 1) % cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  base, other, shifted = (fwd(state, a, p) for a, p in
                          ((toks, pos), (changed, pos), (toks, pos + 11)))
  assert base.dtype == jnp.float32 and base.shape == (B, L, cfg.vocab_size)
  np.testing.assert_array_equal(base[:, :t], other[:, :t])
  assert not np.allclose(base[:, t:], other[:, t:], atol=1e-3)
  # RoPE is the only position signal, so a global position shift changes nothing.
  np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4)
  # Default positions are arange.
  np.testing.assert_allclose(fwd(state, toks), base, rtol=1e-6, atol=1e-6)


def stacked_to_list(stacked_pure: dict, num_layers: int) -> dict:
  """Pure dict of a scan_layers model -> the same weights for the list form."""
  out = dict(stacked_pure)
  blocks = stacked_pure["layers"]["blocks"]
  out["layers"] = {"blocks": {i: jax.tree.map(lambda a: a[i], blocks) for i in range(num_layers)}}
  return out


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scan_equals_list_with_gradients(remat):
  cfg = tiny(remat=remat, tied_embedding=False, num_kv_heads=2)
  g_scan, s_scan = lm_state(cfg)
  g_list, s_list = nnx.split(nnx.eval_shape(
      lambda: TransformerLM(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(s_list, stacked_to_list(nnx.to_pure_dict(s_scan), cfg.num_layers))
  toks = tokens()

  def loss_and_grad(graphdef):
    def loss(state):
      logits = nnx.merge(graphdef, state)(toks)
      return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.jit(jax.value_and_grad(loss))

  loss_s, grad_s = loss_and_grad(g_scan)(s_scan)
  loss_l, grad_l = loss_and_grad(g_list)(s_list)
  np.testing.assert_allclose(loss_s, loss_l, rtol=1e-5)
  want = nnx.to_pure_dict(grad_s)
  got = stacked_to_list(want, cfg.num_layers)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               got, nnx.to_pure_dict(grad_l))


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch", "moe_matmuls", "moe_returned"])
def test_remat_policy_wraps_each_block(remat, scan):
  """The named jax.checkpoint policy appears in the traced program (tracing only)."""
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: TransformerLM(tiny(remat=remat, scan_layers=scan), rngs=nnx.Rngs(0))))
  jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens()))(state))
  policies = re.findall(r"policy=(.*)", jaxpr)
  if remat == "none":
    assert not policies
  else:
    policy = REMAT_POLICIES[remat]
    assert len(policies) == (1 if scan else TINY.num_layers)
    assert all(getattr(policy, "__name__", repr(policy)) in p for p in policies)


def test_bfloat16_compute_close_to_float32():
  cfg32 = tiny(num_kv_heads=2)
  init = nnx.jit(lambda: TransformerLM(cfg32, rngs=nnx.Rngs(0)))
  _, state = nnx.split(init())
  g32 = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg32, rngs=nnx.Rngs(0))))
  g16 = nnx.graphdef(nnx.eval_shape(
      lambda: TransformerLM(dataclasses.replace(cfg32, dtype="bfloat16"), rngs=nnx.Rngs(0))))
  toks = tokens()
  both = jax.jit(lambda s: (nnx.merge(g32, s)(toks), nnx.merge(g16, s)(toks)))
  l32, l16 = both(state)
  assert l16.dtype == jnp.float32 and l32.dtype == jnp.float32
  assert float(jnp.std(l32)) > 0.1  # the real init gives non-degenerate logits
  err = float(jnp.max(jnp.abs(l16 - l32)))
  assert err < 0.02 * float(jnp.max(jnp.abs(l32))) + 0.05, err  # seen: 0.034 of max 6.2
  assert err > 1e-3, err  # bfloat16 rounding really happened (float32 twice would give 0)
  # ... in the matmuls: every projection (q, k, v, out, gate, up, down) and both attention
  # einsums of the (scanned, so written once) layer take bfloat16 operands in the bf16
  # model, none in the f32 one.
  dots = lambda g: dot_operand_dtypes(jax.make_jaxpr(lambda s: nnx.merge(g, s)(toks))(state).jaxpr)
  bf16 = (jnp.dtype("bfloat16"),) * 2
  assert cfg32.scan_layers and sum(d == bf16 for d in dots(g16)) >= 9, dots(g16)
  assert not any(jnp.dtype("bfloat16") in d for d in dots(g32)), dots(g32)


def dot_operand_dtypes(jaxpr) -> list[tuple]:
  """Operand dtypes of every dot_general in `jaxpr`, nested jaxprs (scan, remat, jit) included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(tuple(v.aval.dtype for v in eqn.invars))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out += dot_operand_dtypes(sub)
  return out
