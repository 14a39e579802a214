"""shardax: write the model for one huge device, annotate, train anywhere.

Importing the package registers the named experiments (shardax/experiments/) in the
registry, which only holds the table (configs/registry.py): `configs.get("lm.tiny")` works
after any shardax import, and configs/ never imports the experiments built on it.
"""

__version__ = "0.1.0"

from shardax import experiments  # noqa: E402,F401  (registers them; after __version__)
