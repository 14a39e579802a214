"""`--mode=plan` (perf/plan.py): candidates, pruning, ranking."""

import dataclasses
import json
import shlex

import pytest

from shardax import configs
from shardax.perf import plan

# 1.6B fp32 params (12 bytes/param with AdamW: 18 GiB): replicated (dp) it cannot fit a
# 16 GiB v5e chip; 2D over 2x2 it can, with remat; without remat the attention scores of
# 24 layers cannot.
BIG = ["data.source='synthetic'", "model.num_layers=24", "model.d_model=2048", "model.num_heads=16",
       "model.d_ff=8192", "data.seq_len=2048", "model.max_len=2048", "train.global_batch=8",
       "mesh.topology='v5e:2x2'"]
GRID = plan.Grid(model_axis=(2, 3), presets=("2d", "dp"), remat=("full", "none"), microbatches=(1,),
                 fsdp=False, tp=False, pipeline_stages=())


def _plan(name: str, overrides, job_dir: str, **kw):
  """The plan of experiment `name` with `overrides`, built once as the command line does."""
  base = plan.Base(name, overrides)
  return plan.plan(base.build(), base, job_dir, **kw)


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
  return _plan("lm.tiny", BIG, str(job), grid=GRID, log=lambda s: None), job


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


def _schedule(sets):
  value = lambda key, default: next((int(s.split("=")[1]) for s in sets if s.startswith(key + "=")), default)
  return (value("model.pipeline.stages", 1), value("model.pipeline.microbatches", 1),
          value("model.pipeline.circular_repeats", 1))


def test_a_pipelined_experiment_searches_stages_microbatches_repeats_and_model_axis():
  """lm.gpt3_175b_pipelined (96 layers, 512 chips): the pipelined grid tries several stage
  counts, circular repeats, microbatch counts and model-axis sizes, only schedules whose
  layers split and whose bubble is <= max_bubble, and its own layout without the pipeline."""
  from shardax.pipeline import bubble_fraction
  cfg = configs.get("lm.gpt3_175b_pipelined")
  found = plan.candidates(cfg, 512, plan.PIPELINED)
  piped = [c for c in found if _schedule(c)[0] > 1]
  schedules = {_schedule(c) for c in piped}
  assert len({s for s, _, _ in schedules}) >= 2 and len({r for _, _, r in schedules}) >= 2
  assert len({m for _, m, _ in schedules}) >= 3
  assert len({s for c in piped for s in c if s.startswith("mesh.ici=")}) >= 6   # model axis 4, 8, 16
  for s, m, r in schedules:
    assert 96 % (s * r) == 0 and bubble_fraction(s, m, r) <= plan.PIPELINED.max_bubble, (s, m, r)
  plain = [c for c in found if _schedule(c)[0] == 1]
  assert plain and all("model.pipeline.microbatches=1" in c for c in plain)
  for sets in found:  # the printed --set lines build
    cfg = configs.get("lm.gpt3_175b_pipelined")
    configs.apply_overrides(cfg, parsed(plan.set_line(sets)))
    configs.build(cfg)
  # ... also with pipeline-only options set, which are refused without a pipeline
  own = ["model.pipeline.delay_shift=True", "model.pipeline.grads_in_layout=False"]
  base = configs.get("lm.gpt3_175b_pipelined")
  configs.apply_overrides(base, own)
  for sets in plan.candidates(base, 512, plan.PIPELINED):
    cfg = configs.get("lm.gpt3_175b_pipelined")
    configs.apply_overrides(cfg, own + parsed(plan.set_line(sets)))
    configs.build(cfg)


@pytest.mark.slow
def test_plan_ranks_pipeline_schedules_by_predicted_step(tmp_path):
  """A 4-layer LM on v4:2x2x2 (8 chips): four pipeline schedules compiled for the TPU and
  ranked by the step model; every one fits and the ranking is by predicted step."""
  pytest.importorskip("libtpu")
  grid = plan.Grid(model_axis=(), remat=("none",), microbatches=(1,), fsdp=False, tp=False,
                   pipeline_stages=(2,), pipeline_model_axis=(1,), pipeline_microbatches_per_stage=(1, 2),
                   pipeline_repeats=(1, 2), max_bubble=0.5)
  sets = ["data.source='synthetic'", "model.num_layers=4", "model.d_model=128", "model.num_heads=4",
          "data.seq_len=64", "model.max_len=64", "train.global_batch=16", "mesh.topology='v4:2x2x2'",
          "mesh.num_cpu_devices=None"]
  p = _plan("lm.tiny_pipelined", sets, str(tmp_path), grid=grid, log=lambda s: None)
  ranked = [p["candidates"][i] for i in p["ranked"]]
  assert len(ranked) == 4, [(r["sets"], r["status"], r["reason"]) for r in p["candidates"]]
  steps = [r["predicted_step_seconds"] for r in ranked]
  assert steps == sorted(steps) and len({_schedule(r["sets"]) for r in ranked}) == 4


