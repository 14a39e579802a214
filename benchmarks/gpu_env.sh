#!/usr/bin/env bash
# shardax on a GPU machine that has jax with CUDA but no network and only part of shardax's
# dependencies (the lent H100 image: jax 0.11.2 + CUDA 13 plugin, flax 0.12.10, optax,
# orbax 0.12.4, numpy; no fiddle, grain, mlperf-logging, qwix).
#
#   bash benchmarks/gpu_env.sh download        # here, with network: wheels into .gpu/wheels
#   bash benchmarks/gpu_env.sh CMD ARGS...     # there: install them, run CMD with shardax importable
#
# e.g. on the GPU machine (with .gpu carried along):
#   bash benchmarks/gpu_env.sh python -m shardax.main --exp=lm.1b --job_dir=/tmp/b --mode=benchmark
#
# The wheels are the jax-0.11 tested set's (constraints-jax011.txt) for CPython 3.12, with
# --no-deps: only what the image lacks or has too old (flax 0.12.10 -> 0.12.12, orbax 0.12.4
# -> 0.12.8). They go to a target folder put first on PYTHONPATH, so the image is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpu/wheels}
PKGS="fiddle==0.3.1 libcst==1.9.0 graphviz==0.21 grain==0.2.18 cloudpickle==3.1.2 dm-tree==0.1.10
      array_record==0.8.6 mlperf-logging==4.1.68 flax==0.12.12 orbax-checkpoint==0.12.8
      simplejson==4.3.0 humanize==4.17.0 aiofiles==25.1.0 PyYAML==6.0.3 portpicker prometheus-client
      uvloop treescope wrapt qwix==0.1.8"

if [[ "${1:-}" == download ]]; then
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any $PKGS
  ls "$WHEELS"
  exit 0
fi

SITE=${SITE:-/tmp/shardax-site}
STAMP=$(ls "$WHEELS" | md5sum | cut -c1-12)   # reinstall when the wheel set changes
if [[ ! -e "$SITE/.stamp-$STAMP" ]]; then
  rm -rf "$SITE"
  python -m pip install -q --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl
  touch "$SITE/.stamp-$STAMP"
fi
mkdir -p "$SITE-pkg"
ln -sfn "$PWD" "$SITE-pkg/shardax"   # the checkout is the package (pyproject: package-dir)
export PYTHONPATH="$SITE-pkg:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# JAX_PLATFORMS is left alone: jax then starts the GPU (the default device) and the CPU
# client that the cost model (perf/costs.py) prices HLO on.
exec "$@"
