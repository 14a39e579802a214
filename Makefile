# Two commands do everything on a fresh machine with Python 3.11+:
#   make run    set up .venv and train the default experiment (lm.tiny) on this machine's CPU
#   make test   set up .venv and run the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
JOB_DIR ?= /tmp/shardax-runs/lm.tiny
EXP ?= lm.tiny
export TF_CPP_MIN_LOG_LEVEL ?= 3
# One tested set per Python (pyproject gives each its jax line): constraints.txt for 3.11
# (jax 0.10.2), constraints-jax011.txt for 3.12+ (jax 0.11.2).
CONSTRAINTS ?= $(shell $(PYTHON) -c 'import sys; print("constraints-jax011.txt" if sys.version_info >= (3, 12) else "constraints.txt")')

.PHONY: setup run test test-slow
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]' -c $(CONSTRAINTS)
	touch $@

run: setup
	$(VENV)/bin/shardax --exp=$(EXP) --job_dir=$(JOB_DIR)

test: setup
	JAX_COMPILATION_CACHE_DIR=$${JAX_COMPILATION_CACHE_DIR:-$(HOME)/.cache/shardax/jax_cache} \
	  $(VENV)/bin/python -m pytest -n 2 -q --durations=15

test-slow: setup
	$(VENV)/bin/python -m pytest -q -m slow
