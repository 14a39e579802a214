"""`--mode=plan` (trainer/perf/plan.py): candidates, pruning, ranking."""

import json
import shlex

import pytest

from shardax import configs
from shardax.trainer.perf import plan

# 1.6B fp32 params (12 bytes/param with AdamW: 18 GiB): replicated (dp) it cannot fit a
# 16 GiB v5e chip; 2D over 2x2 it can, with remat; without remat the attention scores of
# 24 layers cannot.
BIG = ["data.source='synthetic'", "model.num_layers=24", "model.d_model=2048", "model.num_heads=16",
       "model.d_ff=8192", "data.seq_len=2048", "model.max_len=2048", "train.global_batch=8",
       "mesh.topology='v5e:2x2'"]
GRID = plan.Grid(model_axis=(2, 3), presets=("2d", "dp"), remat=("full", "none"), microbatches=(1,),
                 fsdp=False, tp=False, pipeline_stages=())


def parsed(line: str) -> list[str]:
  words = shlex.split(line)
  assert words[::2] == ["--set"] * (len(words) // 2)
  return words[1::2]


def test_pod_lm_1t_grid_has_24_plus_valid_candidates():
  cfg = configs.get("pod.lm_1t")
  found = plan.candidates(cfg, 2048)
  assert len(found) >= 24 and len({tuple(c) for c in found}) == len(found)
  for sets in found:  # every --set line, as printed, is accepted by the command line's parser
    cfg = configs.get("pod.lm_1t")
    configs.apply_overrides(cfg, parsed(plan.set_line(sets)))
    exp = configs.build(cfg)
    assert exp.model.remat in ("full", "dots_no_batch", "none")
  assert any("pipeline.stages=8" in s for c in found for s in c)


def test_rank_orders_fitting_candidates_by_predicted_step_then_memory():
  rows = [{"status": "ok", "predicted_step_seconds": 2.0, "bytes_per_device": 5},
          {"status": "does not fit", "predicted_step_seconds": 0.1, "bytes_per_device": 99},
          {"status": "ok", "predicted_step_seconds": 1.0, "bytes_per_device": 7},
          {"status": "ok", "predicted_step_seconds": 1.0, "bytes_per_device": 3},
          {"status": "rejected", "predicted_step_seconds": None, "bytes_per_device": None}]
  assert plan.rank(rows) == [rows[3], rows[2], rows[0]]
  assert plan._predicted_seconds({"predicted": {"step_seconds": 3.5}}) == 3.5
  assert plan._predicted_seconds({"predicted": None}) is None


@pytest.fixture(scope="module")
def big_plan(tmp_path_factory):
  pytest.importorskip("libtpu")
  job = tmp_path_factory.mktemp("plan")
  return plan.plan("lm.tiny", BIG, str(job), grid=GRID, log=lambda s: None), job


def _row(p, *needles):
  return [r for r in p["candidates"] if all(any(n == s for s in r["sets"]) for n in needles)]


def test_a_mesh_that_does_not_divide_is_rejected_with_the_reason(big_plan):
  p, _ = big_plan
  rows = _row(p, "mesh.ici=(-1, 3)")
  assert len(rows) == 4
  for r in rows:
    assert r["status"] == "rejected" and "do not divide the 4 devices" in r["reason"]
    assert "compile_path" not in r  # rejected before any compile


def test_what_cannot_fit_is_dropped_by_state_bytes_or_by_the_compiler(big_plan):
  p, _ = big_plan
  for r in _row(p, "sharding.preset=dp", "mesh.ici=(-1, 2)"):  # weights replicated: state alone > HBM, no compile
    assert r["status"] == "does not fit" and "alone need" in r["reason"] and "compile_path" not in r
  [no_remat] = _row(p, "sharding.preset=2d", "mesh.ici=(-1, 2)", "model.remat=none")
  assert no_remat["status"] == "does not fit" and no_remat["compile_path"] == "full"
  [best] = _row(p, "sharding.preset=2d", "mesh.ici=(-1, 2)", "model.remat=full")
  assert best["status"] == "ok" and best["fits"] is True and best["predicted_step_seconds"] > 0
  assert [p["candidates"][i] for i in p["ranked"]] == [best]
  assert p["compiled"] == 2


def test_plan_json_and_printed_summary(big_plan):
  p, job = big_plan
  assert json.loads((job / "plan.json").read_text()) == json.loads(json.dumps(p))
  text = plan.format_plan(p)
  assert "8 candidates, 2 compiled, 1 fit, 3 do not fit, 4 rejected" in text
  [best] = [p["candidates"][i] for i in p["ranked"]]
  assert best["set_line"] in text
  cfg = configs.get("lm.tiny")  # the printed line selects exactly that layout
  configs.apply_overrides(cfg, BIG + parsed(best["set_line"]))
  exp = configs.build(cfg)
  assert exp.sharding.preset == "2d" and tuple(exp.mesh.ici) == (-1, 2) and exp.model.remat == "full"
