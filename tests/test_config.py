"""Config building, overrides and the command line's error messages."""

import os
import subprocess
import sys

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
    (["model.norm='batch'"], "model.norm='batch': use 'rms' or 'layer'"),
    (["mesh.ici=(2, 2, 2)"], "mesh.ici=.* has 3 entries but mesh.axes"),
    (["model.moe.expert_overflow='drop'"], "expert_overflow='drop' is the dropless dispatch's buffer policy"),
    (["model.moe.dispatch='dropless'", "model.moe.grouped_matmul='megablox'", "model.quantization='int8'"],
     "grouped_matmul='megablox' with model.quantization='int8'"),
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
