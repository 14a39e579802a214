"""shardax: write the model for one huge device, annotate, train anywhere."""

__version__ = "0.1.0"
