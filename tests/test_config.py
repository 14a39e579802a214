"""Config building, overrides and the command line's error messages."""

import dataclasses
import os
import subprocess
import sys

import fiddle as fdl
import pytest

from shardax import configs
from shardax.configs import ConfigError
from shardax.sharding import make_mesh
from shardax.trainer import state as state_lib


def build(*overrides, name="lm.tiny"):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, list(overrides))
  return configs.build(cfg)


def test_overrides_parse_literals():
  exp = build("train.steps=10", "mesh.ici=2,4", "optimizer.learning_rate=1e-4",
              "data.source=synthetic", "model.num_kv_heads=None")
  assert exp.train.steps == 10 and exp.mesh.ici == (2, 4)
  assert exp.optimizer.learning_rate == 1e-4 and exp.data.source == "synthetic"
  assert exp.model.num_kv_heads is None


@pytest.mark.parametrize("overrides, match", [
    (["train.stpes=3"], r"unknown field 'stpes' \(did you mean train.steps\?\); valid names here: .*global_batch"),
    (["modle.d_model=3"], r"unknown field 'modle'.*valid names here: .*model"),
    (["train.steps"], "expected PATH=VALUE"),
    (["model.num_heads=7"], "model.num_heads=7 does not divide model.d_model=192"),
    (["model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads=4"),
    (["data.seq_len=512"], "data.seq_len=512 exceeds model.max_len=128"),
    (["train.microbatches=5"], "train.microbatches=5 must divide train.global_batch=32"),
    (["model.norm='batch'"], "model.norm='batch': use one of \\('rms', 'rms_plus_one', 'layer'\\)"),
    (["mesh.ici=(2, 2, 2)"], "mesh.ici=.* has 3 entries but mesh.axes"),
    (["model.moe.num_experts=8", "model.moe.expert_overflow='drop'"],
     "expert_overflow='drop' is the dropless dispatch's buffer policy"),
    (["model.moe.num_experts=8", "model.moe.dispatch='dropless'", "model.moe.grouped_matmul='megablox'",
      "model.quantization='int8'"], "grouped_matmul='megablox' with model.quantization='int8'"),
])
def test_config_errors_name_the_field_and_fix(overrides, match):
  with pytest.raises((ConfigError, ValueError), match=match):
    build(*overrides)


def test_unknown_experiment_suggests_close_names():
  with pytest.raises(ConfigError, match="unknown experiment 'lm.tinny'; did you mean lm.tiny"):
    configs.get("lm.tinny")


def test_batch_not_divisible_by_data_parallel_degree():
  exp = build("train.global_batch=12", "mesh.ici=(8, 1)")
  mesh = make_mesh(exp.mesh)
  with pytest.raises(ValueError, match=r"global_batch=12 .* not divisible by the data-parallel degree 8"):
    state_lib.create(exp, mesh)


def run_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  return subprocess.run([sys.executable, "-m", "shardax.main", *args], capture_output=True,
                        text=True, env=env, timeout=120)


def test_cli_list_and_errors(tmp_path):
  out = run_cli("--mode=list")
  assert out.returncode == 0 and "lm.tiny" in out.stdout and "lm.small" in out.stdout
  bad = run_cli("--exp=lm.tinny", f"--job_dir={tmp_path}/j")
  assert bad.returncode == 2 and "did you mean lm.tiny" in bad.stderr
  bad = run_cli("--exp=lm.tiny", f"--job_dir={tmp_path}/j", "--set", "train.stpes=1")
  assert bad.returncode == 2 and "did you mean train.steps" in bad.stderr
  bad = run_cli("--exp=lm.tiny", f"--job_dir={tmp_path}/j", "--set", "mesh.ici=(2, 4)")
  assert bad.returncode == 2 and "mesh (2, 4) needs 8 devices, 1 are available" in bad.stderr
  assert not os.path.exists(tmp_path / "j")  # nothing written for a bad command


def test_the_former_moe_section_paths_name_their_new_place():
  """model.transformer.* (the MoE LM's own config before the one decoder) is refused with
  the path that now holds the field, not a list of valid names."""
  cfg = configs.get("moe.mixtral_tiny")
  with pytest.raises(ConfigError, match=r"use --set model\.num_layers=8"):
    configs.apply_overrides(cfg, ["model.transformer.num_layers=8"])
  exp = configs.build(configs.apply_overrides(cfg, ["model.num_layers=8"]))
  assert exp.model.num_layers == 8 and exp.model.moe is not None


def test_setting_a_moe_field_on_a_dense_experiment_makes_it_a_moe_model():
  dense = configs.build(configs.get("lm.tiny"))
  assert dense.model.moe is None and dense.model.num_moe_layers == 0
  exp = configs.build(configs.apply_overrides(configs.get("lm.tiny"), ["model.moe.num_experts=4"]))
  assert exp.model.moe.num_experts == 4 and exp.model.moe.every == 2
  assert exp.model.num_moe_layers == exp.model.num_layers // 2
  assert exp.model.flops_per_example(exp.data) != dense.model.flops_per_example(dense.data)
  with pytest.raises(ConfigError, match="second_expert='all' or dispatch='dropless'"):
    configs.build(configs.apply_overrides(configs.get("lm.tiny_pipelined"), ["model.moe.num_experts=4"]))


@pytest.mark.parametrize("field", ["fp8_dispatch=False", "dispatch='dropless'", "every=2", "d_ff=64"])
def test_a_field_of_an_absent_section_does_not_create_it(field):
  """On a dense experiment a model.moe.* field alone (even one set to its default) is refused
  naming the field and the switch that adds the section; it never builds an MoE model."""
  with pytest.raises(ConfigError, match=rf"--set model\.moe\.{field.split('=')[0]}: this experiment has "
                                        r"no model\.moe section.*--set model\.moe\.num_experts=N"):
    build(f"model.moe.{field}")


def test_the_switch_creates_the_section_whatever_the_order_of_the_overrides():
  exp = build("model.moe.dispatch='dropless'", "model.moe.top_k=2", "model.moe.num_experts=4")
  assert (exp.model.moe.num_experts, exp.model.moe.dispatch, exp.model.moe.top_k) == (4, "dropless", 2)
  moe = build("model.moe.fp8_dispatch=False", name="moe.tiny")   # the section is there: a plain edit
  assert moe.model.moe == dataclasses.replace(build(name="moe.tiny").model.moe, fp8_dispatch=False)


@dataclasses.dataclass(frozen=True)
class _Extra:
  size: int = 1


@dataclasses.dataclass(frozen=True)
class _Holder:
  extra: _Extra | None = None


def test_an_absent_section_without_a_switch_is_never_created():
  """The rule is generic: any `Section | None` field left None (not only model.moe) is created
  by its switch alone (configs.registry.SECTION_SWITCHES); one without a switch never is."""
  with pytest.raises(ConfigError, match=r"--set extra\.size: this experiment has no extra section.*no --set "
                                        r"creates one"):
    configs.apply_overrides(fdl.Config(_Holder), ["extra.size=2"])
