"""Grouped-query attention by einsums: the one definition of its logits and of a masked softmax's
output, shared by every path that computes attention without a kernel (layers/attention.py's
XLA and decode paths, layers/context_parallel.py's per-block compute).

Shapes: q[b, l, n, d] holds n query heads in kv groups of g = n // kv; k[b, s, kv, d],
v[b, s, kv, dv] (dv may differ from d: MLA). K and V are never repeated to the query heads'
count: the grouped einsum reads each key head once for its g query heads. Logits are float32
whatever the inputs' dtype, so the softmax and its running statistics keep full precision.

A leaf below attention.py and context_parallel.py (attention.py imports context_parallel), so
both can import it without a cycle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_logits(q: jax.Array, k: jax.Array, softcap: float | None = None) -> jax.Array:
  """float32 logits[b, kv, g, l, s] = q . k / sqrt(d), then cap * tanh(logits / cap) when
  `softcap` is set (after the scale, as Gemma 2 defines it)."""
  b, l, n, d = q.shape
  kv = k.shape[2]
  qg = q.reshape(b, l, kv, n // kv, d)
  logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(d ** -0.5)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  return logits


def masked_output(logits: jax.Array, visible: jax.Array, v: jax.Array,
                  sinks: jax.Array | None = None) -> jax.Array:
  """out[b, l, n, dv]: the softmax of `logits`[b, kv, g, l, s] over the keys `visible`
  (broadcast against the logits) applied to v[b, s, kv, dv]. A row that sees no key gets the
  mean of v (uniform weights), never NaN; every causal row sees at least itself.
  `sinks` [n] (gpt-oss's attention sinks): query head h's softmax has exp(sinks[h]) more in its
  denominator, a key of no value: p_ij = exp(l_ij) / (sum_j' exp(l_ij') + exp(sinks[h]))."""
  b, kv, g, l, _ = logits.shape
  logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
  if sinks is None:
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  else:
    sink = sinks.astype(jnp.float32).reshape(1, kv, g, 1, 1)
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink))
    e = jnp.exp(logits - top)
    probs = (e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(v.dtype)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
  return out.reshape(b, l, kv * g, v.shape[-1])
