"""Named model shapes: a model's architecture as one value, kept in one place.

A shape fixes what makes the model that model (depth, width, heads, feed-forward width, the
longest sequence it is built for) and leaves step settings (dtype, attention kernel, remat,
scanning) at their defaults. An experiment starts from a shape, changes what it needs with
`dataclasses.replace`, and puts the result into its tree with `registry.config_of`, where
`--set model.*` still reaches every field:

    cfg = experiment(model=config_of(dataclasses.replace(LM_1B, dtype="bfloat16")))
"""

from __future__ import annotations

from shardax.configs.schema import TransformerConfig

# Byte-level language models (vocab 256, the TransformerConfig default).
LM_TINY = TransformerConfig(num_layers=4, d_model=192, num_heads=4, d_ff=512, max_len=128)
LM_SMALL = TransformerConfig(num_layers=12, d_model=768, num_heads=12, d_ff=3072, max_len=512)
# GPT-3 XL's depth and width (24 x 2048, 16 heads of 128) with a gated MLP of d_ff 5632, which
# has the 2 x 4d x d parameters of a plain one: ~1.23B parameters.
LM_1B = TransformerConfig(num_layers=24, d_model=2048, num_heads=16, d_ff=5632, max_len=2048)
