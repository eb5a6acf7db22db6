"""Power state of GPU nodes (Slurm power saving) as fab reports and acts on it.

sinfo's long state carries a suffix for power saving: `idle~` powered down (the EC2
instance is stopped, or the local host's slurmd), `idle#` powering up, `idle%` powering
down, `idle!` power-down pending. A job that needs a stopped node starts it and waits
(CONFIGURING) on its own; `fab train` starts stopped nodes first (`wake`), because it
reaches every node over SSH before it submits anything.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from ops import slurm
from ops.remote import Cluster, sudo

SUFFIXES = {"~": "stopped", "#": "starting", "%": "stopping", "!": "stopping soon"}
ON = "on"
DEFAULT_POWER_UP_TIME = "a few minutes"
DEFAULT_WAKE_TIMEOUT_S = 900.0
Say = Callable[[str], None]


def power_state(sinfo_state: str) -> str:
    """'on', 'stopped', 'starting', 'stopping' or 'stopping soon' from sinfo's %T state."""
    state = sinfo_state.rstrip("*")  # '*': not responding (a separate matter)
    return SUFFIXES.get(state[-1:], ON) if state else ON


def describe(name: str, power: str, power_up_time: str) -> str:
    """One line for a node that is not simply on."""
    if power == "stopped":
        return f"{name} is stopped (idle power-save); Slurm is starting it, {power_up_time}"
    if power == "starting":
        return f"{name} is starting (Slurm power-save resume), {power_up_time}"
    return f"{name} is {power} (idle power-save); it is started again once it has stopped, {power_up_time}"


def node_power(ctl) -> dict[str, str] | None:
    """node -> power state, or None when Slurm does not answer (a controller still booting)."""
    res = ctl.run("sinfo -h -N -o '%N|%T|%E'", hide=True, warn=True)
    if not res.ok:
        return None
    return {name: power_state(st.state) for name, st in slurm.parse_sinfo(res.stdout).items()}


def wake(cl: Cluster, say: Say, poll_s: float = 2.0, timeout_s: float | None = None) -> list[str]:
    """Start every stopped GPU node of the inventory and wait until all are on.

    Returns the nodes that were not on. Nodes still stopping are started once they have
    stopped (Slurm refuses to power up a node in the middle of powering down).
    """
    inv = cl.inventory
    names = [n.name for n in inv.gpu_nodes]
    power = node_power(cl.controller)
    if power is None:
        return []
    waking = [n for n in names if power.get(n, ON) != ON]
    if not waking:
        return []
    eta = inv.extra.get("power_up_time", DEFAULT_POWER_UP_TIME)
    for n in waking:
        say("      " + describe(n, power[n], eta))
    timeout_s = timeout_s or float(inv.extra.get("resume_timeout_s", DEFAULT_WAKE_TIMEOUT_S))
    deadline = time.monotonic() + timeout_s
    requested: set[str] = set()
    t0 = time.monotonic()
    while True:
        todo = [n for n in waking if power.get(n) == "stopped" and n not in requested]
        if todo:
            sudo(cl.controller, f"scontrol update nodename={shlex.quote(','.join(todo))} state=power_up")
            requested.update(todo)
        if all(power.get(n) == ON for n in waking):
            say(f"      {', '.join(waking)} started ({time.monotonic() - t0:.0f} s)")
            return waking
        if time.monotonic() >= deadline:
            raise slurm.SlurmError(
                f"nodes not started after {timeout_s:.0f} s: "
                + ", ".join(f"{n} ({power.get(n, 'unknown')})" for n in waking if power.get(n) != ON)
                + "; see /var/log/slurm/slurm-gpu-power.log and slurmctld.log on the controller")
        time.sleep(poll_s)
        power = node_power(cl.controller) or power
