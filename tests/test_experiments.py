"""Every registered lm.*, moe.* and conv.* experiment that fits this CPU trains as shipped:
its own defaults (data, mesh, eval, checkpoints), only train.steps lowered to 3.

Experiments registered later are picked up from the registry. Those that do not fit are
skipped by name with a reason, and the list is checked against the configs themselves:
a dry-run target names a TPU topology (mesh.topology), a benchmark size asks more than
CPU_STEP_FLOPS of a training step. A new experiment of either kind fails
`test_the_skip_list_is_what_the_configs_say` until it is listed here with its reason.
The default suite runs FAST (the pipelined experiment, which once stopped running as
shipped; ~35 s of CPU); the rest are marked slow (moe.tiny ~35 s, its model and data also
train in test_moe.py's shorter run).
"""

import math
import os

import pytest

from shardax import configs
from shardax.trainer import loop

STEPS = 3
CPU_STEP_FLOPS = 1e12  # ~10 s a step on a 2-core CPU at ~0.1 TFLOP/s
SKIPPED = {
    "lm.1b": "one-GPU benchmark size: 2.6e14 FLOPs a training step, hours on this CPU",
    "lm.small": "benchmark size: 5.8e12 FLOPs a step, and evals over the whole validation split",
    "lm.small_spm": "benchmark size: 6.1e12 FLOPs a step, and evals over the whole validation split",
    "lm.gpt3_175b_pipelined": "pod-sized (v4:8x8x8, 175B params): built and compiled by dry runs only",
    "lm.gpt3_175b_4slices": "pod-sized (4 x v5e:16x16, 175B params): built and compiled by dry runs only",
    "moe.gshard_1t": "pod-sized (v3:32x32, 1T params): built and compiled by dry runs only",
    "moe.mixtral_8x7b": "pod-sized (v5p:4x4x8, 46.7B params): built and compiled by dry runs only",
    "moe.deepseek_v3": "pod-sized (v5p:8x8x16, 675B params): built and compiled by dry runs only",
    "moe.qwen3_235b": "pod-sized (v5p:4x4x8, 235B params): built and compiled by dry runs only",
    "moe.llama4_maverick": "pod-sized (v5p:4x4x8, 400B params): built and compiled by dry runs only",
    "moe.gpt_oss_120b": "pod-sized (gpt-oss-120b): built and compiled by dry runs only",
    "moe.maverick_4slices": "pod-sized (4 x v5p:4x4x8, 400B params): built and compiled by dry runs only",
    "moe.maverick_4slices_data": "pod-sized (4 x v5p:4x4x8, 400B params): built and compiled by dry runs only",
    "moe.maverick_4slices_1m": "pod-sized (4 x v5p:4x4x4, 400B params): built and compiled by dry runs only",
    "moe.maverick_4slices_1m_data": "pod-sized (4 x v5p:4x4x4, 400B params): built and compiled by dry runs only",
    "lm.llama3_8b_8k": "pod-sized (v6e:2x4, Llama-3.1-8B at 8k): built and compiled by dry runs only",
    "lm.mistral_7b_8k": "pod-sized (v6e:2x4, Mistral-7B at 8k): built and compiled by dry runs only",
    "lm.llama3_70b_8k": "pod-sized (v6e:16x16, Llama-3.1-70B at 8k): built and compiled by dry runs only",
    "lm.gemma3_27b": "pod-sized (v5p:2x4x4, Gemma-3-27B at 8k): built and compiled by dry runs only",
    "lm.llama3_8b_32k": "pod-sized (v6e:8x8, Llama-3.1-8B at 32k, context parallel): built and compiled by dry runs only",
}
FAST = ("lm.tiny_pipelined",)


def family_names() -> list[str]:
  return sorted(n for n in configs.names() if n.startswith(("lm.", "moe.", "conv.")))


def does_not_fit(exp) -> str | None:
  """Why `exp` cannot train here, from its config alone (None: it can)."""
  if exp.mesh.topology:
    return f"dry-run target: mesh.topology={exp.mesh.topology!r}"
  step_flops = exp.train.global_batch * exp.model.flops_per_example(exp.data)
  if step_flops > CPU_STEP_FLOPS:
    return f"{step_flops:.1e} FLOPs a step > {CPU_STEP_FLOPS:.0e}"
  return None


def test_the_skip_list_is_what_the_configs_say():
  names = family_names()
  assert set(FAST) <= set(names) and set(SKIPPED) <= set(names), set(SKIPPED) - set(names)
  why = {n: does_not_fit(configs.build(configs.get(n))) for n in names}
  assert {n for n, w in why.items() if w} == set(SKIPPED), why
  assert len(names) - len(SKIPPED) >= 7


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
    for n in family_names() if n not in SKIPPED])
def test_experiment_trains_as_shipped(name, tmp_path):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, [f"train.steps={STEPS}"])
  exp = configs.build(cfg)
  summary = loop.train(exp, str(tmp_path))
  assert summary["final_step"] == STEPS and not summary["skipped_steps"], summary
  assert STEPS in summary["losses"]  # the last step is always logged
  assert all(math.isfinite(v) for v in summary["losses"].values()), summary["losses"]
  evals = summary["eval_losses"]
  assert sorted(evals) == [0, STEPS] and all(math.isfinite(v) for v in evals.values()), evals
  if exp.checkpoint.enabled:
    assert str(STEPS) in os.listdir(tmp_path / "checkpoints")
