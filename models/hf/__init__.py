"""Hugging Face interop of the language model: one adapter module per architecture family.

  common.py  config.json reading, the no-math keys, the unknown-key check, RoPE in both
             spellings, and the param tree <-> tensor names walk (`Leaf`, `leaves`)
  llama.py   Llama, Mistral, Qwen2, Qwen3, Mixtral
  qwen3_moe.py  Qwen3-MoE
  deepseek_v3.py  DeepSeek-V3 (multi-head latent attention, group-limited sigmoid routing)
  llama4.py  Llama 4 text (chunked RoPE and NoPE layers, top-1 sigmoid MoE with a shared expert)
  gpt_oss.py  gpt-oss (attention sinks, sliding/full layer types, biased router and experts, clamped SwiGLU;
             mxfp4.py: its MXFP4 expert weights dequantized on import)
  gemma.py   Gemma 2 and Gemma 3 text (local/global layer types, (1 + w) pre and post norms, soft-caps)

A family module provides:
  ARCHITECTURES                    {config.json class: short arch name}, e.g. {"LlamaForCausalLM": "llama"}
  model_fields(hf) -> dict         TransformerConfig fields of a config.json (ConfigError naming a key
                                   it does not implement: `common.check_keys`)
  moe_fields(hf) -> dict | None    MoEConfig fields (None for a dense model)
  to_hf(model, arch, source)       config.json of a TransformerConfig (`source`: the imported one)
  check_exportable(model, arch)    ConfigError naming what `arch`'s config.json cannot express
  weight_names(model, arch)        `common.WeightNames`: the tensor-name tables of the model's params
and is registered by one entry in FAMILIES below. `adapter_for` is the one dispatch point
(trainer/hf/importer.py, exporter.py and experiments/hf.py go through it). Nothing in a model
directory is executed: config.json is read as JSON and no `trust_remote_code` path exists.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from shardax.configs.schema import ConfigError
from shardax.models.hf import common, deepseek_v3, gemma, gpt_oss, llama, llama4, qwen3_moe
from shardax.models.hf.common import Leaf, check_names, read  # noqa: F401  (the adapters' shared API)

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3_moe, deepseek_v3, llama4, gpt_oss, gemma)
INTERFACE = ("ARCHITECTURES", "model_fields", "moe_fields", "to_hf", "check_exportable", "weight_names")


def architectures_of(families) -> dict[str, str]:
  """{config.json class: short name} over `families`; a family lacking the interface, or two
  claiming one class or short name, is refused."""
  out: dict[str, str] = {}
  for fam in families:
    lacking = [a for a in INTERFACE if not hasattr(fam, a)]
    if lacking:
      raise TypeError(f"Hugging Face family {fam.__name__} lacks {lacking} (see shardax.models.hf)")
    for cls, arch in fam.ARCHITECTURES.items():
      if cls in out or arch in out.values():
        raise ValueError(f"Hugging Face family {fam.__name__}: {cls} / {arch!r} is already registered")
      out[cls] = arch
  return out


ARCHITECTURES = architectures_of(FAMILIES)
_FAMILY_OF = {arch: fam for fam in FAMILIES for arch in fam.ARCHITECTURES.values()}


def architecture(hf: dict[str, Any]) -> str:
  """The short arch name of a config.json (a ConfigError listing every class shardax reads)."""
  return common.arch_name(hf, ARCHITECTURES)


def adapter_for(arch_or_config: str | dict[str, Any]) -> ModuleType:
  """The family module for a config.json (dict), a short arch name ("mixtral") or a
  config.json class ("MixtralForCausalLM")."""
  if isinstance(arch_or_config, dict):
    return _FAMILY_OF[architecture(arch_or_config)]
  arch = ARCHITECTURES.get(arch_or_config, arch_or_config)
  if arch not in _FAMILY_OF:
    raise ConfigError(f"Hugging Face architecture {arch_or_config!r}: shardax reads "
                      f"{sorted(ARCHITECTURES)} ({sorted(_FAMILY_OF)})")
  return _FAMILY_OF[arch]


def leaves(params, model_cfg, arch: str) -> list[tuple[tuple, Leaf]]:
  """(tree path, Leaf) for every leaf of `params` as architecture `arch` names its tensors."""
  return common.leaves(params, model_cfg, adapter_for(arch).weight_names(model_cfg, arch))


def copies(model_cfg, arch: str) -> dict[str, str]:
  """{Hugging Face name: the name whose tensor it repeats} (`common.WeightNames.copies`)."""
  return adapter_for(arch).weight_names(model_cfg, arch).copies