def test_a_pipeline_whose_microbatch_the_data_axis_does_not_divide_is_rejected():
  """Found while tracing, not at config time: the row says why instead of the plan stopping."""
  row = plan.evaluate("lm.tiny_pipelined", ["train.global_batch=8", "data.source='synthetic'"],
                      ["model.pipeline.microbatches=4"])
  assert row["status"] == "rejected" and "does not divide" in row["reason"], row


def test_a_multi_slice_experiment_plans_layouts_across_its_slices(tmp_path):
  """An experiment over 2 slices of v5e:2x2 (`mesh.dcn`): every candidate keeps the slices on
  its first axis (data across the slices; a pipeline's stages over them) and compiles. Before,
  the candidates set 2 or 3 mesh axes beside the experiment's `mesh.dcn`: on
  lm.gpt3_175b_4slices all 22 were rejected (a 3-entry dcn for 2 axes, or stage = 8 x 4)."""
  pytest.importorskip("libtpu")
  grid = plan.Grid(model_axis=(2,), remat=("full",), microbatches=(1,), fsdp=True, tp=False,
                   pipeline_stages=(2, 4), pipeline_model_axis=(1,), pipeline_microbatches_per_stage=(2,),
                   pipeline_repeats=(1,), max_bubble=1.0)
  sets = ["data.source='synthetic'", "model.num_layers=4", "model.d_model=64", "model.num_heads=4",
          "model.d_ff=128", "data.seq_len=32", "model.max_len=32", "train.global_batch=16",
          "mesh.topology='v5e:2x2'", "mesh.num_cpu_devices=None", "mesh.ici=(-1,1)", "mesh.dcn=(2,1)"]
  p = _plan("lm.tiny", sets, str(tmp_path), grid=grid, log=lambda s: None)
  assert p["num_devices"] == 8
  rows = p["candidates"]
  assert [r for r in rows if r["status"] != "ok"] == [], [(r["set_line"], r["reason"]) for r in rows]
  assert {_schedule(r["sets"])[0] for r in rows} == {1, 2, 4}
  assert all("mesh.dcn=(2, 1, 1)" in r["sets"] for r in rows if _schedule(r["sets"])[0] > 1)


def test_an_moe_pod_plans_data_across_its_slices_and_pipelines_over_them():
  """moe.maverick_4slices_1m (4 slices of 64 chips, expert axis 64 in each): the MoE grid keeps
  each slice's expert axis and tries data across the slices once per remat policy, the
  other expert-axis sizes that split the slice and the 128 experts with the experiment's
  remat, and pipelines with a stage per slice once per schedule whose bubble is small
  enough. Both registered layouts are among the candidates, and every printed --set line
  builds."""
  from shardax.pipeline import bubble_fraction
  cfg = configs.get("moe.maverick_4slices_1m")
  found = plan.candidates(cfg, 256, plan.MOE_PODS, slices=4)
  plain = [c for c in found if _schedule(c)[0] == 1]
  piped = [c for c in found if _schedule(c)[0] > 1]
  own = [c for c in plain if "mesh.ici=(1, 64)" in c]
  assert sorted(s for c in own for s in c if s.startswith("model.remat=")) == sorted(
      f"model.remat={r}" for r in plan.MOE_PODS.remat)
  other = {next(s for s in c if s.startswith("mesh.ici=")): next(s for s in c if s.startswith("model.remat="))
           for c in plain if c not in own}
  assert other == {"mesh.ici=(4, 16)": f"model.remat={cfg.model.remat}",
                   "mesh.ici=(2, 32)": f"model.remat={cfg.model.remat}"}, other
  assert all("mesh.dcn=(4, 1)" in c for c in plain), plain[0]
  assert all("mesh.ici=(1, 1, 64)" in c and "mesh.dcn=(4, 1, 1)" in c for c in piped), piped[0]
  assert {_schedule(c) for c in piped} >= {(4, 4, 6), (4, 4, 3), (4, 8, 2)}
  for s, m, r in map(_schedule, piped):
    assert bubble_fraction(s, m, r) <= plan.MOE_PODS.max_bubble, (s, m, r)
  registered = {n: configs.build(configs.get(n)) for n in ("moe.maverick_4slices_1m", "moe.maverick_4slices_1m_data")}
  built = []
  for sets in found:
    c = configs.get("moe.maverick_4slices_1m")
    configs.apply_overrides(c, parsed(plan.set_line(sets)))
    built.append(configs.build(c))
  for name, exp in registered.items():
    assert any(b.sharding.rules == exp.sharding.rules and b.model.remat == exp.model.remat
               and b.model.pipeline == exp.model.pipeline and tuple(b.mesh.axes) == tuple(exp.mesh.axes)
               for b in built), name
  # A dense model keeps the dense grid; an MoE model on one slice gets no pipeline.
  assert not plan._is_moe_pod(configs.get("lm.gpt3_175b_pipelined"))
  one = plan.candidates(configs.get("moe.deepseek_v3"), 1024, plan.MOE_PODS)
  assert all(_schedule(c)[0] == 1 for c in one)
  assert sorted({s for c in one for s in c if s.startswith("mesh.ici=")}) == [
      f"mesh.ici={ici}" for ici in ((16, 64), (32, 32), (4, 256), (64, 16), (8, 128))]


