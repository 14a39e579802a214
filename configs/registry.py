"""The experiment registry, command-line overrides, and the resolved config on disk.

An experiment is a function, registered under a dotted name, that returns a
`fdl.Config(Experiment, ...)`. Overrides edit that config tree by path before it
is built, so a typo in a path fails with fiddle's list of valid names instead of
being silently ignored (Praxis's UPPER_CASE attributes were).

This module only holds the table: the experiments (shardax/experiments/, which build on
configs/) register themselves when imported, and importing the `shardax` package imports
them (shardax/__init__.py). So configs/ never imports what sits above it, and any
`from shardax import configs` finds them. An experiment defined elsewhere (a user's module)
registers the same way: `@configs.register("my.exp")`, then import that module.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import typing
from typing import Any, Callable, Sequence

import fiddle as fdl

from shardax.configs.moe import MoEConfig
from shardax.configs.mla import MLAConfig
from shardax.configs.mtp import MTPConfig
from shardax.configs import rope as rope_lib
from shardax.configs.schema import ConfigError, Experiment

_REGISTRY: dict[str, tuple[Callable[[], fdl.Config], str]] = {}


def config_tree(cls: type, **values: Any) -> fdl.Config:
  """`fdl.Config(cls)` with every dataclass-valued field expanded into its own Config.

  fiddle cannot read defaults that come from a `default_factory`; expanding them
  makes `cfg.model.num_layers = 8` work on a fresh tree and keeps every default visible.
  """
  cfg = fdl.Config(cls)
  for f in dataclasses.fields(cls):
    factory = f.default_factory
    if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
      setattr(cfg, f.name, config_tree(factory))
  for name, value in values.items():
    setattr(cfg, name, value)
  return cfg


def config_of(value: Any) -> fdl.Config:
  """The config tree of a dataclass value (e.g. a named shape, configs/shapes.py): every field
  set from `value`, dataclass-valued fields as trees of their own, so `--set` reaches them as
  on any other experiment and building the tree gives back an equal value."""
  if not dataclasses.is_dataclass(value) or isinstance(value, type):
    raise TypeError(f"config_of takes a dataclass instance, got {type(value).__name__}")
  cfg = fdl.Config(type(value))
  for f in (f for f in dataclasses.fields(value) if f.init):
    v = getattr(value, f.name)
    setattr(cfg, f.name, config_of(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v)
  return cfg


def experiment(**values: Any) -> fdl.Config:
  """A full experiment config tree with defaults; the starting point of every experiment."""
  return config_tree(Experiment, **values)


def register(name: str, description: str = "") -> Callable:
  """Decorator: `@register("lm.tiny", "...")` on a function returning an experiment config."""
  def wrap(fn: Callable[[], fdl.Config]) -> Callable[[], fdl.Config]:
    if name in _REGISTRY:
      raise ValueError(f"experiment {name!r} is registered twice")
    _REGISTRY[name] = (fn, description or ((fn.__doc__ or "").strip().splitlines() or [""])[0])
    return fn
  return wrap


def names() -> dict[str, str]:
  """Registered experiment name -> one-line description, sorted by name."""
  return {n: _REGISTRY[n][1] for n in sorted(_REGISTRY)}


def get(name: str) -> fdl.Config:
  """The named experiment's config tree (unbuilt, so overrides can still edit it)."""
  prefix, _, rest = name.partition(":")
  if rest and prefix in _PREFIXES:
    cfg = _PREFIXES[prefix](rest)
    cfg.name = cfg.name or name
    return cfg
  if name not in _REGISTRY:
    close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    if not _REGISTRY:
      check_package()
      hint = "; no experiment is registered: import shardax.experiments (importing shardax does)"
    raise ConfigError(f"unknown experiment {name!r}{hint} (shardax --mode=list shows them all)")
  fn, desc = _REGISTRY[name]
  cfg = fn()
  if not cfg.name:
    cfg.name = name
  if not cfg.description:
    cfg.description = desc
  return cfg


