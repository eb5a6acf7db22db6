"""`fab train --data FILE` with a JSONL that exists only on the user's side, on the real local cluster: uploaded
once to /scratch/uploads/<sha256>/<name>, trained on, recorded in run.json; the same file a second time is
found there and not uploaded again. An interrupted or changed upload leaves nothing under the final name and
no temporary file."""

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from localcluster import topology as layout
from ops.finetune import upload
from ops.ssh.remote import connect
from tests.support.local_cluster import fresh_cluster
from tests.unit.test_upload import alpaca_jsonl

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
UPLOADS = layout.SCRATCH / upload.UPLOADS  # /scratch/uploads as this machine sees it

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def lc():
    with fresh_cluster(nodes=1, gpus=1) as (inv, job_dirs):
        cl = connect(inv)
        try:
            yield inv, cl, job_dirs
        finally:
            cl.close()
            subprocess.run(["rm", "-rf", str(UPLOADS)], check=False)


@pytest.fixture(scope="module")
def user_side(tmp_path_factory):
    """A directory on the user's side only: the file's bytes are nowhere on the cluster's scratch."""
    return tmp_path_factory.mktemp("user-side")


def fab_train(runs: Path, data: Path, job_dirs: list[str]) -> str:
    res = subprocess.run([FAB, "train", "--target", "local", "--skip-check", "--data", str(data)], cwd=REPO,
                         env={**os.environ, "SLURM_GPU_RUNS": str(runs)}, capture_output=True, text=True,
                         timeout=500)
    out = res.stdout + res.stderr
    if m := re.search(r"submitted job (\d+): .* in (\S+);", out):
        job_dirs.append(m[2])
    assert res.returncode == 0, out
    return out


def run_record(runs: Path) -> dict:
    (record,) = runs.glob("*/run.json")
    return json.loads(record.read_text())


def test_a_local_jsonl_is_uploaded_once_trained_on_and_recorded(lc, user_side, tmp_path):
    inv, cl, job_dirs = lc
    path = user_side / "mine.jsonl"
    sha = hashlib.sha256(alpaca_jsonl(path, 48)).hexdigest()
    home = UPLOADS / sha / "mine.jsonl"
    assert not home.exists()

    out = fab_train(tmp_path / "first", path, job_dirs)
    assert f"--data: local file {path} (" in out and "48 rows, format alpaca" in out, out
    assert "sha256 verified on the controller" in out, out
    assert home.read_bytes() == path.read_bytes() and oct(home.stat().st_mode & 0o777) == "0o644"
    assert not list(UPLOADS.glob(".partial-*"))
    rec = run_record(tmp_path / "first")
    assert rec["data"] == f"/scratch/uploads/{sha}/mine.jsonl"
    assert rec["data_source"] | {} == {"kind": "local file", "path": str(path), "sha256": sha,
                                       "bytes": path.stat().st_size, "rows": 48, "format": "alpaca",
                                       "cluster_path": rec["data"], "uploaded": True}
    stamp = home.stat().st_mtime_ns

    out = fab_train(tmp_path / "second", path, job_dirs)  # the same file again: nothing uploaded
    assert f"already on the cluster at /scratch/uploads/{sha}/mine.jsonl (same sha256), not uploaded" in out, out
    assert "uploading" not in out and "sha256 verified" not in out, out
    assert home.stat().st_mtime_ns == stamp
    assert run_record(tmp_path / "second")["data_source"]["uploaded"] is False
