"""shardax: write the model for one huge device, annotate, train anywhere.

Importing the package registers the named experiments (shardax/experiments/) in the
registry, which only holds the table (configs/registry.py): `configs.get("lm.tiny")` works
after any shardax import, and configs/ never imports the experiments built on it.
Importing it first decides the jax platform (trainer/platform.py): an explicit
JAX_PLATFORMS, a TPU or a GPU is never overridden.
"""

__version__ = "0.1.0"

# Before anything imports jax: keep jax off libtpu on a machine without a TPU (its backend
# would print a page of errors at the first jax call), for library users as for the CLI.
from shardax.trainer import platform as _platform  # noqa: E402  (stdlib only)

_platform.apply()

from shardax import experiments  # noqa: E402,F401  (registers them; after __version__)
