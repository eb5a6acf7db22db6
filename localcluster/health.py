"""Is the local cluster whole? Each host's holder and daemons, and the controller's node
table: what `up` checks before it leaves a cluster alone, and what `fab local.status` prints."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from localcluster import hosts
from localcluster import topology as layout
from localcluster.state import ClusterState, HostEntry


def services_of(role: str) -> tuple[str, ...]:
    return ("munge", "sshd", "slurmctld") if role == "controller" else ("munge", "sshd", "slurmd")


def service_running(pid: int, service: str) -> bool:
    r = hosts.run(pid, [str(layout.HOSTCTL), "status", service], check=False, timeout=10)
    return r.returncode == 0


def host_alive(entry: HostEntry) -> bool:
    """The host's holder still runs (the same process: its namespaces are the recorded ones)."""
    return bool(entry.pid) and hosts.alive(entry.pid) and \
        tuple(sorted(hosts.ns_ids(entry.pid).values())) == entry.ns


def problems(state: ClusterState) -> list[str]:
    """What is wrong with a cluster (empty when every host and daemon is up)."""
    if not state.complete:
        return ["not every host was made"]
    found = []
    for e in state.hosts:
        if not host_alive(e):
            found.append(f"host {e.name} is gone")
            continue
        found += [f"{svc} is not running on {e.name}" for svc in services_of(e.role)
                  if not service_running(e.pid, svc)]
    return found


def report(state: ClusterState, out: Callable[[str], None]) -> bool:
    """Print the hosts and the controller's node table; True when all is up."""
    out(f"local cluster: controller + {state.nodes} GPU hosts x {state.gpus} GPUs "
        f"(bridge {layout.BRIDGE} {layout.BRIDGE_IP}/{layout.PREFIX_LEN})")
    out(f"{'HOST':<14}{'IP':<15}{'STATE':<7}DAEMONS")
    healthy = True
    ctl_pid = None
    for e in state.hosts:
        if host_alive(e):
            running = {svc: service_running(e.pid, svc) for svc in services_of(e.role)}
            word = "up" if all(running.values()) else "degraded"
            detail = " ".join(f"{svc}:{'up' if ok else 'DOWN'}" for svc, ok in running.items())
            if e.role == "controller" and running.get("slurmctld"):
                ctl_pid = e.pid
        else:
            word, detail = "down", "-"
        healthy &= word == "up"
        out(f"{e.name:<14}{e.ip:<15}{word:<7}{detail}")
    if ctl_pid is None:
        out("slurmctld (or the controller) is down: no node table; `fab local.down && fab local.up` "
            "makes the cluster again")
        return False
    try:
        r = hosts.run(ctl_pid, ["sinfo", "-N", "-o", "%14N %10T %16G %5c %8m %P"], check=False,
                      timeout=15)
    except subprocess.TimeoutExpired:
        out("slurmctld does not answer (sinfo timed out after 15 s): no node table; "
            "`fab local.down && fab local.up` makes the cluster again")
        return False
    out("")
    for line in (r.stdout or r.stderr).rstrip().splitlines():
        out(line)
    return healthy and r.returncode == 0
