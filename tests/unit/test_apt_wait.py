"""The bootstrap's packages step waits for another apt: apt's own DPkg::Lock::Timeout for the dpkg
locks, and a retry while another apt holds a lock that setting does not cover (apt-daily's `apt-get
update` holds the lists' lock). Any other apt failure fails the step at once. Run for real with a
stand-in apt-get on PATH (it fails as apt does, then succeeds)."""

from __future__ import annotations

import subprocess

import pytest

from bootstrap import node_layout, user_data
from tests.unit.test_bootstrap_render import FACTS

STANDIN = """#!/bin/bash
echo "$*" >> "$T/calls"
n=$(wc -l < "$T/calls")
if [ "$n" -le "$FAILS" ]; then
  echo "E: $ERROR" >&2
  exit 100
fi
echo "Reading package lists... Done"
"""


def _apt_get(tmp_path, fails: int, error: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "apt-get").write_text(STANDIN)
    (bindir / "apt-get").chmod(0o755)
    script = user_data.bootstrap_script(FACTS["l4x2"], "gpu").rsplit("run_steps", 1)[0]
    (tmp_path / "gpu.sh").write_text(script)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "T": str(tmp_path), "FAILS": str(fails), "ERROR": error}
    res = subprocess.run(["bash", "-c", f'source "{tmp_path}/gpu.sh"; apt_get update'], env=env,
                         capture_output=True, text=True, timeout=120)
    return res, (tmp_path / "calls").read_text().splitlines()


def test_apt_get_waits_while_another_apt_holds_the_lists_lock(tmp_path):
    lock = "Could not get lock /var/lib/apt/lists/lock. It is held by process 812 (apt-get)"
    res, calls = _apt_get(tmp_path, 1, lock)
    assert res.returncode == 0, res.stdout + res.stderr
    # One deadline for every try: the second try's dpkg wait is what the first left of it.
    waits = [int(c.split("DPkg::Lock::Timeout=")[1].split()[0]) for c in calls]
    assert len(calls) == 2 and waits[0] == node_layout.APT_LOCK_TIMEOUT_S
    assert node_layout.APT_LOCK_TIMEOUT_S - 20 <= waits[1] <= node_layout.APT_LOCK_TIMEOUT_S - 10
    assert "another apt holds a lock; waiting" in res.stdout and "Reading package lists" in res.stdout


@pytest.mark.parametrize("error", ["Failed to fetch file:/srv/x/Packages  File not found",
                                   "Unable to locate package slurm-wlm"])
def test_apt_get_fails_at_once_on_anything_else(tmp_path, error):
    res, calls = _apt_get(tmp_path, 5, error)
    assert res.returncode != 0 and len(calls) == 1
    assert "apt-get update failed" in res.stderr and error in res.stdout
