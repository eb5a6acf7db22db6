"""The boot test's own bridge and private /24 (not the local cluster's sgpu0/10.213.0.0/24).
The host holds .1; containers join with --network-bridge and get their address from the
NoCloud network-config. No route, NAT or forwarding beyond it: ip_forward stays 0."""

from __future__ import annotations

from pathlib import Path

from boottest import host

BRIDGE = "sgpuboot0"
SUBNET = "10.213.1.0/24"
HOST_IP = "10.213.1.1"
PREFIX = 24
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def exists() -> bool:
    return host.run("ip", "link", "show", "dev", BRIDGE, check=False).returncode == 0


def up() -> None:
    if IP_FORWARD.read_text().strip() != "0":
        raise host.BootError(f"{IP_FORWARD} is not 0: the boot test's containers must reach only "
                             f"{BRIDGE}; set it to 0 (sysctl -w net.ipv4.ip_forward=0)")
    if not exists():
        host.run("ip", "link", "add", BRIDGE, "type", "bridge")
    if f"{HOST_IP}/{PREFIX}" not in host.run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE).stdout:
        host.run("ip", "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", BRIDGE)
    host.run("ip", "link", "set", BRIDGE, "up")


def down() -> None:
    if exists():
        host.run("ip", "link", "del", BRIDGE, check=False)
