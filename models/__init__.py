"""Model families, each one `ModelSpec` (models/spec.py) in one registry; importing this
package registers every family of shardax.

  spec.py    ModelSpec, HFAdapter, the registry (`register`, `spec_for`, `build`, ...)
  lm.py      the language model (TransformerConfig -> layers/transformer.py TransformerLM)
  vision.py  the 3D U-Net and the 2D classifier (configs/vision.py -> layers/unet.py, classifier.py)
"""

from shardax.models import lm  # noqa: F401  (registers the family)
from shardax.models import vision  # noqa: F401  (registers the families)
from shardax.models.spec import (HFAdapter, ModelSpec, build, for_hf_architecture, get, register,
                                 spec_for, specs)

__all__ = ["HFAdapter", "ModelSpec", "build", "for_hf_architecture", "get", "register", "spec_for", "specs"]
