"""Experiment configs: the typed schema and the registry of named experiments."""

from shardax.configs.registry import apply_overrides, build, experiment, get, names, register, resolve
from shardax.configs.schema import ConfigError, Experiment

__all__ = ["ConfigError", "Experiment", "apply_overrides", "build", "experiment", "get", "names", "register", "resolve"]
