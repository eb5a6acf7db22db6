"""Ctrl-C while the boot test's containers boot leaves nothing behind: no container, process,
mount, cgroup or bridge (the same teardown runs on success and failure), on each boot platform."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.boot.test_boot_cluster import BOOT_PLATFORMS

REPO = Path(__file__).resolve().parents[2]
LOCK = "/tmp/sgpu-boottest.lock"

pytestmark = [pytest.mark.boot, pytest.mark.slow]


@pytest.mark.parametrize("platform", BOOT_PLATFORMS, ids=lambda p: p.name)
def test_ctrl_c_during_boot_leaves_nothing(platform):
    import fcntl

    from boottest import boot_cluster as cluster
    from boottest import nspawn, teardown

    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-m", "boottest", platform.name], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            run = cluster.STATE_ROOT / "run"
            deadline = time.monotonic() + 600
            started = []
            while time.monotonic() < deadline and len(started) < 3:  # all three booting (systemd up)
                started = [c for c in teardown.containers(run)
                           if (c.state / "wrapper.pid").exists() and c.pid1() is not None]
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.5)
            assert len(started) == 3, "the containers did not start"
            assert [p for c in started for p in nspawn._cgroup_procs(c.cgroups()[0])]
            os.kill(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                teardown.everything()
    assert "interrupted; tearing down" in out and "left: nothing" in out, out
    assert proc.returncode == 0, out
    assert teardown.leftovers() == []
