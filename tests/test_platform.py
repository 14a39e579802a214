"""The platform choice over its inputs, and the first log line of a real run."""

import os
import sys

import pytest

import clitools as cli
from shardax.trainer import platform
from shardax.trainer.platform import Machine

# (libtpu installed, TPU attached, GPU attached, JAX_PLATFORMS given) -> JAX_PLATFORMS we set
CASES = [
    (False, False, None, None, None),          # plain CPU machine: jax finds its CPU
    (True, False, None, None, "cpu"),           # test extra on a laptop: keep jax off the absent TPU
    (True, True, None, None, None),             # TPU VM: jax finds the TPU
    (True, False, "cuda", None, "cuda,cpu"),    # GPU machine with libtpu installed: the GPU, not the CPU
    (False, False, "cuda", None, None),         # GPU machine: jax finds the GPU
    (True, False, "rocm", None, "rocm,cpu"),
    (True, True, "cuda", None, None),           # both: jax's own order (TPU first)
    (True, False, None, "tpu", None),           # the user's JAX_PLATFORMS always wins ...
    (True, False, "cuda", "cpu", None),         # ... even to run on the CPU beside a GPU
    (False, False, None, "cpu", None),
]


@pytest.mark.parametrize("libtpu, tpu, gpu, given, expected", CASES)
def test_choice_over_its_inputs(libtpu, tpu, gpu, given, expected):
  choice = platform.choose(Machine(libtpu=libtpu, tpu=tpu, gpu=gpu, jax_platforms=given))
  assert choice.jax_platforms == expected
  assert choice.why


def test_an_accelerator_is_never_hidden():
  for libtpu in (False, True):
    for gpu in ("cuda", "rocm"):
      choice = platform.choose(Machine(libtpu=libtpu, tpu=False, gpu=gpu))
      assert choice.jax_platforms in (None, f"{gpu},cpu")


def test_apply_sets_jax_platforms_only_when_it_must(monkeypatch):
  env = {"JAX_PLATFORMS": "tpu"}
  assert platform.apply(env).jax_platforms is None and env == {"JAX_PLATFORMS": "tpu"}
  monkeypatch.setattr(platform, "probe", lambda environ: Machine(libtpu=True, tpu=False, gpu=None))
  env = {}
  assert platform.apply(env).jax_platforms == "cpu" and env == {"JAX_PLATFORMS": "cpu"}


def test_cpu_collectives_only_without_an_accelerator(monkeypatch):
  assert platform.is_cpu_only({"JAX_PLATFORMS": "cpu"})
  assert not platform.is_cpu_only({"JAX_PLATFORMS": "cuda,cpu"})
  monkeypatch.setattr(platform, "probe", lambda environ: Machine(libtpu=False, tpu=False, gpu="cuda"))
  assert not platform.is_cpu_only({})


# What libtpu prints when jax starts it on a machine with no TPU (its three startup lines).
LIBTPU_CHATTER = ("host bounds", "InitGoogle", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "libtpu.so",
                  "libtpu_init_utils")


def user_environment() -> dict:
  """This process's environment without what the test harness adds (conftest.py, clitools.env):
  no JAX_PLATFORMS, device count or log level, as a user's shell has it."""
  drop = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS")
  return {k: v for k, v in os.environ.items() if k not in drop}


def shardax_command() -> list[str]:
  """The installed console script beside this Python, else the module it runs."""
  script = os.path.join(os.path.dirname(sys.executable), "shardax")
  return [script] if os.path.exists(script) else [sys.executable, "-m", "shardax.main"]


def test_first_log_line_names_platform_and_devices_and_libtpu_stays_silent(tmp_path):
  """A real dry run as a user starts it (JAX_PLATFORMS unset, no log level set) on this
  machine (with the test extra: libtpu installed, no TPU). Importing shardax imports jax
  before main.py decides the platform; had the decision not reached jax's config, jax would
  start libtpu, which prints three lines before the platform line."""
  args = cli.command(tmp_path / "job", tmp_path / "data", "mesh.num_cpu_devices=2", "mesh.ici=(2, 1)",
                     "train.steps=1", mode="dry_run")
  args = shardax_command() + args[3:]   # [python, -m, shardax.main, ...] -> [shardax, ...]
  out = cli.subprocess.run(args, capture_output=True, text=True, env=user_environment(), timeout=240,
                           cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  # The first line on the (quiet) terminal: the platform status line, also in log.txt.
  logged = [l for l in out.stderr.splitlines() if l.strip()]
  libtpu = platform.probe(user_environment()).libtpu
  expected = ("platform cpu: 2 devices, 2 local; one process; libtpu installed but no TPU or GPU attached"
              if libtpu else "platform cpu: 2 devices, 2 local; one process")
  assert logged and expected in logged[0], logged[:3]
  chatter = [l for l in logged if any(s in l for s in LIBTPU_CHATTER)]
  assert not chatter, chatter


def test_importing_shardax_as_a_library_keeps_jax_off_an_absent_tpu(tmp_path):
  """A notebook or script that imports shardax and then uses jax (no CLI, JAX_PLATFORMS
  unset): with libtpu installed and no TPU, the first jax call must not start libtpu."""
  code = "import shardax, jax; print(jax.default_backend(), len(jax.devices()))"
  out = cli.subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=user_environment(), timeout=120, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  chatter = [l for l in out.stderr.splitlines() if any(s in l for s in LIBTPU_CHATTER)]
  assert not chatter, chatter
  assert out.stdout.split()[0] in ("cpu", "gpu", "tpu"), out.stdout
