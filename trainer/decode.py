"""Sampling text from a trained language model.

The model has no KV cache yet, so each new token reruns the model over a fixed
window of `max_len` tokens (one compiled shape, then cheap calls). That is
quadratic in the window, fine for the small models one samples on a laptop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardax.configs.schema import Experiment
from shardax.trainer.data import tokenizers
from shardax.trainer import state as state_lib


def sample(setup: state_lib.Setup, params, prompt_ids: np.ndarray, max_new_tokens: int,
           temperature: float = 0.0, seed: int = 0) -> np.ndarray:
  """Continue `prompt_ids`; greedy when temperature is 0. Returns the new ids only."""
  window = setup.exp.model.max_len

  @jax.jit
  def next_token(params, tokens, last, key):
    logits = setup.model(params)(tokens)[0, last]
    if temperature <= 0:
      return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

  ids = list(int(i) for i in prompt_ids) or [tokenizers.SEPARATOR_ID]
  key = jax.random.key(seed)
  out = []
  for _ in range(max_new_tokens):
    ctx = ids[-window:]
    buf = np.zeros((1, window), np.int32)
    buf[0, :len(ctx)] = ctx
    key, sub = jax.random.split(key)
    tok = int(next_token(params, buf, len(ctx) - 1, sub))
    ids.append(tok)
    out.append(tok)
  return np.asarray(out, np.int32)


def from_job_dir(exp: Experiment, job_dir: str, prompt: str, max_new_tokens: int,
                 temperature: float) -> str:
  """Prompt plus sampled continuation, from the latest checkpoint in `job_dir`."""
  from shardax.trainer import loop
  setup, state = loop.restore_latest(exp, job_dir)
  # No sharding rules here: one sequence does not split over a data axis, and the
  # compiler gathers what it needs from the sharded params.
  tok = tokenizers.load(exp.data)  # documents start with eos in training (packing.py)
  with jax.set_mesh(setup.mesh):
    new = sample(setup, state["params"], [tok.eos_id] + tok.encode(prompt), max_new_tokens,
                 temperature, seed=exp.train.seed)
  return prompt + tok.decode(new)
