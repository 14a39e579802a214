"""The platform choice over its inputs, and the first log line of a real run."""

import os

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


def test_first_log_line_names_platform_and_devices(tmp_path):
  """A real run with JAX_PLATFORMS unset on this machine (libtpu installed, no TPU)."""
  env = cli.env(devices=2)
  env.pop("JAX_PLATFORMS")
  args = cli.command(tmp_path / "job", tmp_path / "data", "mesh.num_cpu_devices=2", "mesh.ici=(2, 1)",
                     "train.steps=1", mode="dry_run")
  out = cli.subprocess.run(args, capture_output=True, text=True, env=env, timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  # The first line on the (quiet) terminal: the platform status line, also in log.txt.
  logged = [l for l in out.stderr.splitlines() if l.strip()]
  expected = ("platform cpu: 2 devices, 2 local; one process; libtpu installed but no TPU or GPU attached"
              if platform.probe(os.environ).libtpu else "platform cpu: 2 devices, 2 local; one process")
  assert expected in logged[0], logged[:3]
