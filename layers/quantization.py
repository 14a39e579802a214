"""8-bit matmuls for training: int8 and fp8 dots, forward and backward, through qwix.

`model.quantization` (configs/schema.py) picks one of:

  none   the dot in the compute dtype (bf16 or f32), as before;
  int8   operands rounded to int8 with a scale per channel: per token for activations,
         per output channel for weights (each scale over the contracted dims only, so
         it factors out of the sum); the backward dots quantize the incoming gradient
         the same way; s8 x s8 -> s32 dots (TPU v5e/v6e int8 units, H100 IMMA);
  fp8    the same with float8: e4m3 for activations and weights (more mantissa), e5m2
         for gradients (more range), the Transformer Engine / torchao recipe;
  fp8_delayed  fp8 whose forward operands are scaled per tensor from an amax history
         (the largest |x| of the last `quantization_history` steps) instead of this
         step's own |x|: the scale is known before the tensor is read, so a fused kernel
         can quantize in one pass. Gradients keep current scaling (their amax is only
         known in the backward pass, where the history cannot be written).

Scaling is "current" (per step: the scale comes from the absolute max of the tensor in
this step) unless delayed. The library is qwix (`dot_general_qt`, `ragged_dot_qt`):
a custom VJP whose forward quantizes both operands and whose backward quantizes the
incoming gradient and reuses the forward's quantized residuals, so no f32 copy of an
activation is kept for the backward beyond what the compute-dtype path keeps. qwix is
called directly on the projection's operands rather than through its model
interception (`qwix.quantize_model`), so which matmuls are quantized is said here, by
the layer that owns the matmul, and nothing is rewritten behind the model's back.

Master weights stay in `param_dtype`; quantized copies exist only inside the step
(checkpoints and Hugging Face exports never hold them). The scales are computed inside
the step from the (sharded) operands, so they are split like the tensor they scale:
a per-channel scale of an FSDP-sharded weight is reduced over the contracted dims
(a max over a few KB), never gathered with the weight.

The amax history of `fp8_delayed` is an `AmaxHistory` param (so it is sharded,
checkpointed and restored with the model) that no gradient reaches: the dot's VJP
returns the *next* history as its cotangent (`record_amax`) and the train step writes
that over the param (`take_histories`, trainer/step.py), the Flax fp8 recipe's trick,
which reaches through scanned and rematerialized layers because gradients already do.
Where one step uses a weight more than once, autodiff would sum the uses' next
histories (a newest entry that is a sum of amaxes, growing step by step); the two
places that reuse weights combine them by max instead, so each history's new entry is
the largest amax over every use in the step: the pipeline loop, which runs a stage's
weights in every iteration (pipeline/statistics.py, by `AmaxHistory.combine_uses`;
bubble iterations excluded), and gradient accumulation (`accumulate`, over the
microbatches). Each scanned layer has its own history, as it has its own weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

# qwix's quantized-training dots, called directly (its public entry point is the model
# interception, see above); the modules are private, so pyproject pins qwix < 0.2.
from qwix._src.core import dot_general_qt as _qt
from qwix._src.core import ragged_dot_qt as _rqt

from shardax.configs.schema import QUANTIZATION_CHOICES as MODES  # one list of choices, in the schema

_FWD = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_delayed": jnp.float8_e4m3fn}
_BWD = {"int8": jnp.int8, "fp8": jnp.float8_e5m2, "fp8_delayed": jnp.float8_e5m2}


HISTORY = "amax_history"   # the attribute (and params key) of a layer's AmaxHistory


class AmaxHistory(nnx.Param):
  """[2, H] float32: row 0 the lhs (activation), row 1 the rhs (weight) per-tensor amax
  of the last H steps, newest first. Written by the train step, never by the optimizer."""
  combine_uses = "max"   # a reused history's uses: max of their next values (pipeline/statistics.py)


def check(mode: str) -> str:
  if mode not in MODES:
    raise ValueError(f"quantization={mode!r}: use one of {MODES}")
  return mode


@functools.lru_cache(None)
def _config(mode: str) -> _qt.DotGeneralQtConfig:
  """Forward: both operands in the 8-bit type, absmax over the contracted dims.
  Backward: the incoming gradient too; the residuals are the forward's quantized operands."""
  return _qt.DotGeneralQtConfig(
      lhs_qtype=_FWD[mode], rhs_qtype=_FWD[mode],
      dlhs_grad_qtype=_BWD[mode], drhs_grad_qtype=_BWD[mode],
      # Per-tensor scales for delayed scaling: one amax per operand and step.
      lhs_disable_channelwise_axes=mode == "fp8_delayed",
      rhs_disable_channelwise_axes=mode == "fp8_delayed")


def dot_general(mode: str, lhs: jax.Array, rhs: jax.Array, dimension_numbers, *,
                preferred_element_type=None, history: jax.Array | None = None) -> jax.Array:
  """`jax.lax.dot_general(lhs, rhs, ...)` with both operands (and, in the backward, the
  gradient) in `mode`'s 8-bit type; `mode='none'` is the plain dot. `history`: the
  AmaxHistory value of an `fp8_delayed` dot."""
  if mode == "none":
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
  config = _config(mode)
  if mode == "fp8_delayed":
    config = _delayed(config, history)
  out = _qt.dot_general_qt(lhs, rhs, dimension_numbers, config)
  return out.astype(preferred_element_type or lhs.dtype)


