"""Registered experiments; importing this package registers them all."""

from shardax.experiments import lm  # noqa: F401
from shardax.experiments import moe  # noqa: F401
from shardax.experiments import vision  # noqa: F401
from shardax.experiments import pipelined  # noqa: F401
from shardax.experiments import pods  # noqa: F401
from shardax.experiments import hf  # noqa: F401
from shardax.experiments import long_context  # noqa: F401
from shardax.experiments import families  # noqa: F401
