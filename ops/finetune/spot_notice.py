"""`fab train`'s word on a spot interruption: which node the watcher drained, and why (its Slurm reason)."""

from __future__ import annotations

import shlex

from fabric import Connection

from ops.actions import slurm
from ops.finetune.joblog import Event, JobLog, spot_line

# The reason bootstrap/spot_watch.py drains a node with: "spot interruption: ACTION at TIME".
REASON_PREFIX = "spot interruption:"


def drained(ctl: Connection, nodes: str) -> list[tuple[str, str]]:
    """(node, reason) of the nodes in hostlist `nodes` that the spot watcher drained. `nodes` comes
    from the job log: anything but a Slurm hostlist is not asked about (and it is quoted anyway)."""
    if slurm.hostlist(nodes) is None:
        return []
    res = ctl.run(f"sinfo -h -N -n {shlex.quote(nodes)} -o '%N|%E'", hide=True, warn=True, in_stream=False)
    out = []
    for line in res.stdout.splitlines() if res.ok else []:
        name, _, reason = line.partition("|")
        if reason.startswith(REASON_PREFIX) and (name, reason) not in out:
            out.append((name, reason.removeprefix(REASON_PREFIX).strip()))
    return out


def describe(ctl: Connection, log: JobLog, ev: Event) -> str:
    """The line for a SLURM_GPU_SPOT event, naming the drained node where Slurm has it."""
    if not ev.data.get("stop") or not log.nodes:
        return spot_line(ev.data)
    found = drained(ctl, log.nodes)
    if not found:
        return spot_line(ev.data)
    return spot_line(ev.data, ", ".join(n for n, _ in found), "; ".join(r for _, r in found))