def einsum(mode: str, spec: str, lhs: jax.Array, rhs: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """`jnp.einsum(spec, lhs, rhs)` whose dot is `dot_general(mode, ...)` (current scaling):
  the expert matmuls of the capacity and tiled MoE paths."""
  if mode == "none":
    return jnp.einsum(spec, lhs, rhs, preferred_element_type=preferred_element_type)
  current = "fp8" if mode == "fp8_delayed" else mode  # experts keep no history per expert

  def dot(a, b, dimension_numbers, precision=None, preferred_element_type=None, **_):
    return dot_general(current, a, b, dimension_numbers, preferred_element_type=preferred_element_type)
  out = jnp.einsum(spec, lhs, rhs, _dot_general=dot)
  return out.astype(preferred_element_type or lhs.dtype)


def ragged_dot(mode: str, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`jax.lax.ragged_dot` (the dropless expert matmul) with 8-bit operands and gradients."""
  if mode == "none":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
  current = "fp8" if mode == "fp8_delayed" else mode
  config = _rqt.RaggedDotQtConfig(lhs_qtype=_FWD[current], rhs_qtype=_FWD[current],
                                  dlhs_grad_qtype=_BWD[current], drhs_grad_qtype=_BWD[current])
  return _rqt.ragged_dot_qt(lhs, rhs, group_sizes, config).astype(lhs.dtype)


# ---- delayed scaling ---------------------------------------------------------------------

def history_init(length: int) -> jax.Array:
  """An empty history: zeros mean 'not seen yet' (the first step scales by its own amax)."""
  return jnp.zeros((2, length), jnp.float32)


def _delayed(config: _qt.DotGeneralQtConfig, history: jax.Array | None) -> _qt.DotGeneralQtConfig:
  if history is None:
    raise ValueError("quantization='fp8_delayed' needs the layer's AmaxHistory")
  return dataclasses.replace(config, lhs_collect_quant_stat=functools.partial(_from_history, history, 0),
                             rhs_collect_quant_stat=functools.partial(_from_history, history, 1))


def _from_history(history: jax.Array, row: int, calibration: dict) -> dict:
  """The scale's amax: the history's max (this step's own amax while the history is empty).
  Values beyond it saturate at the format's max, as in Transformer Engine."""
  now = jax.lax.stop_gradient(calibration["absmax"])
  past = jnp.max(jax.lax.stop_gradient(history[row]))
  return {"absmax": jnp.where(past > 0, past, now).astype(now.dtype) * jnp.ones_like(now)}


def record_amax(y: jax.Array, history: jax.Array, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """`y` unchanged; in the backward, `history`'s cotangent is the next history (this
  step's per-tensor amax of lhs and rhs pushed in front, the oldest dropped), which the
  train step writes over the param. Tapped on the dot's output, whose cotangent is never
  a symbolic zero, so jax cannot prune the backward that carries the new history."""
  now = jax.lax.stop_gradient(jnp.stack([jnp.max(jnp.abs(lhs)), jnp.max(jnp.abs(rhs))]).astype(jnp.float32))
  return _tap(y, history, now)


@jax.custom_vjp
def _tap(y, history, now):
  return y


def _tap_fwd(y, history, now):
  return y, (history, now)


def _tap_bwd(res, g):
  history, now = res
  return g, jnp.concatenate([now[:, None], history[:, :-1]], axis=1), jnp.zeros_like(now)


_tap.defvjp(_tap_fwd, _tap_bwd)


def is_history(path) -> bool:
  """Whether a `jax.tree_util` key path ends at an AmaxHistory leaf of a params dict."""
  return bool(path) and getattr(path[-1], "key", None) == HISTORY


def accumulate(total, grads):
  """Gradient accumulation's running sum of `grads`, except each history's next value,
  which is the max over the microbatches (the largest amax any of them saw)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, a, b: jnp.maximum(a, b) if is_history(p) else a + b, total, grads)


def mean_grads(total, count: int):
  """`accumulate`'s result over `count` microbatches as their mean; histories as they are."""
  return jax.tree_util.tree_map_with_path(lambda p, g: g if is_history(p) else g / count, total)


def take_histories(grads: dict) -> tuple[dict, dict]:
  """(grads with every AmaxHistory's cotangent zeroed, {path: next history}): the step
  writes the second over the params and lets the optimizer see only the first."""
  written = {}
  def walk(tree, out):
    new = {}
    for k, v in tree.items():
      if isinstance(v, dict):
        sub = {}
        new[k] = walk(v, sub)
        if sub:
          out[k] = sub
      elif k == HISTORY:
        out[k] = v
        new[k] = jnp.zeros_like(v)
      else:
        new[k] = v
    return new
  return walk(grads, written), written
