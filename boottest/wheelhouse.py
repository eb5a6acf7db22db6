"""The GPU nodes' wheelhouse: the training pins (render.training_pins) and their
dependencies as wheels for the platform's Python, fetched once per machine by the host's
pip with the index it is configured for. The containers see it read-only at
images.WHEELHOUSE_MOUNT, and the image's pip.conf reads only it (no index), so the
bootstrap's `training` step runs its own `pip install` unchanged.

torch is the CPU build: the containers have no GPU. The CPU wheel of the pinned torch is
taken where one exists for the platform's Python; TORCH_INDEX_NOTE in docs/BOOTTEST.md says
what the Python 3.13 image uses."""

from __future__ import annotations

import sys
from pathlib import Path

from bootstrap import render
from bootstrap.platform import Platform
from boottest import cache, host, images

WHEELHOUSE_VERSION = 1


def requirements() -> list[str]:
    pins = render.training_pins()
    return [f"{name}=={pins[name]}" for name in render.TRAINING_PACKAGES]


def wheelhouse(platform: Platform) -> tuple[Path, bool]:
    made_of = cache.key(platform.python, platform.wheel_platforms, requirements(), WHEELHOUSE_VERSION)
    name = f"py{platform.python}-{made_of}"
    path, built = cache.cached("wheels", name, lambda tmp: _build(tmp / "wheels", platform))
    return path / "wheels", built


def _build(out: Path, platform: Platform) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-input", "--only-binary=:all:",
           "--python-version", platform.python, "--implementation", "cp", "-d", str(out)]
    for tag in platform.wheel_platforms:
        cmd += ["--platform", tag]
    host.run(*cmd, *requirements(), timeout=1800)


def bind_arg(wheel_dir: Path) -> str:
    return f"--bind-ro={wheel_dir}:{images.WHEELHOUSE_MOUNT}"
