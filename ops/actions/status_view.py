"""`fab status`: the cluster's hosts, Slurm's nodes and the queue, and what is wrong with them.

One line per host (address, power state from sinfo's flags, reachable or not), then the first-boot
failures, a down slurmctld, `sinfo` and `squeue`, and a note with the fix for each GPU node that is
not in service. Anything wrong ends in `StatusProblem` (fab exits 1), after everything readable
was shown.
"""

from __future__ import annotations

from paramiko.ssh_exception import SSHException

from cluster.errors import UserError
from cluster.inventory import Inventory
from ops.actions import cloudinit, node_update, slurm
from ops.actions import node_power as power
from ops.say import Say, shown
from ops.ssh.remote import Cluster, HostError, each

SINFO = "sinfo -N -o '%N %9T %G %E'"
SQUEUE = "squeue -o '%.8i %.22j %.8u %.10T %.10M %.6D %R'"


class StatusProblem(UserError, RuntimeError):
    """The cluster is not fully in service; the message says what and where (shown above it)."""


def idle_stop_line(inv: Inventory) -> str:
    idle_stop = inv.idle_stop_s
    if not idle_stop:
        return "  idle GPU nodes never stop (power saving off)"
    return (f"  idle GPU nodes stop after {idle_stop // 60 or idle_stop} "
            f"{'min' if idle_stop >= 60 else 's'} (power saving)")


def node_fix(n: slurm.NodeState) -> str:
    """What brings a GPU node that is not in service back."""
    resume = f"`scontrol update nodename={n.name} state=resume` on the controller"
    if n.health_drained:
        return f"the GPU health check drained it; fix the GPU, then {resume}"
    if n.state.endswith("*"):
        return "its slurmd does not answer the controller; start slurmd there (`fab train` restarts and resumes nodes)"
    return f"`fab train` resumes it, or {resume}"


# How long the host's own systemd (PID 1) has run, and the host's clock now, in unix seconds.
# Not the kernel's uptime (`uptime`, /proc/uptime): a container shares its machine's kernel and
# would show the machine's. A host with no systemd of its own (a local-cluster namespace) prints
# no start time, and its line shows none. (`-P`: systemd 246; `--timestamp=unix`: 248.)
UPTIME_CMD = "systemctl show --timestamp=unix -P UserspaceTimestamp 2>/dev/null; date +%s"


def uptime_text(out: str) -> str:
    """UPTIME_CMD's output -> "up 5 min" (how long the host's systemd has run), or "up" (reachable,
    no start time to trust)."""
    words = out.split()
    try:
        start, now = float(words[0].removeprefix("@")), int(words[1])
    except (IndexError, ValueError):
        return "up"
    secs = int(now - start)
    if len(words) != 2 or not words[0].startswith("@") or start <= 0 or secs < 0:
        return "up"
    if secs < 60:
        return f"up {secs} s"
    days, mins = divmod(secs // 60, 1440)
    hours, mins = divmod(mins, 60)
    if days:
        return f"up {days} d {hours} h"
    return f"up {hours} h {mins} min" if hours else f"up {mins} min"


def reachability(conns: dict) -> dict[str, str]:
    """host -> "up 5 min" (see uptime_text), or "UNREACHABLE: why"."""
    try:
        return each("ssh", conns, lambda n, conn: uptime_text(conn.run(UPTIME_CMD, hide=True, warn=True).stdout))
    except HostError as exc:
        # A jump host (the controller) that cannot be reached is reported under its own key,
        # before any host ran anything: then no host is reachable.
        jump = next((why for host, why in exc.failures.items() if host not in conns), None)
        return {n: f"UNREACHABLE: {exc.failures.get(n, jump)}" if n in exc.failures or jump else "up"
                for n in conns}


def show(cl: Cluster, say: Say = print) -> None:
    inv = cl.inventory
    say(f"{inv.target} cluster {inv.cluster_name!r}: {len(inv.gpu_nodes)} GPU node(s) x "
        f"{inv.gpus_per_node} {inv.gpu_type}")
    ctld_up = False
    try:
        ctld_up = slurm.controller_up(cl.controller)  # sinfo would retry for a minute without it
        powers = (power.node_power(cl.controller) or {}) if ctld_up else {}
    except (OSError, SSHException):  # reported below: the controller does not answer
        powers = {}
    say(idle_stop_line(inv))
    # A stopped node has no SSH to probe: its power state says it all.
    stopped = {n for n, p in powers.items() if p == "stopped"}
    conns = {"controller": cl.controller, **{n: c for n, c in cl.nodes.items() if n not in stopped}}
    up = reachability(conns)
    for node in inv.nodes:
        addr = node.public_ip or node.private_ip
        pw = f"power {powers[node.name]}" if node.name in powers else ""
        text = "(no SSH while stopped; the next job starts it)" if node.name in stopped else up.get(node.name, "?")
        say(f"  {node.name:<14} {node.role:<10} {addr:<16} {pw:<22} {text}")
    if up.get("controller", "").startswith("UNREACHABLE"):
        raise StatusProblem("the controller is unreachable")
    failed_boot = cloudinit.bootstrap_failures({n: c for n, c in conns.items()
                                                if not up.get(n, "").startswith("UNREACHABLE")})
    for name, why in failed_boot.items():
        say(f"note: {name}: {why}")
    answering = [n for n in cl.nodes if n in conns and not up.get(n, "").startswith("UNREACHABLE")]
    for line in node_update.behind_notes(cl, answering):  # a code update reaches nodes by fab update-nodes
        say(line)
    if failed_boot:
        raise StatusProblem(f"the first boot failed on {', '.join(failed_boot)} (above: the step and the end "
                            "of its log)")
    if not ctld_up:
        restart = inv.service_cmd.format(action="restart", service="slurmctld")
        raise StatusProblem("slurmctld is DOWN on the controller (`scontrol ping`); jobs may still run on the "
                            f"nodes. Restart it there (`{restart}`) and check its log "
                            "(/var/log/slurm/slurmctld.log)")
    # Reasons (%E) and job names (%j) are anyone's text: shown escaped.
    say(shown(cl.controller.run(SINFO, hide=True, warn=True).stdout.rstrip(), block=True))
    say(shown(cl.controller.run(SQUEUE, hide=True, warn=True).stdout.rstrip(), block=True))
    nodes = slurm.node_states(cl.controller).values()
    sick = [n for n in nodes if n.needs_resume or n.health_drained or n.state.endswith("*")]
    for n in sick:
        say(f"note: {n.name} is {n.state}" + (f" ({shown(n.reason)})" if n.reason else "") + f": {node_fix(n)}")
    # Powered down again at once after its start failed (EC2 capacity, say): the error and what to do.
    no_start = [n for n in nodes if n not in sick and power.start_failure(n)]
    for n in no_start:
        say(f"note: {n.name} could not start ({shown(n.reason)}): {shown(power.advice(n.reason))}")
    if sick or no_start:
        raise StatusProblem(f"{len(sick) + len(no_start)} of {len(inv.gpu_nodes)} GPU node(s) not in service")