def test_an_moe_plan_over_two_slices_compiles_and_ranks_both_layouts(tmp_path):
  """moe.deepseek_tiny (a dense layer, then 4 MoE layers with bias balancing and a shared
  expert) over 2 slices of v5e:2x2, experts over each slice's 4 chips: data across the
  slices and a 2-stage pipeline over them both compile for the TPU and are ranked. In the
  stage body `grouped_matmul='auto'` picks megablox: the TPU compiler refuses the vmapped
  body's batched ragged_dot, which is refused by name when asked for."""
  pytest.importorskip("libtpu")
  grid = dataclasses.replace(plan.MOE_PODS, remat=("full",), pipeline_microbatches_per_stage=(2,),
                             pipeline_repeats=(1,), max_bubble=1.0)
  sets = ["data.source='synthetic'", "model.num_layers=5", "model.d_model=128", "model.moe.d_ff=128", "data.seq_len=32", "model.max_len=32", "train.global_batch=16",
          "mesh.topology='v5e:2x2'", "mesh.num_cpu_devices=None", "mesh.axes=('data','expert')",
          "mesh.ici=(1,4)", "mesh.dcn=(2,1)", "sharding.preset='expert_axis'",
          "model.moe.grouped_matmul='auto'"]
  written = []   # plan.json is rewritten after each candidate (a compiler abort loses no row)
  p = _plan("moe.deepseek_tiny", sets, str(tmp_path), grid=grid, log=lambda s: written.append(
      len(json.loads((tmp_path / "plan.json").read_text())["candidates"])))
  assert written == [1, 2]
  rows = p["candidates"]
  assert p["num_devices"] == 8 and len(rows) == 2
  assert [r for r in rows if r["status"] != "ok"] == [], [(r["set_line"], r["reason"]) for r in rows]
  assert sorted(_schedule(r["sets"]) for r in rows) == [(1, 1, 1), (2, 4, 1)]
  assert len(p["ranked"]) == 2 and json.loads((tmp_path / "plan.json").read_text())["ranked"] == p["ranked"]
  piped = next(r["sets"] for r in rows if _schedule(r["sets"])[0] == 2)
  row = plan.evaluate("moe.deepseek_tiny", sets + ["model.moe.grouped_matmul='ragged_dot'"], piped)
  assert row["status"] == "rejected" and "'ragged_dot' in a pipeline stage on a TPU" in row["reason"], row


def test_a_plan_whose_process_died_resumes_and_rejects_the_candidate_it_died_in(tmp_path):
  """libtpu aborts the process on some programs (a CHECK failure at effort -1); the planner
  writes which candidate it is compiling before each one, so the same command run again keeps
  the rows done, rejects that candidate with the reason and plans the rest. The first run is
  a real `--mode=plan` process, killed while it works on a candidate."""
  import os, signal, subprocess, sys, time
  pytest.importorskip("libtpu")
  sets = ["mesh.topology='v5e:2x2'", "data.source='synthetic'"]
  cmd = [sys.executable, "-m", "shardax.main", "--exp=lm.tiny", f"--job_dir={tmp_path}", "--mode=plan"]
  proc = subprocess.Popen(cmd + [w for s in sets for w in ("--set", s)], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  file, deadline = tmp_path / "plan.json", time.time() + 600
  while proc.poll() is None and time.time() < deadline:
    try:
      state = json.loads(file.read_text())
    except (FileNotFoundError, ValueError):   # not written yet, or caught mid-write
      state = {}
    if "sharding.preset=fsdp" in state.get("compiling", ""):   # the one that compiles: seconds, not ms
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.01)
  assert proc.wait() == -signal.SIGKILL, "the plan ended before it could be killed"
  died = json.loads(file.read_text())
  assert died["compiling"], died
  logs = []
  p = _plan("lm.tiny", sets, str(tmp_path), log=logs.append)
  rows = {r["set_line"]: r for r in p["candidates"]}
  assert any("resuming" in line and "died compiling" in line for line in logs), logs
  assert [rows[r["set_line"]] for r in died["candidates"]] == died["candidates"]   # kept, not redone
  assert rows[died["compiling"]]["status"] == "rejected" and "died compiling" in rows[died["compiling"]]["reason"]
  assert "compile_path" not in rows[died["compiling"]]
  assert len(p["candidates"]) == 27 and "compiling" not in json.loads(file.read_text())
  again = _plan("lm.tiny", ["data.source='synthetic'", "mesh.topology='v5e:2x2'"], str(tmp_path), log=logs.append)
  assert any("holds another plan" in line for line in logs)   # other overrides: planned afresh
  assert not any("died compiling" in (r["reason"] or "") for r in again["candidates"])
