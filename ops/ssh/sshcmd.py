"""`fab ssh`: OpenSSH opening a shell (or running a command) on a cluster host.

GPU nodes are reached through the controller as a jump host (they have no public address
on AWS). The jump goes through ProxyCommand rather than -J: options given on the command
line apply to the destination only, never to a -J jump host, and the jump needs the same
key and the same pinned host keys. Host keys are checked against the cluster's known_hosts
(StrictHostKeyChecking=yes) by node name (HostKeyAlias), as fab's own connections do.

Nothing of the admin's machine is handed to a host, whatever ~/.ssh/config says: no agent
(`-a`, ForwardAgent=no: a node's root could sign with the admin's keys while the session is
open), no X11 (ForwardX11=no) and no port forwarding (ClearAllForwardings=yes drops the
config's LocalForward/RemoteForward/DynamicForward). Options on the command line win over the
config files ("the first obtained value will be used", ssh_config(5)); `-W`, the jump, clears
forwardings itself (OpenSSH ssh.c, case 'W': options.clear_forwardings = 1).

Nor is a connection shared (ControlMaster=no, ControlPath=none): under a config's ControlMaster
and ControlPath, ssh runs its session over a master the admin opened earlier without these options,
one that may forward the agent. ControlMaster=no alone still joins an existing master ("Additional
sessions can connect to this socket using the same ControlPath with ControlMaster set to no",
ssh_config(5)); ControlPath "none" disables connection sharing.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from cluster import targets
from cluster.errors import UserError
from cluster.inventory import Inventory
from ops.actions.options import ClusterOptions, OptionError
from ops.ssh import hostkeys

SSH_FAILED = 255  # OpenSSH's own exit status (connection refused, authentication, host key)


class SshFailed(UserError, RuntimeError):
    """ssh itself failed (its own error is above, on the terminal)."""


# Forward nothing of this machine to a cluster host, share no connection (see the module's docstring).
NO_FORWARDING = ["-a", "-x", "-o", "ForwardAgent=no", "-o", "ForwardX11=no", "-o", "ForwardX11Trusted=no",
                 "-o", "ClearAllForwardings=yes", "-o", "ControlMaster=no", "-o", "ControlPath=none"]


def _common(known_hosts: Path, identity: str | None) -> list[str]:
    opts = [*NO_FORWARDING, "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
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


def open_shell(where: ClusterOptions, host: str, command: str | None = None) -> int:
    """Run ssh to `host` with the terminal attached (interactive, as ssh itself); its exit status.

    The host keys it needs are pinned first (read from the EC2 console output on AWS), so that ssh
    checks them as fab's own connections do."""
    inv = targets.load(where.target, where.stack)
    pins = hostkeys.Pins(inv)
    argv = ssh_argv(inv, host, pins.path, identity=where.identity or inv.ssh_key_file, command=command)
    for needed in {inv.controller.name, host}:
        pins.keys(needed)
    rc = subprocess.run(argv).returncode
    if rc == SSH_FAILED:
        raise SshFailed(f"ssh to {host} failed (exit 255, ssh's own error above): is {host} up and its sshd "
                        f"running? `fab status` shows the nodes; restart sshd on {host} from the cloud console "
                        "(locally: `fab local.down && fab local.up`)")
    return rc
