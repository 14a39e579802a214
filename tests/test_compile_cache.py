"""The persistent compilation cache (trainer/compile_cache.py): where it goes, and a second
process running the same program reads it instead of compiling."""

import os
import subprocess
import sys

from shardax.trainer import compile_cache

PROGRAM = """
import sys, jax, jax.numpy as jnp
from shardax.trainer import compile_cache
compile_cache.enable(sys.argv[1], "/unused")
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
print(compile_cache.summary())
"""


def test_setting_names_the_directory():
  env = {"JAX_COMPILATION_CACHE_DIR": "/ci/cache", "XDG_CACHE_HOME": "/xdg"}
  assert compile_cache.resolve(None, "/job", env) == "/ci/cache"   # make test's explicit dir wins
  assert compile_cache.resolve(None, "/job", {"XDG_CACHE_HOME": "/xdg"}) == "/xdg/shardax/jax_cache"
  assert compile_cache.resolve(None, "/job", {}) == os.path.expanduser("~/.cache/shardax/jax_cache")
  assert compile_cache.resolve("job_dir", "/job", env) == "/job/jax_cache"
  assert compile_cache.resolve("", "/job", env) is None
  assert compile_cache.resolve("/elsewhere", "/job", env) == "/elsewhere"


def test_a_second_process_hits_the_cache(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  run = lambda: subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "cache")],  # noqa: E731
                               capture_output=True, text=True, env=env, timeout=120)
  first, second = run(), run()
  assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
  assert first.stdout.startswith("0 compilation cache hits"), first.stdout
  assert not second.stdout.startswith("0 "), second.stdout   # read back, not compiled
  assert os.listdir(tmp_path / "cache")
