"""The local apt repository the containers install from: every package the roles' user-data
and bootstrap ask for (node_layout.role_packages), with the dependencies the image lacks, downloaded
from the host's Debian archive in a throwaway overlay over the image, indexed with
dpkg-scanpackages. The containers see it read-only at images.APT_REPO_MOUNT
(`deb [trusted=yes] file:... ./`): the bootstrap's
apt-get runs unchanged against it, and nothing leaves the machine.

Packages come with their Recommends, as the AMI's apt installs them, except the OS's torch
(`Platform.os_torch`), a stand-in for a pip wheel: it comes with its Depends only. Its
Recommends (libtorch-dev, and through python3-networkx SciPy, matplotlib, GDAL, LLVM: over
400 MB) are not in the repository, and apt skips a recommended package it cannot find."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bootstrap import node_layout
from boottest import cache, host, images
from cluster.platform import Platform

REPO_VERSION = 1


def packages(platform: Platform) -> tuple[str, ...]:
    """Every package a role of the platform installs (node_layout.role_packages)."""
    return tuple(sorted({p for role in node_layout.ROLES for p in node_layout.role_packages(platform, role)}))


def without_recommends(platform: Platform) -> tuple[str, ...]:
    """The packages of `packages` fetched without their Recommends: the OS's torch."""
    return (platform.os_torch.package,) if platform.os_torch else ()


def repo(platform: Platform, image_root: Path) -> tuple[Path, bool]:
    """The platform's repository directory (built unless cached), and whether it was built now."""
    made_of = [image_root.parent.name, packages(platform), REPO_VERSION]
    if without_recommends(platform):  # keeps the key of a platform without one as it was
        made_of.append(without_recommends(platform))
    name = f"{platform.name}-{cache.key(*made_of)}"
    path, built = cache.cached("apt", name, lambda tmp: _build(tmp / "repo", platform, image_root))
    return path / "repo", built


def _build(out: Path, platform: Platform, image_root: Path) -> None:
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="sgpu-boot-apt-", dir=cache.CACHE) as tmp:
        upper, work, merged = (Path(tmp) / d for d in ("upper", "work", "merged"))
        for d in (upper, work, merged):
            d.mkdir()
        mounts = []
        try:
            host.run("mount", "-t", "overlay", "overlay", "-o",
                     f"lowerdir={image_root},upperdir={upper},workdir={work}", str(merged))
            mounts.append(merged)
            for sub in ("proc", "dev"):
                host.run("mount", "--rbind" if sub == "dev" else "--bind", f"/{sub}", str(merged / sub))
                mounts.append(merged / sub)
            # The host's archive, the image's suite (the image's own sources name only the local repo).
            (merged / "etc/apt/sources.list").write_text(
                f"deb {host.debian_mirror()} {platform.debian_suite} main\n")
            shutil.copy("/etc/resolv.conf", merged / "etc/resolv.conf")
            host.run("chroot", str(merged), "apt-get", "update", "-q", timeout=600)
            bare = without_recommends(platform)
            host.run("chroot", str(merged), "apt-get", "install", "-y", "-q", "--download-only",
                     *(p for p in packages(platform) if p not in bare), timeout=1200)
            if bare:
                host.run("chroot", str(merged), "apt-get", "install", "-y", "-q", "--download-only",
                         "--no-install-recommends", *bare, timeout=1200)
            debs = sorted((merged / "var/cache/apt/archives").glob("*.deb"))
            if not debs:
                raise host.BootError("apt downloaded no package for the local repository")
            for deb in debs:
                shutil.copy2(deb, out / deb.name)
        finally:
            for m in reversed(mounts):
                host.run("umount", "-l", str(m), check=False)
    index = host.run("dpkg-scanpackages", "-m", ".", "/dev/null", cwd=out).stdout
    (out / "Packages").write_text(index)


def bind_arg(repo_dir: Path) -> str:
    return f"--bind-ro={repo_dir}:{images.APT_REPO_MOUNT}"
