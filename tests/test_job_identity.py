"""The job dir's identity (trainer/jobdir.py `identity`): made once with the job dir's first
files, the same for every later run and process, and new when the job dir is deleted and
made again, locally and in a gs:// bucket."""

import shutil

import pytest

from shardax.trainer import jobdir

try:   # the gs:// emulator fixture, where the test extra is installed
  from test_cloud import BUCKET, emulator  # noqa: F401
except pytest.skip.Exception:
  BUCKET = emulator = None


def test_the_identity_is_made_once_and_dies_with_the_job_dir(tmp_path):
  job = tmp_path / "job"
  first = jobdir.identity(job)
  assert first and jobdir.identity(job) == first and jobdir.identity(str(job), primary=False) == first
  (job / jobdir.IDENTITY_FILE).write_text("{cut")        # damaged: a new one, never a crash
  second = jobdir.identity(job)
  assert second != first and jobdir.identity(job) == second
  shutil.rmtree(job)                                      # rm -rf JOB
  assert jobdir.identity(job) not in (first, second)


def test_a_process_that_is_not_primary_waits_for_it_then_says_what_is_wrong(tmp_path):
  with pytest.raises(FileNotFoundError, match="every process must see the same --job_dir"):
    jobdir.identity(tmp_path / "never", primary=False, timeout_s=0.3)


@pytest.mark.skipif(emulator is None, reason="the test extra (fake-gcs-server, gcsfs) is not installed")
def test_the_identity_lives_in_a_gs_job_dir(emulator):
  from etils.epath import gpath
  _, fs = emulator
  url = f"gs://{BUCKET}/identity"
  gpath._is_tf_installed.cache_clear()   # epath decides its client once: now fsspec (EPATH_USE_TF=false)
  try:
    first = jobdir.identity(url)
    assert jobdir.identity(url) == first and jobdir.identity(url, primary=False) == first
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/identity/{jobdir.IDENTITY_FILE}")
    fs.rm(f"{BUCKET}/identity", recursive=True)
    fs.invalidate_cache()
    assert jobdir.identity(url) != first
  finally:
    gpath._is_tf_installed.cache_clear()
