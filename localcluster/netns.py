"""The cluster's private network: one bridge in the root namespace and, per host,
a network namespace joined to it by a veth pair.

Only `ip` is used; never `ip netns exec` (it remounts /sys, and slurmd then cannot
see /sys/fs/cgroup). Commands inside a host go through `hosts.run` instead.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from localcluster import topology as layout

NETNS_DIR = Path("/run/netns")


class NetError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return ip("link", "show", "dev", name, check=False).returncode == 0


def ensure_bridge() -> None:
    if not link_exists(layout.BRIDGE):
        ip("link", "add", layout.BRIDGE, "type", "bridge")
    addr = f"{layout.BRIDGE_IP}/{layout.PREFIX_LEN}"
    if addr not in ip("-o", "-4", "addr", "show", "dev", layout.BRIDGE).stdout:
        ip("addr", "add", addr, "dev", layout.BRIDGE)
    ip("link", "set", layout.BRIDGE, "up")


def delete_bridge() -> None:
    if link_exists(layout.BRIDGE):
        ip("link", "del", layout.BRIDGE)


def list_netns() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_path(name: str) -> Path:
    return NETNS_DIR / name


def add_host(name: str, index: int, address: str) -> None:
    """Namespace `name` with eth0 = `address` on the bridge, lo up."""
    veth = layout.veth_name(index)
    ip("netns", "add", name)
    ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
    ip("link", "set", veth, "master", layout.BRIDGE, "up")
    ip("-n", name, "addr", "add", f"{address}/{layout.PREFIX_LEN}", "dev", "eth0")
    ip("-n", name, "link", "set", "eth0", "up")
    ip("-n", name, "link", "set", "lo", "up")
    ip("-n", name, "route", "add", "default", "via", layout.BRIDGE_IP, check=False)


def delete_host(name: str, index: int | None = None) -> None:
    if name in list_netns():
        ip("netns", "del", name)
    if index is not None and link_exists(layout.veth_name(index)):
        ip("link", "del", layout.veth_name(index), check=False)


def our_netns() -> list[str]:
    return [n for n in list_netns() if n.startswith(layout.netns_name(""))]


def our_veths() -> list[str]:
    out = ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith("sgv") and n[3:].isdigit()]
