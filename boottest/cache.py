"""Where the boot test keeps what it builds once per machine: images, the apt repository
and the wheelhouse, each in a directory named by what it is made from (a key), written
aside and renamed into place when complete, so an interrupted build is never reused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

CACHE = Path(os.environ.get("SLURM_GPU_BOOT_CACHE", "/var/cache/slurm-gpu-boot"))
COMPLETE = ".complete"


def key(*parts) -> str:
    """A short stable hash of what a cached thing is made from."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached(kind: str, name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """CACHE/kind/name, built by `build(tmpdir)` unless already complete. Returns
    (path, built_now)."""
    final = CACHE / kind / name
    if (final / COMPLETE).exists():
        return final, False
    tmp = CACHE / kind / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / COMPLETE).write_text("")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final, True
