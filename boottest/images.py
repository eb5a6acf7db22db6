"""The boot images: a Debian root file system per boot platform, made with debootstrap
from the host's Debian archive and set up to stand in for the AMI (see docs/BOOTTEST.md):
its apt and pip point at the local repository and wheelhouse the containers get bound in,
cloud-init reads only NoCloud, the default user is the AMI's.

Cached under CACHE/images/<platform>-<key>/rootfs, the key made of the suite, the package
list and the set-up below (IMAGE_VERSION): change any and a new image is built."""

from __future__ import annotations

import os
from pathlib import Path

from boottest import cache, host
from cluster.platform import Platform

# What the image holds before cloud-init runs (the AMI's own base). python3-cffi-backend
# must be named, or python3-cryptography (cloud-init's) fails to configure.
INCLUDE = ("systemd", "systemd-sysv", "dbus", "iproute2", "iputils-ping", "netbase", "locales",
           "cloud-init", "python3-cffi-backend", "openssh-server", "sudo", "ca-certificates")
IMAGE_VERSION = 1  # bump when `configure` changes

# Where the containers see the local apt repository and the wheelhouse (bound read-only).
APT_REPO_MOUNT = "/srv/slurm-gpu-apt"
WHEELHOUSE_MOUNT = "/srv/slurm-gpu-wheels"

CLOUD_CFG = """\
# slurm-gpu boot test: the image stands in for the AMI. cloud-init reads the NoCloud seed
# only (no EC2 metadata here) and makes the AMI's default user.
datasource_list: [NoCloud, None]
system_info:
  default_user:
    name: {user}
    lock_passwd: true
    gecos: {user}
    groups: [sudo]
    sudo: ["ALL=(ALL) NOPASSWD:ALL"]
    shell: /bin/bash
"""


def image_key(platform: Platform, ssh_user: str) -> str:
    return cache.key(platform.name, platform.debian_suite, INCLUDE, IMAGE_VERSION, ssh_user)


def image(platform: Platform, ssh_user: str = "ubuntu") -> tuple[Path, bool]:
    """The platform's root file system (built unless cached) and whether it was built now."""
    if not platform.debian_suite:
        raise host.BootError(f"platform {platform.name!r} has no debian_suite: it is not a boot platform")
    name = f"{platform.name}-{image_key(platform, ssh_user)}"
    path, built = cache.cached("images", name, lambda tmp: _build(tmp / "rootfs", platform, ssh_user))
    return path / "rootfs", built


def _build(root: Path, platform: Platform, ssh_user: str) -> None:
    host.run("debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}",
             platform.debian_suite, str(root), host.debian_mirror(), timeout=1200)
    configure(root, ssh_user)


def _chroot(root: Path, *cmd: str) -> None:
    host.run("chroot", str(root), *cmd, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def configure(root: Path, ssh_user: str) -> None:
    _chroot(root, "apt-get", "clean")
    for p in (root / "var/lib/apt/lists").glob("*"):
        if p.is_file():
            p.unlink()
    # apt reads only the local repository (as the AMI's apt reads its mirrors).
    for p in (root / "etc/apt/sources.list.d").glob("*"):
        p.unlink()
    (root / "etc/apt/sources.list").write_text(f"deb [trusted=yes] file:{APT_REPO_MOUNT} ./\n")
    # pip reads only the wheelhouse.
    (root / "etc/pip.conf").write_text(f"[global]\nno-index = true\nfind-links = {WHEELHOUSE_MOUNT}\n")
    # Each container is a new machine: its own machine-id and SSH host keys at first boot.
    (root / "etc/machine-id").write_text("")
    for p in (root / "etc/ssh").glob("ssh_host_*"):
        p.unlink()
    # Without a locale bookworm's cloud-init locale module exits 255 (status: error).
    (root / "etc/default/locale").write_text("LANG=C.UTF-8\n")
    (root / "etc/cloud/cloud.cfg.d/90-slurm-gpu-boot.cfg").write_text(CLOUD_CFG.format(user=ssh_user))
    _chroot(root, "systemctl", "enable", "systemd-networkd")
    _chroot(root, "systemctl", "mask", "systemd-networkd-wait-online.service")
