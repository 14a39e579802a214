"""Eight simulated CPU devices for every test, set before jax initializes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
