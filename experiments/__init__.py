"""Registered experiments; importing this package registers them all."""

from shardax.experiments import lm  # noqa: F401
