"""How attention is computed, as a plain record the config hands to the attention layer.

`TransformerConfig.attention_options()` returns one. It lives in configs/ because the
schema must not import layers/ (configs sit below layers: layers read configs, never the
reverse). layers/attention.py uses this class (and re-exports it).

`LayerKind` is one entry of `TransformerConfig.layer_pattern`: how one layer attends
(its mask, whether and how it rotates q/k, its query temperature), so models that
alternate local and global layers (Gemma 3, gpt-oss) or chunked-RoPE and NoPE layers
(Llama 4) are one decoder with a per-layer kind (docs/attention.md).
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs.errors import require


IMPLEMENTATIONS = ("xla", "fused", "flash", "auto")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """How attention is computed (static; hashable, so a jit cache key). `implementation`:
    'xla'    einsums (layers/attention.py `xla_attention`);
    'fused'  jax.nn.dot_product_attention (cuDNN flash attention on a GPU);
    'flash'  the Pallas splash kernel (layers/flash.py; TPU, or interpret mode elsewhere);
    'auto'   per target platform: 'flash' on a TPU when the lengths suit the kernel,
             'fused' on a GPU, else 'xla'.
  window: sliding-window attention (query i sees keys i - window < j <= i); None = all.
  chunk: chunked local attention (query i sees keys j <= i with j // chunk == i // chunk:
    Llama 4's `attention_chunk_size`); None = off. Not together with `window`.
  softcap: logits -> softcap * tanh(logits / softcap); None = off.
  sinks: the layer has attention sinks (gpt-oss: a learned logit per query head in the softmax's
    denominator; the values are the layer's `sinks` param, passed beside q/k/v). The splash kernel
    and jax.nn.dot_product_attention take none: 'auto' then resolves to 'xla', and 'flash' /
    'fused' are refused by name.
  flash_block_q / flash_block_kv: the kernel's tile sizes; interpret: run Pallas in
  interpret mode (tests on a CPU)."""
  implementation: str = "xla"
  window: int | None = None
  softcap: float | None = None
  chunk: int | None = None
  sinks: bool = False
  flash_block_q: int = 512
  flash_block_kv: int = 512
  interpret: bool = False

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"attention={self.implementation!r}: use one of {IMPLEMENTATIONS}")
    if self.window is not None and self.chunk is not None:
      raise ValueError(f"attention window={self.window} and chunk={self.chunk} are both set; "
                       f"a layer attends within a sliding window or within its chunk, not both")


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """How one layer attends; `TransformerConfig.layer_pattern` holds one per layer of a
  repeating pattern (static: each kind compiles its own mask).
    window: sliding window (keys i - window < j <= i, Gemma 3 local / gpt-oss sliding
      layers); None = every earlier key.
    chunk: chunked local attention (keys j <= i in i's chunk of `chunk` tokens: Llama 4's
      RoPE layers); None = off. Not with `window`.
    rope: rotate q and k (RoPE); False = NoPE (Llama 4's every 4th layer).
    rope_theta: this kind's RoPE base (Gemma 3: 10k local, 1M global); None = the model's.
    rope_scaled: this kind's RoPE applies model.rope_scaling; False = plain RoPE (Gemma 3's
      local layers, whose global layers alone are linearly scaled).
    temperature_tuning: scale q by log(floor((pos + 1) / floor_scale) + 1) * scale + 1
      (Llama 4's NoPE layers, arXiv 2501.19399; the two constants are model fields).
  On the command line a kind is a dict: --set model.layer_pattern='({"window": 512}, {})'."""
  window: int | None = None
  chunk: int | None = None
  rope: bool = True
  rope_theta: float | None = None
  temperature_tuning: bool = False
  rope_scaled: bool = True

  def __post_init__(self):
    where = f"model.layer_pattern kind {self}"
    require(self.window is None or (isinstance(self.window, int) and self.window >= 1),
            f"{where}: window={self.window!r} must be an int >= 1 (or None: no window)")
    require(self.chunk is None or (isinstance(self.chunk, int) and self.chunk >= 1),
            f"{where}: chunk={self.chunk!r} must be an int >= 1 (or None: no chunking)")
    require(self.window is None or self.chunk is None,
            f"{where}: window and chunk are both set; a layer attends within a sliding window "
            f"or within its chunk: give one of them (or two kinds)")
    require(self.rope_theta is None or self.rope_theta > 0,
            f"{where}: rope_theta={self.rope_theta!r} must be > 0 (or None: model.rope_theta)")
    require(self.rope or self.rope_theta is None,
            f"{where}: rope=False (NoPE) with rope_theta={self.rope_theta}; a layer without RoPE "
            f"has no base: drop rope_theta or set rope=True")
    require(not (self.rope and self.temperature_tuning),
            f"{where}: temperature_tuning=True on a RoPE layer; the temperature tuning is for "
            f"layers without RoPE (Llama 4's NoPE layers): set rope=False or temperature_tuning=False")


def layer_kind(value) -> LayerKind:
  """A `LayerKind` from one itself or from a dict of its fields (the command line's form);
  anything else is a ConfigError naming the fields."""
  if isinstance(value, LayerKind):
    return value
  fields = [f.name for f in dataclasses.fields(LayerKind)]
  require(isinstance(value, dict) and set(value) <= set(fields),
          f"model.layer_pattern entry {value!r}: give a LayerKind or a dict with keys among {fields}")
  return LayerKind(**value)


def checked_pattern(model) -> tuple[LayerKind, ...]:
  """`model.layer_pattern` (a TransformerConfig's) as a tuple of LayerKinds (dict entries, the
  command line's form, converted), checked against the model's other fields."""
  pattern = model.layer_pattern
  require(isinstance(pattern, (tuple, list)),
          f"model.layer_pattern={pattern!r}: give a tuple of LayerKinds (or dicts), () for none")
  pattern = tuple(layer_kind(k) for k in pattern)
  if not pattern:
    return pattern
  require(model.attention_window is None,
          f"model.attention_window={model.attention_window} with model.layer_pattern: a pattern gives "
          f"each layer its window; put the window in the pattern's kinds and set attention_window=None")
  first_dense = 0 if model.moe is None else model.moe.first_dense_layers
  require(not first_dense,
          f"model.moe.first_dense_layers={first_dense} with model.layer_pattern: first dense layers "
          f"with per-layer kinds are not supported; use first_dense_layers=0 or no pattern")
  every = 1 if model.moe is None else model.moe.every
  unit = math.lcm(len(pattern), every)
  require(model.num_layers >= unit,
          f"model.num_layers={model.num_layers} is below one unit of the stack: lcm(len(model."
          f"layer_pattern)={len(pattern)}, moe.every={every}) = {unit} layers; use at least {unit} "
          f"layers or a shorter pattern")
  require(model.temperature_floor_scale > 0 and model.temperature_scale >= 0,
          f"model.temperature_floor_scale={model.temperature_floor_scale} must be > 0 and "
          f"model.temperature_scale={model.temperature_scale} >= 0")
  return pattern
