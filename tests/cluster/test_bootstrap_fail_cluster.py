"""A failed first boot is reported, not waited on, on the real local cluster.

One GPU host's bootstrap is re-run with its stand-in GPU file gone: the `gpus` step fails and
records it (node_layout.STEPS_DIR). `fab status` and `fab train` then name the host, the step and
the last lines of the step's log, and exit non-zero at once; re-running the bootstrap once the
GPU is back clears it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bootstrap import node_layout
from cluster import hostpaths
from cluster.targets.local import LOCAL_SKIP_STEPS
from localcluster import topology as layout
from tests.cluster.test_node_loss import on
from tests.support.local_cluster import fresh_cluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
HOST = "gpu-node-02"


def fab(*args):
    env = {**os.environ, "SLURM_GPU_RUNS": "/nonexistent-runs"}
    res = subprocess.run([FAB, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    return res.returncode, res.stdout + res.stderr


def bootstrap(host: str) -> subprocess.CompletedProcess:
    skip = " ".join(LOCAL_SKIP_STEPS["gpu"])
    return on(host, "env", f"SLURM_GPU_SKIP_STEPS={skip}", "bash", hostpaths.BOOTSTRAP_PATH)


def test_a_failed_bootstrap_step_is_named_by_fab_status_and_fab_train():
    with fresh_cluster(nodes=2, gpus=1):
        rc, out = fab("status", "--target", "local")
        assert rc == 0, out
        gpu = layout.host_dir(HOST) / "lib-slurm" / Path(layout.GPU_DEVICE_PREFIX).parent.name / "nvidia0"
        gpu.unlink()
        try:
            res = bootstrap(HOST)
            assert res.returncode != 0
            rc, out = fab("status", "--target", "local")
            assert rc != 0, out
            assert f"note: {HOST}: bootstrap step 'gpus' failed (exit 1 at line" in out
            assert f"last lines of {node_layout.STEPS_DIR}/gpus.log" in out
            assert f"| slurm-gpu-bootstrap(gpu): GPU check: missing {layout.GPU_DEVICE_PREFIX}0" in out
            assert f"first boot failed on {HOST}" in out
            assert "gpu-node-01: bootstrap" not in out  # the healthy host is not blamed
            rc, out = fab("train", "--target", "local", "--examples", "16")
            assert rc != 0, out
            assert f"bootstrap failed on {HOST}" in out and f"{HOST}: bootstrap step 'gpus' failed" in out
            assert "submitted job" not in out  # nothing was started on a half-booted cluster
        finally:
            gpu.touch()
        assert bootstrap(HOST).returncode == 0
        # Slurm's health check may have run while the GPU was missing: its drain stays until the user
        # resumes the node, as `fab status` says (docs/FAULTS.md). Not this test's subject: resume it.
        reason = on("controller", "sinfo", "-h", "-n", HOST, "-o", "%E").stdout.strip()
        if reason.startswith("slurm-gpu-healthcheck"):
            rc, out = fab("status", "--target", "local")
            assert f"scontrol update nodename={HOST} state=resume" in out, out
            assert on("controller", "scontrol", "update", f"nodename={HOST}", "state=resume").returncode == 0
        rc, out = fab("status", "--target", "local")
        assert rc == 0, out
