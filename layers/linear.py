"""An einsum projection between named multi-dimensional feature shapes.

Attention projects `embed -> (heads, kv)` and back `(heads, kv) -> embed`; keeping
the heads dim separate in the kernel (instead of a flat `heads*kv` matrix) lets the
sharding rules split heads on a mesh axis by name. The kernel is one parameter of
shape `in_features + out_features` whose dims carry the logical names
`in_axes + out_axes`; the layer contracts the trailing `len(in_features)` dims of x.

No bias by default: modern LMs drop it. `use_bias=True` adds one over the output dims
(logical names `out_axes`), for checkpoints that have them (Qwen2's q/k/v, Llama's
attention_bias / mlp_bias).

`quantization` ('none', 'int8', 'fp8', 'fp8_delayed'; layers/quantization.py) runs the
contraction as an 8-bit dot, forward and backward; the kernel stays in `param_dtype`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.layers import quantization as quant

Axes = tuple[str | None, ...]


def fan_in_init(in_dims: int, scale: float = 1.0) -> nnx.Initializer:
  """Truncated normal with variance `scale / fan_in` (LeCun), fan_in over all input dims.

  jax's variance_scaling needs in_axis/out_axis told to it for a >2-D kernel, else
  it takes only the second-to-last dim as fan-in (e.g. `kv`, not `heads*kv`).
  """
  def init(key, shape, dtype=jnp.float32):
    fan_in = math.prod(shape[:in_dims])
    std = math.sqrt(scale / fan_in) / 0.87962566103423978  # truncation correction
    return (jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * std).astype(dtype)
  return init


class DenseGeneral(nnx.Module):
  """y[..., out] = sum_in x[..., in] * kernel[in, out] over several in/out dims.

  Args:
    in_features: sizes of the trailing dims of x that are contracted.
    out_features: sizes of the new trailing dims of y.
    in_axes, out_axes: one logical name (or None) per in/out dim, stored as the
      kernel's `logical_axes` metadata for the sharding rules.
    dtype: compute dtype (the kernel is cast to it on use).
    param_dtype: storage dtype of the kernel.
    kernel_init: defaults to fan-in scaled truncated normal (LeCun).
    quantization: the dot's 8-bit mode (layers/quantization.py); 'none' = compute dtype.
    quantization_history: steps of amax history kept for 'fp8_delayed'.
  """

  def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
               in_axes: Sequence[str | None], out_axes: Sequence[str | None],
               dtype=jnp.float32, param_dtype=jnp.float32,
               kernel_init: nnx.Initializer | None = None, use_bias: bool = False,
               quantization: str = "none", quantization_history: int = 16, rngs: nnx.Rngs):
    self.in_features = _as_tuple(in_features)
    self.out_features = _as_tuple(out_features)
    in_axes, out_axes = tuple(in_axes), tuple(out_axes)
    if len(in_axes) != len(self.in_features) or len(out_axes) != len(self.out_features):
      raise ValueError(f"DenseGeneral: axes {in_axes}->{out_axes} do not match shapes "
                       f"{self.in_features}->{self.out_features}")
    self.dtype = dtype
    init = kernel_init or fan_in_init(len(self.in_features))
    shape = self.in_features + self.out_features
    self.kernel = nnx.Param(init(rngs.params(), shape, param_dtype),
                            logical_axes=in_axes + out_axes)
    self.bias = nnx.Param(jnp.zeros(self.out_features, param_dtype), logical_axes=out_axes) if use_bias else None
    self.quantization = quant.check(quantization)
    if quantization == "fp8_delayed":
      setattr(self, quant.HISTORY, quant.AmaxHistory(quant.history_init(quantization_history),
                                                    logical_axes=(None, None)))

  def __call__(self, x: jax.Array, *, out_dtype=None) -> jax.Array:
    """Contracts x's trailing in-dims; `out_dtype` (e.g. float32 for logits) sets the
    accumulation/result type without upcasting the operands."""
    n_in = len(self.in_features)
    if x.shape[x.ndim - n_in:] != self.in_features:
      raise ValueError(f"DenseGeneral expects trailing dims {self.in_features}, got x {x.shape}")
    kernel = self.kernel[...].astype(self.dtype)
    x = x.astype(self.dtype)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    dnums = (contract, ((), ()))
    history = getattr(self, quant.HISTORY)[...] if self.quantization == "fp8_delayed" else None
    y = quant.dot_general(self.quantization, x, kernel, dnums, preferred_element_type=out_dtype or self.dtype,
                          history=history)
    if history is not None:
      y = quant.record_amax(y, history, x, kernel)
    return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def _as_tuple(v: int | Sequence[int]) -> tuple[int, ...]:
  return (v,) if isinstance(v, int) else tuple(v)
