"""Model families as specs: every family registered the same way, configs as plain data.

The configs describe models and never import the modules they describe (configs/ sits below
layers/); the registry (models/spec.py) is where a config meets its module.
"""

import ast
import dataclasses
import pathlib

import pytest
from flax import nnx

from shardax import configs, models
from shardax.configs.schema import ConfigError, TransformerConfig
from shardax.configs.vision import ClassifierConfig, UNet3DConfig
from shardax.layers.classifier import ImageClassifier
from shardax.layers.transformer import TransformerLM
from shardax.layers.unet import UNet3D
from shardax.models import hf as hf_models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_modules(path: pathlib.Path) -> set[str]:
  """Every module a file imports, at its top or inside a function, relative imports resolved."""
  package = "shardax." + ".".join(path.parent.relative_to(ROOT).parts)
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      found |= {base} | {f"{base}.{a.name}" for a in node.names}
  return found


def test_configs_import_nothing_from_layers_models_or_trainer():
  files = sorted((ROOT / "configs").glob("*.py"))
  assert len(files) > 5
  upward = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in imported_modules(p)
            if m.startswith(("shardax.layers", "shardax.models", "shardax.trainer"))}
  assert not upward, f"configs/ must stay data; these reach up into the modules: {sorted(upward)}"


def test_models_import_nothing_from_trainer():
  files = sorted((ROOT / "models").rglob("*.py"))
  assert ROOT / "models" / "hf" / "llama.py" in files
  upward = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in imported_modules(p)
            if m.startswith("shardax.trainer")}
  assert not upward, f"models/ sits below trainer/; these reach up into it: {sorted(upward)}"


def test_every_registered_experiment_builds_through_its_family():
  for name in configs.names():
    exp = configs.build(configs.get(name))
    assert models.spec_for(exp.model).config_cls is type(exp.model), name


@pytest.mark.parametrize("cfg, module_cls, family", [
    (TransformerConfig(num_layers=1, d_model=32, num_heads=2, d_ff=64), TransformerLM, "lm"),
    (UNet3DConfig(), UNet3D, "unet3d"),
    (ClassifierConfig(), ImageClassifier, "classifier"),
])
def test_each_family_builds_its_module(cfg, module_cls, family):
  spec = models.spec_for(cfg)
  assert spec is models.get(family)
  module = nnx.eval_shape(lambda: models.build(cfg, nnx.Rngs(0)))
  assert type(module) is module_cls
  assert hasattr(module, "loss_and_metrics")


def test_an_unregistered_config_names_its_class_and_the_fix():
  @dataclasses.dataclass(frozen=True)
  class MyConfig:
    width: int = 4

  with pytest.raises(ConfigError, match=r"MyConfig belongs to no registered model family.*models\.register"):
    models.spec_for(MyConfig())


def test_a_family_is_registered_once():
  lm = models.get("lm")
  with pytest.raises(ValueError, match="config class is already registered by 'lm'"):
    models.register(dataclasses.replace(lm, name="lm2", hf=None))
  with pytest.raises(ValueError, match=r"Hugging Face architectures \['LlamaForCausalLM'\].*'lm'"):
    models.register(models.ModelSpec("llama2", ClassifierConfig, lambda c, r: None,
                                     models.HFAdapter(("LlamaForCausalLM",), hf_models.adapter_for)))
  assert "lm2" not in models.specs() and "llama2" not in models.specs()


def test_the_hf_architectures_reach_their_family_and_adapter():
  for cls, arch in hf_models.ARCHITECTURES.items():
    spec = models.for_hf_architecture(cls)
    adapter = spec.hf.adapter_for(cls)
    assert spec.name == "lm" and adapter is hf_models.adapter_for(arch)
    assert adapter in hf_models.FAMILIES and arch in adapter.ARCHITECTURES.values()
    assert adapter.ARCHITECTURES[cls] == arch
  with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
    models.for_hf_architecture("GPT2LMHeadModel")


def test_a_named_shape_enters_an_experiment_as_a_tree_that_set_still_reaches():
  from shardax.configs import registry, shapes
  from shardax.configs.moe import MoEConfig
  value = dataclasses.replace(shapes.LM_TINY, moe=MoEConfig(num_experts=4), remat="dots")
  tree = registry.apply_overrides(configs.experiment(model=registry.config_of(value)),
                                  ["model.moe.num_experts=8", "model.num_layers=2", "data.seq_len=128"])
  assert configs.build(tree).model == dataclasses.replace(value, moe=MoEConfig(num_experts=8),
                                                          num_layers=2)
  assert configs.build(configs.get("lm.tiny")).model == shapes.LM_TINY


def test_an_hf_family_registers_its_interface_and_classes_once():
  """models/hf FAMILIES: a family module missing part of the interface, or claiming a
  config.json class another family reads, is refused; an unknown name lists what is read."""
  import types
  with pytest.raises(ValueError, match="LlamaForCausalLM.*already registered"):
    hf_models.architectures_of((hf_models.llama, hf_models.llama))
  partial = types.ModuleType("half_family")
  partial.ARCHITECTURES, partial.model_fields = {"NewForCausalLM": "new"}, lambda hf: {}
  with pytest.raises(TypeError, match=r"half_family lacks \['moe_fields', 'to_hf'"):
    hf_models.architectures_of((partial,))
  with pytest.raises(ConfigError, match="'gpt2'.*LlamaForCausalLM"):
    hf_models.adapter_for("gpt2")
