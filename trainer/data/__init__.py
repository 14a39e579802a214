"""Data: sources, tokenization, packing, preparation and the per-host loader."""
