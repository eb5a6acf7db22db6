"""The local apt repository the containers install from: every package the roles' user-data
and bootstrap ask for (render.PACKAGES), with the dependencies the image lacks, downloaded
from the host's Debian archive in a throwaway overlay over the image, indexed with
dpkg-scanpackages. The containers see it read-only at images.APT_REPO_MOUNT
(`deb [trusted=yes] file:... ./`): cloud-init's package_update/packages and the bootstrap's
apt-get run unchanged against it, and nothing leaves the machine."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bootstrap import render
from bootstrap.platform import Platform
from boottest import cache, host, images

REPO_VERSION = 1


def packages() -> tuple[str, ...]:
    return tuple(sorted({p for pkgs in render.PACKAGES.values() for p in pkgs}))


def repo(platform: Platform, image_root: Path) -> tuple[Path, bool]:
    """The platform's repository directory (built unless cached), and whether it was built now."""
    name = f"{platform.name}-{cache.key(image_root.parent.name, packages(), REPO_VERSION)}"
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
            host.run("chroot", str(merged), "apt-get", "install", "-y", "-q", "--download-only",
                     *packages(), timeout=1200)
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
