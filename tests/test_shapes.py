"""The named shapes (configs/shapes.py) are the models they name, and the recipes refuse a
change they cannot make.

The parameter counts are the sources' own (model cards, papers), not recomputed from the
shapes: a mistyped width, depth, head count or expert count moves a count out of its band.
"""

import pytest

from shardax.configs import shapes
from shardax.experiments import recipes

# Published total parameters (within 1%): model cards and papers.
PUBLISHED = {
    "LLAMA3_8B": 8.03e9,       # meta-llama/Llama-3.1-8B
    "LLAMA3_70B": 70.6e9,      # meta-llama/Llama-3.1-70B
    "MISTRAL_7B": 7.24e9,      # mistralai/Mistral-7B-v0.3
    "MIXTRAL_8X7B": 46.7e9,    # arXiv 2401.04088
    "GPT3_175B": 175e9,        # arXiv 2005.14165
    "MAVERICK": 400e9,         # Llama 4 Maverick model card
    "DEEPSEEK_V3": 671e9,      # arXiv 2412.19437 (the main model; its MTP module is a step setting)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_shape_has_its_sources_parameter_count(name):
  got = getattr(shapes, name).param_count()
  assert abs(got / PUBLISHED[name] - 1) < 0.01, f"{name}: {got:.4g} parameters, published {PUBLISHED[name]:.4g}"


def test_recipes_model_changes_the_moe_of_an_moe_shape_and_refuses_a_dense_one():
  changed = recipes.model(shapes.MIXTRAL_8X7B, moe=dict(dispatch="dropless"), remat="full")
  assert (changed.moe.dispatch, changed.remat, changed.moe.num_experts) == ("dropless", "full", 8)
  with pytest.raises(ValueError, match="shape.moe is None"):
    recipes.model(shapes.LLAMA3_8B, moe=dict(top_k=1))