MOVED = "model.transformer."   # the MoE LM's former config section (before the one decoder)


def check_package() -> None:
  """Raise ConfigError when `shardax` was imported from a folder without the package's files.

  An editable install (`pip install -e .`, what `make setup` does) finds shardax through a
  finder Python consults after sys.path. `python -m shardax.main` puts the working directory
  first on sys.path, so a folder there named `shardax` (say /tmp/shardax, holding job dirs)
  is imported as `shardax`, a namespace package, while the submodules still come from the
  install: shardax/__init__.py, which registers the experiments, never runs.
  """
  import sys
  package = sys.modules.get("shardax")
  if package is None or getattr(package, "__file__", None) is not None:
    return
  folders = ", ".join(str(p) for p in getattr(package, "__path__", [])) or "a folder"
  raise ConfigError(f"'shardax' was imported from {folders}, a folder named like the package "
                    f"without its files (it hides the installed shardax, so no experiment is "
                    f"registered): run from another directory, or rename that folder")


def parse_value(text: str) -> Any:
  """A Python literal (`8`, `1e-3`, `(2, 4)`, `2,4`, `None`, `'x'`); anything else is a string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


# The field whose --set creates an optional section the experiment leaves out (None), for each
# such section type; any other field of an absent section is refused (`_child`), so no option
# turns on a section, with every other field at its default, by accident.
SECTION_SWITCHES: dict[type, str] = {MoEConfig: "num_experts", MLAConfig: "kv_lora_rank", MTPConfig: "depth",
                                     rope_lib.RopeScaling: "kind"}
SWITCH_EXAMPLES = {"kind": "|".join(repr(k) for k in rope_lib.KINDS)}   # a switch that is not a count


def apply_overrides(cfg: fdl.Config, overrides: Sequence[str]) -> fdl.Config:
  """Apply `PATH=VALUE` strings (e.g. `train.steps=10`, `mesh.ici=2,4`) in order.

  A section the experiment leaves out (a dense model's `model.moe`) is created only when the
  overrides set its switch (SECTION_SWITCHES: `model.moe.num_experts=N` turns lm.tiny into an
  MoE model), in any order among them; a field of an absent section set without it is a
  ConfigError naming the field and that switch."""
  paths = {item.split("=", 1)[0].strip() for item in overrides if "=" in item}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set {item!r}: expected PATH=VALUE, e.g. --set train.steps=10")
    path, text = item.split("=", 1)
    if path.strip().startswith(MOVED):
      new = "model." + path.strip()[len(MOVED):]
      raise ConfigError(f"--set {path.strip()}: an MoE model's own fields moved from model.transformer.* "
                        f"to model.* (dense and MoE LMs share one config): use "
                        f"--set {new}={text.strip()}")
    if path.strip() in rope_lib.MOVED:
      new = rope_lib.MOVED[path.strip()]
      hint = (" (RoPE scaling is one section, configs/rope.py; a model without it also needs "
              "--set model.rope_scaling.kind=...)" if new.startswith("model.rope_scaling.") else "")
      raise ConfigError(f"--set {path.strip()}: moved to {new}: use --set {new}={text.strip()}{hint}")
    *parents, leaf = path.strip().split(".")
    node = cfg
    for i, part in enumerate(parents):
      node = _child(node, part, ".".join(parents[:i + 1]), path.strip(), paths)
    if not isinstance(node, fdl.Buildable):
      raise ConfigError(f"--set {item!r}: {'.'.join(parents)} is a value, not a config section")
    _check_name(node, leaf, path)
    setattr(node, leaf, parse_value(text.strip()))
  return cfg


def _valid_names(node: fdl.Buildable) -> list[str]:
  return sorted(node.__signature_info__.parameters)


def _check_name(node: fdl.Buildable, name: str, path: str) -> None:
  valid = _valid_names(node)
  if name not in valid:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {path.rsplit('.', 1)[0] + '.' if '.' in path else ''}{close[0]}?)" if close else ""
    raise ConfigError(f"--set {path}: unknown field {name!r}{hint}; valid names here: {', '.join(valid)}")


def _child(node: Any, part: str, path: str, setting: str, paths: set[str]) -> Any:
  """node.part, for the --set of `setting`; an optional section left None is created with its
  defaults only when `paths` (every path the overrides set) holds its switch."""
  if not isinstance(node, fdl.Buildable):
    raise ConfigError(f"--set {path}: cannot descend into a plain value")
  _check_name(node, part, path)
  child = getattr(node, part)
  if child is None:
    section = _optional_section(fdl.get_callable(node), part)
    if section is not None:
      switch = SECTION_SWITCHES.get(section)
      if switch is None or f"{path}.{switch}" not in paths:
        raise ConfigError(_absent_section(path, setting, switch))
      child = config_tree(section)
      setattr(node, part, child)
  return child


def _absent_section(path: str, setting: str, switch: str | None) -> str:
  what = f"--set {setting}: this experiment has no {path} section ({path} is None)"
  if switch is None:
    return (f"{what}, and no --set creates one; use an experiment that has it, or register one "
            f"that sets {path} (configs.register)")
  return (f"{what}; setting one of its fields would create it with every other field at its "
          f"default. To add it, say so: --set {path}.{switch}={SWITCH_EXAMPLES.get(switch, 'N')} "
          f"(then its other fields); "
          f"otherwise drop --set {setting}")


def _optional_section(cls: Any, name: str) -> type | None:
  """The dataclass type of field `name` of `cls` when it is `SomeConfig | None`, else None."""
  try:
    hint = typing.get_type_hints(cls).get(name)
  except Exception:   # a callable without resolvable hints
    return None
  kinds = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
  return kinds[0] if len(kinds) == 1 and type(None) in typing.get_args(hint) else None


def build(cfg: fdl.Config) -> Experiment:
  """Build the dataclasses; their checks raise ConfigError naming the field and the fix."""
  try:
    return fdl.build(cfg)
  except ConfigError as e:  # drop fiddle's added context notes: our message says it all
    raise ConfigError(e.args[0]) from None
  except Exception as e:  # fiddle wraps errors raised in __post_init__
    cause = e
    while cause.__cause__ is not None or cause.__context__ is not None:
      nxt = cause.__cause__ or cause.__context__
      if isinstance(nxt, (ConfigError, ValueError)):
        raise nxt from None
      cause = nxt
    raise


def resolve(name: str, overrides: Sequence[str] = ()) -> Experiment:
  """The registered experiment `name` with the `PATH=VALUE` overrides applied, built: what
  `--exp=NAME --set ...` runs (unknown names, paths and failed checks raise ConfigError)."""
  return build(apply_overrides(get(name), overrides))


def to_text(exp: Experiment) -> str:
  """One `path = value` line per field: the readable resolved config."""
  def flat(d: dict, prefix: str = ""):
    for k, v in d.items():
      if isinstance(v, dict):
        yield from flat(v, f"{prefix}{k}.")
      else:
        yield f"{prefix}{k} = {v!r}"
  return "\n".join(flat(dataclasses.asdict(exp))) + "\n"


def to_json(exp: Experiment) -> str:
  return json.dumps(dataclasses.asdict(exp), indent=2, sort_keys=True, default=str)


# Experiment names with a prefix ("hf:DIR") are built by a function of the rest of the name;
# experiments/hf.py registers "hf". The planner re-resolves experiments by name, so a
# prefixed name must resolve the same way everywhere: here, in `get`.
_PREFIXES: dict[str, Callable[[str], fdl.Config]] = {}


def register_prefix(prefix: str, build_fn: Callable[[str], fdl.Config]) -> None:
  """`get("PREFIX:REST")` returns `build_fn(REST)`."""
  _PREFIXES[prefix] = build_fn
