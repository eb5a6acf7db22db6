"""The daemons of the local cluster: munged and sshd in every host, slurmctld on
the controller, slurmd on each GPU host. Started and stopped through `hostctl`
(the same command the inventory gives `fab` as service_cmd), in parallel, and
waited for by polling.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from localcluster import hosts
from localcluster import topology as layout


class DaemonError(RuntimeError):
    pass


def sshd_config(name: str, address: str) -> str:
    return f"""\
# sshd of local-cluster host {name} (written by `fab local.up`). Key login only.
ListenAddress {address}
Port 22
HostKey {layout.host_key(name)}
PidFile /run/sshd.pid
AuthorizedKeysFile {layout.AUTHORIZED_KEYS}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
# fab reaches the GPU hosts through the controller, as on AWS.
AllowTcpForwarding yes
# No PAM session stack inside a namespace host (no logind, no loginuid).
UsePAM no
X11Forwarding no
PrintMotd no
Subsystem sftp /usr/lib/openssh/sftp-server
"""


def hostctl(pid: int, host: str, action: str, service: str) -> None:
    hosts.run(pid, [str(layout.HOSTCTL), action, service], host=host, timeout=30)


def each(fn: Callable, items: Iterable) -> list:
    """fn(item) for every item in parallel; the first failure is raised (naming its host)."""
    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        return [f.result() for f in futures]


def poll(what: str, probe: Callable[[], bool], timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if probe():
            return
        if time.monotonic() > deadline:
            raise DaemonError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def port_open(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def munge_works(pid: int) -> bool:
    return hosts.run(pid, ["munge", "-n"], check=False, timeout=10).returncode == 0


def slurmctld_up(pid: int) -> bool:
    out = hosts.run(pid, ["scontrol", "ping"], check=False, timeout=15).stdout
    return "is UP" in out


def node_states(ctl_pid: int) -> dict[str, str]:
    """node name -> state as sinfo reports it (e.g. idle, down*, unknown*)."""
    proc = hosts.run(ctl_pid, ["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1].lower()
    return states


def wait_idle(ctl_pid: int, names: list[str], timeout: float) -> None:
    last: dict[str, str] = {}

    def all_idle() -> bool:
        nonlocal last
        last = node_states(ctl_pid)
        return all(last.get(n) == "idle" for n in names)

    try:
        poll("GPU nodes to register idle", all_idle, timeout, interval=0.2)
    except DaemonError as exc:
        waiting = ", ".join(f"{n} ({last.get(n, 'missing')})" for n in names if last.get(n) != "idle")
        raise DaemonError(f"{exc}; not idle: {waiting} (see /var/log/slurm/slurmd.log in the host)") from None
