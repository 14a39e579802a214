"""The benchmark mode, the MLPerf-style log, time to train, and the model-FLOPs formula."""

import json
import os

import jax
import pytest

from shardax import configs
from shardax.sharding import make_mesh, use_rules
from shardax.perf import benchmark, flops, mlperf
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib

TINY = ["data.source='synthetic'", "model.vocab_size=256", "model.num_layers=2", "model.d_model=32",
        "model.num_heads=4", "model.d_ff=64", "model.max_len=16", "data.seq_len=16",
        "train.global_batch=8", "train.eval_batches=1", "train.benchmark_steps=4",
        "train.benchmark_warmup=1", "train.steps=4", "train.eval_every=2",
        "optimizer.warmup_steps=1"]


def _exp(*extra):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, TINY + list(extra))
  return configs.build(cfg)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  job_dir = str(tmp_path_factory.mktemp("bench"))
  result = benchmark.run(_exp("train.profile_steps=(2, 3)"), job_dir)
  return job_dir, result


def test_benchmark_json_has_every_key_and_consistent_values(bench):
  job_dir, result = bench
  with open(os.path.join(job_dir, "benchmark.json")) as f:
    r = json.load(f)
  assert set(benchmark.KEYS) <= set(r), set(benchmark.KEYS) - set(r)
  exp = _exp()
  assert r["device_count"] == jax.device_count() and r["platform"] == "cpu"
  assert len(r["step_times_s"]) == exp.train.benchmark_steps == r["steps"]
  assert r["step_time_s_p10"] <= r["step_time_s_median"] <= r["step_time_s_p90"]
  assert r["tokens_per_step"] == 8 * 16
  assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s_median"])
  assert r["model_flops_per_step"] == pytest.approx(flops.per_step(exp.model, 8, 16))
  assert r["tflops_per_device"] == pytest.approx(
      r["model_flops_per_step"] / r["step_time_s_median"] / r["device_count"] / 1e12)
  assert r["mfu"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops_per_device"])
  _check_mfu_independently(r, os.path.join(job_dir, "mllog.txt"))
  assert r["peak_source"].startswith("measured")  # a CPU's peak comes from the matmul probe
  assert r["eval_loss"] > 0
  assert r["state_donated"] is True
  traces = [f for _, _, fs in os.walk(os.path.join(job_dir, "profile")) for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces
  table = benchmark.format_table(r)
  for word in ("step_time_s", "tokens_per_s", "mfu", "peak_tflops_per_device"):
    assert word in table


def _check_mfu_independently(r, mllog_path):
  """MFU = FLOPs / time / peak, each side recomputed here without the benchmark's code:
  the FLOPs counted by hand for TINY, the median of the raw step times, the peak from
  the probe's best sample; and the step times checked against the log's own clock."""
  d, h, dh, ff, v, layers, s, b = 32, 4, 8, 64, 256, 2, 16, 8
  per_token = 2 * (4 * d * h * dh + 3 * d * ff + 2 * h * dh * s / 2) * layers + 2 * d * v
  flops_per_step = 3 * per_token * s * b                          # backward = 2 x forward
  times = sorted(r["step_times_s"])
  median = (times[len(times) // 2] + times[(len(times) - 1) // 2]) / 2
  peak = r["probe_best_flops"] / r["device_count"]                # a CPU: the host's best matmul
  assert r["mfu"] == pytest.approx(flops_per_step / median / r["device_count"] / peak, rel=1e-9)
  assert r["peak_tflops_per_device"] == pytest.approx(peak / 1e12, rel=1e-9)
  # The timed steps lie inside the log's run (run_start .. epoch_stop, mlperf's own clock).
  stamps = {ll.key: ll.timestamp / 1000 for ll in mlperf.read(mllog_path)[0]}  # time_ms
  assert sum(times) <= stamps["epoch_stop"] - stamps["run_start"] + 0.01
  # The probe sampled between the steps (one per step after five up front), and no step
  # ran faster than the host's best matmul rate would allow.
  assert r["probe_samples"] == r["steps"] + benchmark.PROBE_REPEATS
  assert r["probe_median_flops"] <= r["probe_best_flops"]
  assert 0 < r["mfu"] < 1


def test_benchmark_mllog_passes_the_mlperf_checker(bench):
  job_dir, _ = bench
  path = os.path.join(job_dir, "mllog.txt")
  assert mlperf.check(path) == {}
  keys = [ll.key for ll in mlperf.read(path)[0]]
  order = ["init_start", "init_stop", "run_start", "block_start", "block_stop", "eval_accuracy",
           "run_stop"]
  assert [keys.index(k) for k in order] == sorted(keys.index(k) for k in order)
  assert mlperf.read(path)[0][-1].value["metadata"]["status"] == "success"


def test_mllog_checker_catches_a_broken_log(bench, tmp_path):
  job_dir, _ = bench
  lines = open(os.path.join(job_dir, "mllog.txt")).read().splitlines()
  broken = tmp_path / "mllog.txt"
  broken.write_text("\n".join(l for l in lines if '"run_stop"' not in l) + "\n")
  assert "run_stop" in mlperf.check(str(broken))


def _ttt(job_dir, target, *extra):
  """time_to_train of the tiny LM (6 steps, an eval every 2) and its log's lines."""
  r = mlperf.time_to_train(_exp("train.steps=6", f"train.target_eval_loss={target!r}", *extra), str(job_dir))
  path = str(job_dir / "mllog.txt")
  assert mlperf.check(path) == {}
  lines = mlperf.read(path)[0]
  assert [ll.value["value"] for ll in lines if ll.key == "eval_accuracy"] == list(r["eval_losses"].values())
  assert lines[-1].key == "run_stop"
  assert json.load(open(job_dir / "time_to_train.json"))["reached"] is r["reached"]
  return r, lines[-1].value["metadata"]["status"]


@pytest.fixture(scope="module")
def not_reached(tmp_path_factory):
  """A target no 6-step run can meet: it trains every step, then the run is logged aborted."""
  return _ttt(tmp_path_factory.mktemp("ttt_miss"), 1e-3)


def test_time_to_train_aborts_when_the_target_is_out_of_reach(not_reached):
  r, status = not_reached
  assert r["reached"] is False and status == "aborted"
  assert r["steps"] == 6 and sorted(r["eval_losses"]) == [2, 4, 6]
  assert r["final_eval_loss"] == r["eval_losses"][6] > 1e-3


def test_time_to_train_stops_at_the_first_eval_that_meets_the_target(not_reached, tmp_path):
  """Target = the step-4 eval loss of the same seeded run, which step 2 does not meet: the
  run must stop after the step-4 eval (not at the first eval, not at train.steps)."""
  evals = not_reached[0]["eval_losses"]
  assert evals[4] < evals[2], evals
  r, status = _ttt(tmp_path, evals[4])
  assert r["reached"] is True and status == "success"
  assert r["steps"] == 4 and sorted(r["eval_losses"]) == [2, 4] and r["time_to_train_s"] > 0
  assert r["eval_losses"][4] == pytest.approx(evals[4], rel=1e-6)


def test_benchmark_and_time_to_train_run_a_vision_experiment(tmp_path):
  """A model without a vocabulary (conv.digits) goes through both benchmark paths."""
  cfg = configs.get("conv.digits")
  configs.apply_overrides(cfg, ["model.channels=4", "train.global_batch=8", "train.eval_batches=1",
                                "train.benchmark_steps=2", "train.benchmark_warmup=1",
                                "train.steps=2", "train.eval_every=2", "train.target_eval_loss=1e-6"])
  exp = configs.build(cfg)
  r = benchmark.run(exp, str(tmp_path / "bench"))
  assert r["exp"] == "conv.digits" and r["eval_loss"] > 0 and len(r["step_times_s"]) == 2
  t = mlperf.time_to_train(exp, str(tmp_path / "ttt"))
  assert t["reached"] is False and t["steps"] == 2 and t["final_eval_loss"] > 0


def test_flops_formula_matches_a_hand_count():
  exp = _exp("model.num_kv_heads=2", "model.d_model=64", "model.d_ff=128", "data.seq_len=16")
  m, s = exp.model, exp.data.seq_len
  d, h, kv, dh, ff, v, layers = 64, 4, 2, 16, 128, 256, 2
  # Forward FLOPs per token: 2 per multiply-add of each matmul.
  proj = 2 * (d * h * dh + 2 * d * kv * dh + h * dh * d)      # q, k, v, out
  mlp = 2 * 3 * d * ff                                         # gate, up, down
  scores = 2 * 2 * h * dh * s / 2                              # q.k and p.v, causal half
  head = 2 * d * v                                             # tied output head
  forward = layers * (proj + mlp + scores) + head
  assert m.flops_per_example(exp.data) == pytest.approx(3 * forward * s)  # backward = 2x forward
  # Every parameter but the norm scales is a matmul weight (the table doubles as the head).
  with jax.set_mesh(make_mesh(exp.mesh, jax.devices()[:1])):
    setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  norms = (2 * layers + 1) * d
  assert flops.matmul_params(m) == state_lib.count_params(setup) - norms


def test_flops_formula_agrees_with_the_compiler():
  """cost_analysis() of the compiled step, one device, layers unrolled (XLA counts a
  scan body once), no remat. The compiler computes the full attention score matrix
  (the causal half too) and counts elementwise work (softmax, norms, AdamW), which the
  model-FLOPs convention leaves out: so it must lie within +10% of the formula plus the
  masked half of attention and the embedding lookup, a one-hot matmul at this vocab size
  (layers/embedding.py: 2 x tokens x vocab x embed forward, the same again for its gradient)."""
  exp = _exp("model.scan_layers=False", "model.remat='none'", "model.d_model=64",
             "model.d_ff=128", "data.seq_len=16")
  mesh = make_mesh(exp.mesh, jax.devices()[:1])
  setup = state_lib.create(exp, mesh)
  with jax.set_mesh(mesh), use_rules(setup.rules, False):
    compiled = step_lib.compile_train_step(setup)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  m, s, b = exp.model, exp.data.seq_len, exp.train.global_batch
  formula = flops.per_step(m, b, s)
  masked_half = 12 * m.num_layers * s * m.num_heads * m.dim_per_head / 2 * b * s
  lookup = 4 * b * s * m.vocab_size * m.d_model
  ratio = cost["flops"] / (formula + masked_half + lookup)
  assert 1.0 <= ratio <= 1.10, (cost["flops"], formula, ratio)


def test_accelerator_peak_comes_from_the_chip_table():
  """The GPU/TPU path, without one: a device record as jax reports it (platform, device_kind)."""
  from types import SimpleNamespace
  h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  peak, source = benchmark.peak_flops_per_device([h100], "bfloat16")
  assert peak == 989e12 and source.startswith("chip table: NVIDIA H100")
  v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  assert benchmark.peak_flops_per_device([v5e], "float32")[0] == 197e12
