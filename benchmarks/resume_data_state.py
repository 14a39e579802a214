"""Data-ready time after a resume at step 6, 60 and 600: set_state + the first batch, vs.
replaying from the start (what other processes did before each saved its own state).

  .venv/bin/python benchmarks/resume_data_state.py
"""
import json, tempfile, time
from shardax.configs.data import DataConfig
from shardax.trainer.data import inputs, preparation
d = tempfile.mkdtemp()
preparation.prepare(DataConfig(source="stdlib", data_dir=d))
cfg = DataConfig(source="stdlib", data_dir=d, seq_len=256, seed=3)
B = 32
for n in (6, 60, 600):
  for saved_on, resumed_on in ((2, 2), (4, 2)):
    its = [inputs.Batches(cfg, "train", B, process_index=p, process_count=saved_on) for p in range(saved_on)]
    for _ in range(n):
      for it in its: next(it)
    states = [json.loads(json.dumps(it.get_state())) for it in its]
    best = 1e9
    for _ in range(3):
      new = inputs.Batches(cfg, "train", B, process_index=1, process_count=resumed_on)
      t = time.perf_counter()
      replayed = new.set_state(states[1] if saved_on == resumed_on else states)
      next(new)
      best = min(best, time.perf_counter() - t)
      new.close()
    # the old path: replay n batches from the start
    old = inputs.Batches(cfg, "train", B, process_index=1, process_count=resumed_on)
    t = time.perf_counter()
    for _ in range(n + 1): next(old)
    print(f"step {n:4d} saved on {saved_on} resumed on {resumed_on}: replayed {replayed}, data ready {best*1e3:.0f} ms; replaying from the start {1e3*(time.perf_counter()-t):.0f} ms")
