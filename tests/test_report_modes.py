"""The table of modes (main.py `MODES`) is the truth about what each mode may touch. Modes
without the job dir's lease may run beside a live training job, so they never write that
job's config.txt, config.json or log.txt: a mode whose entry names a prefix writes its own
(dry_run.config.json, dry_run.log.txt, ...), the others write no config or log. Real
`python -m shardax.main` processes on a real job dir."""

import json

from clitools import command, run

from shardax import main as cli

JOB_FILES = ("config.json", "config.txt", "log.txt")
# The modes without the lease that run in seconds on a trained lm.tiny job, with the flags
# they need; the others are left out by name, with why. A mode added to the table is one or
# the other, or the test fails.
CHEAP = {"eval": [], "decode": ["--max_new_tokens=2"], "explain": [], "dry_run": [], "plan": [],
         "goodput": []}
LEFT_OUT = {"export": "needs an hf:DIR experiment (tests/test_hf.py exports one)"}


def _configs_and_logs(job) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in job.iterdir() if p.name.endswith(JOB_FILES)}


def test_modes_without_the_lease_leave_a_trained_jobs_files_byte_identical(tmp_path):
  """A one-step train run writes the job's three files; every mode the table says holds no
  lease, run with another config (train.steps=7), leaves them byte for byte as they were,
  and writes a config and log exactly where its entry's `writes` says (none, or under its
  prefix, holding steps=7). Fails when a mode writes the job's config or opens its log,
  when a runner writes a config or log its entry does not declare (or omits one it does),
  and when a mode without the lease is added to the table but neither run here nor left
  out by name."""
  unleased = {name for name, mode in cli.MODES.items() if mode.needs_job and not mode.leased}
  assert unleased == set(CHEAP) | set(LEFT_OUT), "run the new mode here, or say in LEFT_OUT why not"
  job, data = tmp_path / "job", tmp_path / "data"
  trained = run(command(job, data, "train.steps=1"))   # with its checkpoint: eval and decode restore it
  assert trained.returncode == 0, trained.stderr[-3000:]
  before = {f: (job / f).read_bytes() for f in JOB_FILES}
  assert all(before.values()), before.keys()
  for name, extra in CHEAP.items():
    seen = _configs_and_logs(job)
    proc = run(command(job, data, "train.steps=7", "data.source='synthetic'", mode=name, extra=extra))
    assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert {f: (job / f).read_bytes() for f in JOB_FILES} == before, name
    now = _configs_and_logs(job)
    written = {f for f in now if now[f] != seen.get(f)}
    prefix = cli.MODES[name].writes
    assert written == (set() if prefix is None else {prefix + f for f in JOB_FILES}), name
    if prefix is not None:
      assert json.loads(now[f"{prefix}config.json"])["train"]["steps"] == 7, name
      assert b"train.steps = 7" in now[f"{prefix}config.txt"] and now[f"{prefix}log.txt"], name
  assert (job / "dry_run.json").exists() and (job / "explain.json").exists()
  # plan rebuilds each candidate from the experiment and the --sets the command line gave
  assert json.loads((job / "plan.json").read_text())["overrides"][-2:] == ["train.steps=7",
                                                                           "data.source='synthetic'"]
  assert json.loads((job / "config.json").read_text())["train"]["steps"] == 1


def test_a_tpu_topology_is_refused_by_the_modes_that_run_here(tmp_path):
  """`mesh.topology` names TPUs that are not here: a mode whose entry does not accept one
  (train, the default) stops with exit status 2 before touching the job dir, naming the
  modes whose entries do."""
  job = tmp_path / "job"
  proc = run(command(job, tmp_path / "data", "mesh.topology='v5e:2x2'", mode="train"))
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert ("mesh.topology='v5e:2x2' describes TPUs that are not here; use it with --mode=dry_run, "
          "--mode=explain or --mode=plan") in proc.stderr, proc.stderr[-3000:]
  assert not job.exists()
