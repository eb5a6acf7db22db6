"""`fab ssh`: the OpenSSH command line that opens a shell on a cluster host.

GPU nodes are reached through the controller as a jump host (they have no public address
on AWS). The jump goes through ProxyCommand rather than -J: options given on the command
line apply to the destination only, never to a -J jump host, and the jump needs the same
key and the same pinned host keys. Host keys are checked against the cluster's known_hosts
(StrictHostKeyChecking=yes) by node name (HostKeyAlias), as fab's own connections do.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from bootstrap.inventory import Inventory
from ops.options import OptionError


def _common(known_hosts: Path, identity: str | None) -> list[str]:
    opts = ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "ConnectTimeout=20"]
    if identity:
        opts += ["-i", identity, "-o", "IdentitiesOnly=yes"]
    return opts


def ssh_argv(inv: Inventory, host: str, known_hosts: Path, identity: str | None = None,
             command: str | None = None) -> list[str]:
    """argv of `ssh` to `host` (a node name of the inventory), interactive unless `command`."""
    by_name = {n.name: n for n in inv.nodes}
    if host not in by_name:
        example = inv.gpu_nodes[0].name if inv.gpu_nodes else inv.controller.name
        raise OptionError(f"unknown host {host!r}; the hosts of cluster {inv.cluster_name!r} are: "
                          f"{', '.join(by_name)} (e.g. `fab ssh {example}`)")
    common = _common(known_hosts, identity)
    ctl = inv.controller
    ctl_addr = ctl.public_ip or ctl.private_ip
    if host == ctl.name:
        argv = ["ssh", *common, "-o", f"HostKeyAlias={ctl.name}", f"{inv.ssh_user}@{ctl_addr}"]
    else:
        node = by_name[host]
        jump = ["ssh", *common, "-o", f"HostKeyAlias={ctl.name}", "-W", f"{node.private_ip}:22",
                f"{inv.ssh_user}@{ctl_addr}"]
        argv = ["ssh", *common, "-o", f"ProxyCommand={shlex.join(jump)}", "-o", f"HostKeyAlias={host}",
                f"{inv.ssh_user}@{node.private_ip}"]
    if command:
        argv += ["--", command]
    return argv
