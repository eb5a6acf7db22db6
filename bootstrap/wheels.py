"""Can the GPU nodes install the training pins? Asked of pip without installing anything.

`pip install --dry-run --only-binary=:all: --python-version X --platform TAG ...` resolves
the pins for another interpreter and platform from pip's configured index: a pin with no
wheel for the platform's Python (e.g. transformers 5.24 on Python 3.10, which requires
>= 3.11) fails here instead of in a node's first boot. `--no-deps`: the pins themselves
(torch's CUDA dependencies are resolved on the node).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.platform import Platform


@dataclass(frozen=True)
class WheelCheck:
    python: str
    missing: dict[str, str] = field(default_factory=dict)  # "name==version" -> pip's last error line

    @property
    def ok(self) -> bool:
        return not self.missing


def pip_command(requirements: list[str], python: str, wheel_platforms: tuple[str, ...],
                target: str) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
           "--target", target, "--quiet", "--no-input", "--disable-pip-version-check"]
    for tag in wheel_platforms:
        cmd += ["--platform", tag]
    return cmd + list(requirements)


def _pip(requirements: list[str], python: str, wheel_platforms: tuple[str, ...]) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="slurm-gpu-wheels-") as target:
        res = subprocess.run(pip_command(requirements, python, wheel_platforms, target),
                             capture_output=True, text=True, timeout=600)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR:")]
    return res.returncode == 0, (errors[-1] if errors else res.stderr.strip()[-300:])


def check_wheels(requirements: list[str], platform: Platform, python: str | None = None) -> WheelCheck:
    """Whether every requirement has a wheel for `python` (default: the platform's) on the
    platform's wheel tags. One pip call when all resolve; when one does not, each pin is
    asked on its own (pip stops at the first failure) so every missing one is named."""
    python = python or platform.python
    ok, _ = _pip(requirements, python, platform.wheel_platforms)
    if ok:
        return WheelCheck(python)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda r: _pip([r], python, platform.wheel_platforms), requirements))
    missing = {req: err for req, (req_ok, err) in zip(requirements, results, strict=True) if not req_ok}
    if not missing:  # only the combination fails: report it as a whole
        missing = {" ".join(requirements): _pip(requirements, python, platform.wheel_platforms)[1]}
    return WheelCheck(python, missing)


def describe(check: WheelCheck, platform: Platform) -> str:
    lines = [f"no wheel for Python {check.python} ({platform.os}, {platform.wheel_platforms[0]}) of:"]
    lines += [f"  {req}: {err}" for req, err in check.missing.items()]
    return "\n".join(lines)
