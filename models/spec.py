"""A model family as one spec, and the one registry every family registers in.

A `ModelSpec` names what a family is made of: its config class (plain data: the fields an
experiment sets), how a module is built from a config, and its Hugging Face adapter if
it has one. Code that builds models (trainer/model_setup.py) asks the registry for the spec
of a config (`spec_for(cfg).build(cfg, rngs)`, or `build(cfg, rngs)`), so a config never
imports the module it describes, and a new family is one `register(ModelSpec(...))`.

Sharding presets are one shared table (sharding/rules.py) that every family's logical axis
names read from; no family carries rules of its own.

This module is a leaf: it imports no family; `shardax.models` imports them all.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable

from shardax.configs.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class HFAdapter:
  """A family's Hugging Face interop.

  architectures: the config.json `architectures` values the family reads and writes;
  adapter_for: `adapter_for(arch_or_config)` -> the module mapping config.json <-> the
    family's config fields and the param tree <-> tensor names (models/hf/__init__.py).
  """
  architectures: tuple[str, ...]
  adapter_for: Callable[[Any], ModuleType]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One model family.

  name: the family's registry key ("lm", "unet3d", ...);
  config_cls: the frozen dataclass an experiment's `model` section holds;
  builder: `builder(cfg, rngs)` -> the flax NNX module (it has `loss_and_metrics`);
  hf: the Hugging Face adapter, None when the family has no Hugging Face counterpart.
  """
  name: str
  config_cls: type
  builder: Callable[[Any, Any], Any]
  hf: HFAdapter | None = None

  def build(self, cfg: Any, rngs) -> Any:
    """The module `cfg` describes (called abstractly under `nnx.eval_shape`, and for real)."""
    if not isinstance(cfg, self.config_cls):
      raise TypeError(f"model family {self.name!r} builds from {self.config_cls.__name__}, "
                      f"got {type(cfg).__name__}")
    return self.builder(cfg, rngs)


_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
  """Adds `spec`; a second family under the same name, config class or HF architecture is refused."""
  archs = set(spec.hf.architectures) if spec.hf else set()
  for other in _SPECS.values():
    shared = archs & set(other.hf.architectures) if other.hf else set()
    clash = ("name" if spec.name == other.name else
             "config class" if spec.config_cls is other.config_cls else
             f"Hugging Face architectures {sorted(shared)}" if shared else None)
    if clash:
      raise ValueError(f"model family {spec.name!r}: its {clash} is already registered by {other.name!r}")
  _SPECS[spec.name] = spec
  return spec


def specs() -> dict[str, ModelSpec]:
  """Every registered family, by name."""
  return dict(_SPECS)


def get(name: str) -> ModelSpec:
  """The family registered under `name`."""
  if name not in _SPECS:
    raise ConfigError(f"no model family {name!r}; registered: {sorted(_SPECS)}")
  return _SPECS[name]


def spec_for(cfg: Any) -> ModelSpec:
  """The family whose config class `cfg` is an instance of (exact type)."""
  for spec in _SPECS.values():
    if type(cfg) is spec.config_cls:
      return spec
  known = sorted(s.config_cls.__name__ for s in _SPECS.values())
  raise ConfigError(f"model config {type(cfg).__name__} belongs to no registered model family "
                    f"(known configs: {known}); register one with shardax.models.register(ModelSpec(...))")


def build(cfg: Any, rngs) -> Any:
  """`spec_for(cfg).build(cfg, rngs)`."""
  return spec_for(cfg).build(cfg, rngs)


def for_hf_architecture(architecture: str) -> ModelSpec:
  """The family that reads config.json `architectures: [architecture]`."""
  for spec in _SPECS.values():
    if spec.hf and architecture in spec.hf.architectures:
      return spec
  known = sorted(a for s in _SPECS.values() if s.hf for a in s.hf.architectures)
  raise ConfigError(f"config.json architectures=[{architecture!r}]: no model family reads it; "
                    f"shardax reads {known}")
