"""The GPU image's kernel and NVIDIA packages stay as it shipped them: the GPU bootstrap's `holds`
step, run for real (real dpkg-query and apt-mark) against a stand-in dpkg database of a GPU image,
in a private mount namespace (this machine's own dpkg database and apt configuration are untouched).
Rendered only where the platform has real GPUs (`Platform.real_gpus`)."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest

from bootstrap import node_layout, user_data
from cluster.platform import BOOT_DEBIAN12, LOCAL
from tests.unit.test_bootstrap_render import FACTS

pytestmark = pytest.mark.root

# (package, dpkg status): what a Deep Learning Base image of Ubuntu 24.04 has, in kind.
IMAGE = [
    ("linux-aws", "install ok installed"),
    ("linux-image-aws", "install ok installed"),
    ("linux-image-6.8.0-1021-aws", "install ok installed"),
    ("linux-headers-6.8.0-1021-aws", "install ok installed"),
    ("linux-modules-6.8.0-1021-aws", "install ok installed"),
    ("linux-modules-nvidia-595-open-6.8.0-1021-aws", "install ok installed"),
    ("nvidia-driver-595-open", "install ok installed"),
    ("nvidia-fabricmanager-595", "install ok installed"),
    ("libnvidia-compute-595", "install ok installed"),
    ("linux-image-6.8.0-1019-aws", "deinstall ok config-files"),  # removed: nothing to hold
    ("linux-base", "install ok installed"),  # not the kernel: stays upgradable
    ("libnccl2", "install ok installed"),
    ("openssh-server", "install ok installed"),
]
WANT_HELD = sorted(p for p, st in IMAGE if st.endswith(" installed") and p.startswith(node_layout.HOLD_PREFIXES))


def _status() -> str:
    return "".join(f"Package: {p}\nStatus: {st}\nPriority: optional\nSection: misc\nMaintainer: x <x@example.invalid>\n"
                   f"Architecture: amd64\nVersion: 1.0\nDescription: stand-in\n\n" for p, st in IMAGE)


SANDBOX = r"""
set -euo pipefail
mount -t tmpfs none /var/lib/dpkg && mkdir -p /var/lib/dpkg/updates /var/lib/dpkg/info
cp "$T/status" /var/lib/dpkg/status && : > /var/lib/dpkg/available
for d in /var/lib/apt /var/cache/apt /etc/apt/apt.conf.d; do mount -t tmpfs none "$d"; done
mkdir -p /var/lib/apt/lists/partial /var/cache/apt/archives/partial
source "$T/gpu.sh"
if [ -n "${LOCK_S:-}" ]; then  # another apt holds dpkg's frontend lock (fcntl, as dpkg takes it)
  /usr/bin/python3 -c 'import fcntl, os, sys, time
f = open("/var/lib/dpkg/lock-frontend", "w"); fcntl.lockf(f, fcntl.LOCK_EX); open(sys.argv[1], "w").close()
time.sleep(float(sys.argv[2]))' "$T/locked" "$LOCK_S" &
  until [ -e "$T/locked" ]; do sleep 0.1; done
fi
step_holds
wait
echo "--- held"; apt-mark showhold
echo "--- conf"; cat /etc/apt/apt.conf.d/* 2>/dev/null || true
echo "--- u-u"; apt-config dump Unattended-Upgrade::Package-Blacklist
"""


def _run_step(tmp_path, facts, lock_s: float = 0) -> subprocess.CompletedProcess:
    (tmp_path / "status").write_text(_status())
    script = user_data.bootstrap_script(facts, "gpu").rsplit("run_steps", 1)[0]
    (tmp_path / "gpu.sh").write_text(script)
    env = {"T": str(tmp_path), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    if lock_s:
        env["LOCK_S"] = str(lock_s)
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", SANDBOX],
                          env=env, capture_output=True, text=True, timeout=120)


def test_gpu_image_holds_its_installed_kernel_and_nvidia_packages(tmp_path):
    res = _run_step(tmp_path, FACTS["l4x2"])
    assert res.returncode == 0, res.stdout + res.stderr
    held, rest = res.stdout.split("--- held\n", 1)[1].split("--- conf\n", 1)
    assert sorted(held.split()) == WANT_HELD
    conf, uu = rest.split("--- u-u\n", 1)
    assert "Unattended-Upgrade::Package-Blacklist" in conf
    # apt's own parser reads the blacklist: one entry per prefix (unattended-upgrades re.match()es each).
    assert sorted(v.split('"')[1] for v in uu.splitlines() if ':: "' in v) == sorted(node_layout.HOLD_PREFIXES)
    assert "kept as the image shipped them (held): " + " ".join(WANT_HELD) in res.stdout


def test_holds_wait_for_another_apt_holding_the_dpkg_lock(tmp_path):
    """First boot with an unattended upgrade running: apt-mark (dpkg --set-selections) does not wait
    for dpkg's lock by itself, so the step waits and holds once the other apt is done."""
    res = _run_step(tmp_path, FACTS["l4x2"], lock_s=6)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "another apt holds the dpkg lock; waiting" in res.stdout + res.stderr
    assert sorted(res.stdout.split("--- held\n", 1)[1].split("--- conf\n", 1)[0].split()) == WANT_HELD


@pytest.mark.parametrize("platform", [LOCAL, BOOT_DEBIAN12], ids=lambda p: p.name)
def test_no_holds_without_real_gpus(tmp_path, platform):
    facts = replace(FACTS["l4x2"], platform=platform)
    script = user_data.bootstrap_script(facts, "gpu")
    assert "apt-mark" not in script and node_layout.APT_HOLD_CONF not in script
    res = _run_step(tmp_path, facts)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split("--- held\n", 1)[1].split("--- conf")[0].split() == []
    assert "nothing to hold" in res.stdout or "no kernel or NVIDIA packages to hold" in res.stdout


def test_holds_come_before_the_packages_step():
    steps = node_layout.STEPS["gpu"]
    assert steps.index("holds") < steps.index("packages")
