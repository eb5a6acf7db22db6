"""Where the boot test keeps what it builds once per machine: images, the apt repository
and the wheelhouse, each in a directory named by what it is made from (a key), written
aside and renamed into place when complete, so an interrupted build is never reused. One
builder at a time per entry (a lock file beside it): the boot tests' background prebuild
(boottest/prebuild.py) and a test that needs the same entry meet there, and the later one
finds it complete."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

CACHE = Path(os.environ.get("SLURM_GPU_BOOT_CACHE", "/var/cache/slurm-gpu-boot"))
COMPLETE = ".complete"


def key(*parts) -> str:
    """A short stable hash of what a cached thing is made from."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def remove(path: Path) -> None:
    """Remove a build's tree, unmounting first what a build stopped halfway left mounted in it
    (debootstrap's /proc, /sys, /dev): removing files through such a mount would reach the host's."""
    inside = str(path.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(inside)), key=len, reverse=True):
        subprocess.run(["umount", "--recursive", "--lazy", point], check=False, capture_output=True)
    left = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(inside)]
    if left:
        raise RuntimeError(f"{path}: still mounted inside after umount: {left}; unmount them, then rerun")
    shutil.rmtree(path)


def cached(kind: str, name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """CACHE/kind/name, built by `build(tmpdir)` unless already complete. Returns
    (path, built_now). Waits while another process builds the same entry."""
    final = CACHE / kind / name
    if (final / COMPLETE).exists():
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE / kind / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / COMPLETE).exists():  # built by the holder we waited for
            return final, False
        tmp = CACHE / kind / f".{name}.tmp"
        if tmp.exists():
            remove(tmp)
        tmp.mkdir(parents=True)
        build(tmp)
        (tmp / COMPLETE).write_text("")
        if final.exists():
            remove(final)
        tmp.rename(final)
        return final, True
