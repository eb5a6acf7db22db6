"""Leave nothing behind: every boot-test container stopped (and every process in its
cgroups killed), its overlay unmounted, its cgroups removed, the bridge deleted, the run's
state directory and the inventory removed. Works from what is on the host, not from
memory, so it also cleans up after a run that was killed (it runs before every new one)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from boottest import host, net, nspawn
from cluster.targets.boot import BOOT_INVENTORY, STATE_ROOT


def containers(state: Path) -> list[nspawn.Container]:
    """The containers a run left under `state` (one directory each, with a wrapper)."""
    found = []
    if state.is_dir():
        for d in sorted(state.iterdir()):
            if (d / "wrapper.sh").exists() or (d / "root").is_dir():
                found.append(nspawn.Container(_machine_name(d), d, Path("/nonexistent"), net.BRIDGE))
    return found


def _machine_name(d: Path) -> str:
    """The machine name the container's cgroups carry (the nspawn -M in its wrapper)."""
    try:
        text = (d / "wrapper.sh").read_text()
        return text.split(" -M ", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return d.name


def everything(state: Path = STATE_ROOT / "run") -> list[str]:
    """Tear down; returns what was found and removed (for the log)."""
    done = []
    for c in containers(state):
        c.stop()
        c.unmount()
        c.remove_cgroups()
        done.append(c.name)
    # Cgroups of containers whose state is gone (a killed run whose directory was removed).
    for root in nspawn.CGROUP_ROOTS:
        parent = root / nspawn.CGROUP_PARENT
        if parent.is_dir():
            for cg in [p for p in parent.iterdir() if p.is_dir()]:
                leftover = nspawn.Container(cg.name, state / cg.name, Path("/nonexistent"), net.BRIDGE)
                leftover.kill_all()
                nspawn.remove_cgroup_tree(cg)
            try:
                parent.rmdir()
            except OSError:
                pass
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mnt = line.split()[1]
        if mnt.startswith(str(state) + "/"):
            host.run("umount", "-l", mnt, check=False)
    net.down()
    if state.exists():
        shutil.rmtree(state, ignore_errors=True)
    BOOT_INVENTORY.unlink(missing_ok=True)
    return done


def leftovers(state: Path = STATE_ROOT / "run") -> list[str]:
    """What a finished run must not leave: empty when all is gone."""
    left = []
    if state.exists():
        left.append(f"state directory {state}")
    if net.exists():
        left.append(f"bridge {net.BRIDGE}")
    for root in nspawn.CGROUP_ROOTS:
        if (root / nspawn.CGROUP_PARENT).exists():
            left.append(f"cgroup {root / nspawn.CGROUP_PARENT}")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if str(STATE_ROOT) in line.split()[1]:
            left.append(f"mount {line.split()[1]}")
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "systemd-nspawn" in cmd and str(STATE_ROOT) in cmd:
                left.append(f"process {pid}: {cmd[:120]}")
    return left


if __name__ == "__main__":  # the CI's backstop (scripts/test.sh): python -m boottest.teardown
    removed = everything()
    left = leftovers()
    print(f"boottest.teardown: stopped {removed or 'no container'}; left: {left or 'nothing'}")
    raise SystemExit(1 if left else 0)
