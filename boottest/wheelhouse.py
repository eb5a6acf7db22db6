"""The GPU nodes' wheelhouse: the training pins (node_pins.training_requirements) and their
dependencies as wheels for the platform's Python, fetched once per machine by the host's
pip with the index it is configured for. The containers see it read-only at
images.WHEELHOUSE_MOUNT, and the image's pip.conf reads only it (no index), so the
bootstrap's `training` step runs its own `pip install` unchanged.

torch is a CPU build: the containers have no GPU. Debian 12 (Python 3.11): the CPU wheel of
the pinned torch. Debian 13 (Python 3.13): this machine's index has only the CUDA build of
the pinned torch for cp313, so the platform takes Debian's own python3-torch from the apt
repository (`Platform.os_torch`) and the wheelhouse holds everything else, without torch."""

from __future__ import annotations

import importlib.metadata
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bootstrap import node_pins
from boottest import cache, host, images
from cluster.platform import Platform

WHEELHOUSE_VERSION = 1
# The tags the stand-in index is filled for (a subset of every boot platform's `wheel_platforms`;
# the same since the wheelhouse was first cached, so its key stays).
WHEELHOUSE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")


def os_provided(platform: Platform) -> set[str]:
    """Names of the pins the platform's OS packages provide (not in the wheelhouse)."""
    return {"torch"} if platform.os_torch else set()


def requirements(platform: Platform) -> list[str]:
    """The pins the wheelhouse holds: what the node's pip installs, less what the OS provides."""
    skip = os_provided(platform)
    return [r for r in node_pins.training_requirements(platform) if Requirement(r).name not in skip]


def wheelhouse(platform: Platform, apt_repo: Path) -> tuple[Path, bool]:
    """The platform's wheelhouse (built unless cached) and whether it was built now. `apt_repo`:
    the platform's apt repository (aptrepo.repo), which holds the OS's torch where it has one."""
    made_of = [platform.python, WHEELHOUSE_PLATFORMS, requirements(platform), WHEELHOUSE_VERSION]
    if platform.os_torch:  # keeps the key of a platform without one as it was
        made_of.append(os_torch_deb(platform, apt_repo).name)
    name = f"py{platform.python}-{cache.key(*made_of)}"
    path, built = cache.cached("wheels", name, lambda tmp: _build(tmp / "wheels", platform, apt_repo))
    return path / "wheels", built


def _pip_download(out: Path, platform: Platform, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-input", "--only-binary=:all:",
           "--python-version", platform.python, "--implementation", "cp", "-d", str(out)]
    for tag in WHEELHOUSE_PLATFORMS:
        cmd += ["--platform", tag]
    host.run(*cmd, *args, timeout=1800)


def _build(out: Path, platform: Platform, apt_repo: Path) -> None:
    if not platform.os_torch:
        _pip_download(out, platform, *requirements(platform))
        return
    # pip cannot be told that the OS provides a pin another pin depends on (accelerate and peft
    # require torch): fetch the pins without their dependencies, then the dependencies that they
    # and the OS's torch (its own metadata, as the node's pip reads it) name for the platform's
    # Python, less the pins and torch. The node's pip takes from these what the OS lacks.
    pins = requirements(platform)
    _pip_download(out, platform, "--no-deps", *pins)
    skip = {canonicalize_name(Requirement(r).name) for r in pins} | os_provided(platform)
    named = [*os_torch_requirements(platform, apt_repo)]
    named += [r for whl in sorted(out.glob("*.whl")) for r in wheel_requirements(whl, platform.python)]
    deps = sorted({r for r in named if canonicalize_name(Requirement(r).name) not in skip})
    _pip_download(out, platform, *deps)
    fetched = sorted(w.name for w in out.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == "torch")
    if fetched:
        raise host.BootError(f"the wheelhouse of {platform.name} must not hold {fetched}: the OS provides "
                             "torch; a dependency asked for it")


def os_torch_deb(platform: Platform, apt_repo: Path) -> Path:
    debs = sorted(apt_repo.glob(f"{platform.os_torch.package}_*.deb"))
    if len(debs) != 1:
        raise host.BootError(f"{platform.name}: expected one {platform.os_torch.package} package in {apt_repo}, "
                             f"found {[d.name for d in debs]}")
    return debs[0]


def os_torch_requirements(platform: Platform, apt_repo: Path) -> list[str]:
    """What the OS's torch package declares it requires, for the platform's Python. Its version
    must be the one the platform states (Platform.os_torch.version: the GPU nodes' torch pin)."""
    with tempfile.TemporaryDirectory(prefix="sgpu-boot-torch-") as tmp:
        host.run("dpkg-deb", "-x", str(os_torch_deb(platform, apt_repo)), tmp)
        site = [str(p) for p in Path(tmp).glob("usr/lib/python3*/dist-packages")]
        dists = [d for d in importlib.metadata.distributions(path=site)
                 if canonicalize_name(d.metadata["Name"]) == "torch"]
        if len(dists) != 1:
            raise host.BootError(f"{platform.os_torch.package} holds {len(dists)} torch distributions, expected 1")
        version, requires = dists[0].version, dists[0].requires or []
    if version != platform.os_torch.version:
        raise host.BootError(f"{platform.os_torch.package} provides torch {version}, but {platform.name}'s "
                             f"os_torch.version is {platform.os_torch.version}: set it in cluster/platform.py")
    return applicable(requires, platform.python)


def wheel_requirements(whl: Path, python: str) -> list[str]:
    """A wheel's Requires-Dist that apply on `python` with no extra, as "name[extras]spec"."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return applicable(Parser().parsestr(text).get_all("Requires-Dist") or [], python)


def applicable(requires: list[str], python: str) -> list[str]:
    """The requirements whose markers hold on `python` (Linux, CPython) with no extra, as
    "name[extras]spec"."""
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    reqs = []
    for value in requires:
        req = Requirement(value)
        if req.marker is None or req.marker.evaluate(env):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            reqs.append(f"{req.name}{extras}{req.specifier}")
    return reqs


def bind_arg(wheel_dir: Path) -> str:
    return f"--bind-ro={wheel_dir}:{images.WHEELHOUSE_MOUNT}"
