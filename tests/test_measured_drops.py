"""The dry run prints what its bet on balance was measured to drop (perf/measured_drops.py,
written by benchmarks/moe_drops.py --from_step0 --record), for the bet measured and no other."""

import dataclasses

import pytest

from shardax import configs
from shardax.perf import measured_drops

RAGGED = ["model.moe.dispatch='dropless'", "model.moe.top_k=2", "model.num_layers=2", "model.d_model=32",
          "model.moe.d_ff=32", "data.source='synthetic'", "data.seq_len=32", "model.max_len=32",
          "train.global_batch=8", "mesh.topology='v5e:2x2'", "mesh.ici=(4,)", "mesh.axes=('data',)",
          "model.moe.expert_overflow='drop'", "model.moe.expert_exchange='ragged'"]


def build(*sets):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, list(sets))
  return configs.build(cfg)


def recorded():
  entries = measured_drops.entries()
  assert entries, f"{measured_drops.MEASURED} is missing: run benchmarks/moe_drops.py --from_step0 --record"
  return entries[0]


def test_the_registered_bet_quotes_its_measurement():
  """moe.deepseek_v3's bet (ragged, 1.25, dropped) is the one recorded; the line quotes the
  record's figures. Another buffer, the padded exchange, or an error instead of a drop: no line."""
  e = recorded()
  moe = configs.build(configs.get("moe.deepseek_v3")).model.moe
  line = measured_drops.line(moe)
  assert line is not None
  for words in (f"buffer {e['expert_buffer']:g}", f"{e['steps']}-step run from initialization",
                f"dropped {e['run_fraction']:.2%} of its token copies", f"{e['worst_step'][1]:.2%} in its worst step"):
    assert words in line, (words, line)
  for change in (dict(expert_buffer=2.0), dict(expert_exchange="padded"), dict(expert_overflow="error"),
                 dict(expert_buffer=None)):
    assert measured_drops.line(dataclasses.replace(moe, **change)) is None, change


@pytest.mark.parametrize("buffer,printed", [(1.25, True), (1.5, False)])
def test_the_dry_run_prints_the_measured_bet(buffer, printed):
  """A dropless expert-parallel MoE on a v5e:2x2 slice (the ragged exchange compiles for TPU,
  not for XLA:CPU) at the recorded buffer: the dry run's report and its printed table carry the
  measurement under the bet; at another buffer, the bet alone."""
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  e = recorded()
  out = dry_run.dry_run(build(*RAGGED, f"model.moe.expert_buffer={buffer}"))
  assert out["balance_bet"]
  text = dry_run.format_report(out)
  if printed:
    assert out["balance_bet_measured"] and f"dropped {e['run_fraction']:.2%}" in out["balance_bet_measured"]
    assert out["balance_bet_measured"] in text
  else:
    assert not out["balance_bet_measured"] and "measured bet" not in text
