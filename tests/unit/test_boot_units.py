"""When the boot test calls a container settled: systemd finished booting and no unit failed but
the few that cannot run in a container (fast, no root; tests/boot/test_boot_cluster.py asserts it on
the booted hosts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from boottest import host, nspawn, units

REPO = Path(__file__).resolve().parents[2]

# `systemctl list-units --state=failed --plain --no-legend` as systemd 252 prints it.
ALLOWED_ONLY = ("proc-fs-nfsd.mount   loaded failed failed NFSD configuration filesystem\n"
                "run-rpc_pipefs.mount loaded failed failed RPC Pipe File System\n")
WITH_SLURMD = ALLOWED_ONLY + "slurmd.service       loaded failed failed Slurm node daemon\n"


def test_a_failed_unit_not_on_the_list_is_reported():
    assert units.not_allowed(units.parse_failed(WITH_SLURMD)) == ["slurmd.service"]
    assert units.not_allowed(units.parse_failed(ALLOWED_ONLY)) == []
    assert units.parse_failed("") == []


class FakeContainer(nspawn.Container):
    """A container whose systemd says `state` and lists `failed` (what `run` answers)."""

    def __init__(self, state: str, failed: str):
        super().__init__("ip-10-213-1-11", Path("/nonexistent"), Path("/nonexistent"), "br")
        self.answers = {"systemctl is-system-running": state, units.FAILED_CMD: failed}

    def pid1(self) -> int:
        return 1

    def run(self, cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        out = self.answers.get(cmd, "slurmd.service: Main process exited, status=1/FAILURE\n")
        return subprocess.CompletedProcess(cmd, 0, out, "")


def test_degraded_by_a_unit_of_ours_is_not_settled_and_names_it():
    c = FakeContainer("degraded\n", WITH_SLURMD)
    with pytest.raises(host.BootError) as err:
        c.wait_running(timeout=5, settled=True)
    text = str(err.value)
    assert "failed unit(s) slurmd.service" in text and "status=1/FAILURE" in text, text
    assert "proc-fs-nfsd.mount may" not in text
    # Not waiting for settling: systemd answering is enough, as before.
    assert c.wait_running(timeout=5) == "degraded"


def test_degraded_only_by_the_allowed_units_is_settled():
    assert FakeContainer("degraded\n", ALLOWED_ONLY).wait_running(timeout=5, settled=True) == "degraded"
    assert FakeContainer("running\n", "").wait_running(timeout=5, settled=True) == "running"


def test_the_allowed_units_and_their_reasons_are_in_the_docs():
    doc = (REPO / "docs" / "BOOTTEST.md").read_text()
    for unit, why in units.ALLOWED_FAILED.items():
        assert f"`{unit}`" in doc, unit
        assert why.split(";")[0] in " ".join(doc.split()), f"{unit}: docs/BOOTTEST.md lacks its reason"


def test_step_seconds_split_a_first_boot_by_step_in_the_scripts_order(monkeypatch):
    """The boot test records where a first boot's minutes go (timings.json "steps"): each step's
    end time less the one before; steps ending in the same second keep the script's order."""
    import calendar
    import time

    from boottest.boot_cluster import BootCluster

    bc = object.__new__(BootCluster)
    bc.roles = {"gpu-node-01": "gpu"}
    t0 = calendar.timegm(time.strptime("2026-12-07T10:00:00Z", "%Y-%m-%dT%H:%M:%SZ"))
    status = {"hostname": "ok 2026-12-07T10:00:05Z", "hosts": "ok 2026-12-07T10:00:05Z",
              "holds": "ok 2026-12-07T10:00:06Z", "packages": "ok 2026-12-07T10:03:26Z",
              "dirs": "ok 2026-12-07T10:03:26Z", "training": "running 2026-12-07T10:03:27Z"}
    monkeypatch.setattr(BootCluster, "steps", lambda self, name: dict(sorted(status.items())))
    got = bc.step_seconds("gpu-node-01", t0)
    assert list(got) == ["hostname", "hosts", "holds", "packages", "dirs"]
    assert got == {"hostname": 5, "hosts": 0, "holds": 1, "packages": 200, "dirs": 0}
