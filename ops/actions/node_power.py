"""Power state of GPU nodes (Slurm power saving) as fab reports and acts on it.

sinfo's long state carries a suffix for power saving: `idle~` powered down (the EC2
instance is stopped, or the local host's slurmd), `idle#` powering up, `idle%` powering
down, `idle!` power-down pending. A job that needs a stopped node starts it and waits
(CONFIGURING) on its own; `fab train` starts stopped nodes first (`wake`), because it
reaches every node over SSH before it submits anything.

A node its power program could not start (EC2 had no capacity, say) is powered down again at
once with the reason `start failed: CODE: MESSAGE` (bootstrap/scripts/power-ec2.py.j2 `start_failed`); the
next job that needs it starts it again. `start_failure` reads that reason; `advice` says what to do.
"""

from __future__ import annotations

import shlex
import time

from bootstrap import node_layout
from cluster import targets
from ops.actions import slurm
from ops.say import Say, shown
from ops.ssh.remote import Cluster, sudo

SUFFIXES = {"~": "stopped", "#": "starting", "%": "stopping", "!": "stopping soon"}
ON = "on"
DEFAULT_POWER_UP_TIME = "a few minutes"
DEFAULT_WAKE_TIMEOUT_S = 900.0


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


# EC2's "no capacity right now" answers (EC2 API Reference, "Error codes").
CAPACITY_CODES = ("InsufficientInstanceCapacity", "InsufficientHostCapacity",
                  "InsufficientReservedInstanceCapacity", "InsufficientCapacity", "UnfulfillableCapacity")
# StartInstances errors of a persistent spot node (EC2 API Reference, "Error codes"). Not here:
# capacity-not-available, capacity-oversubscribed, price-too-low are Spot *request status* codes
# (EC2 User Guide, "Spot request status codes"), never an API error; SpotMaxPriceTooLow cannot happen
# (the nodes set no maximum price: infra/market.py).
SPOT_REQUEST_GONE = "IncorrectSpotRequestState"  # the node's persistent request is closed or cancelled
SPOT_QUOTA = "MaxSpotInstanceCountExceeded"  # the family's Spot vCPU quota (open requests count too)
# The Spot vCPU quotas a GPU node's family falls under (EC2 User Guide, using-spot-limits.html; the
# codes: infra/quotas.py).
SPOT_QUOTA_CODES = "L-3819A6DF (G and VT), L-C4BD4855 (P5), L-7212CCBC (P4, P3, P2)"
POWER_LOG = node_layout.POWER_LOG


def start_failure(node: slurm.NodeState) -> str | None:
    """The reason of a node whose last start failed and that is not on since, else None."""
    if node.reason.startswith(node_layout.START_FAILED_REASON) and power_state(node.state) != ON:
        return node.reason
    return None


def advice(reason: str) -> str:
    """What the user can do about a failed start, from the error code in its reason."""
    code = reason.removeprefix(node_layout.START_FAILED_REASON).strip().split(":", 1)[0]
    retry = "Slurm powered it down again; the next job that needs it (or `fab train` again) starts it again"
    if code == SPOT_REQUEST_GONE:
        # Never `pulumi up --replace`: it deletes the node's root volume, and a stack whose spot request
        # is gone has nothing to lose by waiting. The power program already retried while the request
        # settled after a stop (bootstrap/scripts/power-ec2.py.j2); past that, look at the request.
        return ("this spot node's Spot request was not in a state to start the instance, even after the retries "
                "of the power program (right after a stop the request passes through `disabled`: "
                f"terraform-provider-aws#33399). {retry}. If it fails again, look at the request: `aws ec2 "
                "describe-spot-instance-requests --filters Name=instance-id,Values=INSTANCE_ID` (INSTANCE_ID "
                "from `fab status`); `cancelled` or `closed` means EC2 will not start this instance as spot "
                "again: docs/FAULTS.md says how to move the node without losing its data")
    if code == SPOT_QUOTA:
        return ("the account's Spot vCPU quota for the instance family is used up (open Spot requests count "
                "too): cancel unused spot requests, or ask for more: `aws service-quotas "
                "request-service-quota-increase --service-code ec2 --quota-code CODE --desired-value N` with "
                f"CODE {SPOT_QUOTA_CODES}. {retry}")
    if code in CAPACITY_CODES and "spot" in reason.lower():
        return (f"the Spot market has no capacity for this spot node now ({code}). An interrupted spot node is "
                "started again by EC2 itself when capacity returns (its root volume kept); until then, wait "
                f"({retry}), or move the stack to on-demand or a reservation (`pulumi config set "
                "slurm-gpu:gpuMarket on-demand`, which replaces the GPU nodes; docs/FAULTS.md)")
    if code in CAPACITY_CODES:
        return (f"AWS has no spare capacity for the instance type in the placement group's zone now. Wait and "
                f"retry ({retry}); or move to another Availability Zone that offers the type (`aws ec2 "
                "describe-instance-type-offerings --location-type availability-zone --filters "
                "Name=instance-type,Values=TYPE`, then `pulumi config set slurm-gpu:availabilityZone ZONE`, which "
                "replaces the cluster's instances); or reserve it: an open On-Demand Capacity Reservation made in "
                "the cluster's placement group is used by the nodes when they start (`aws ec2 "
                "create-capacity-reservation --placement-group-arn ARN ...`)")
    if code == "VcpuLimitExceeded":
        return ("the account's running On-Demand vCPU quota for the instance family is used up: stop other "
                f"instances or request a higher quota (Service Quotas, EC2). {retry}")
    return f"fix what the error says (log on the controller: {POWER_LOG}). {retry}"


def node_power(ctl) -> dict[str, str] | None:
    """node -> power state, or None when Slurm does not answer (a controller still booting)."""
    res = ctl.run("sinfo -h -N -o '%N|%T|%E'", hide=True, warn=True)
    if not res.ok:
        return None
    return {name: power_state(st.state) for name, st in slurm.parse_sinfo(res.stdout).items()}


def node_states(ctl) -> dict[str, tuple[slurm.NodeState, str]] | None:
    """node -> (its state and reason, when the reason was set), or None when Slurm does not answer."""
    res = ctl.run("sinfo -h -N -o '%N|%H|%T|%E'", hide=True, warn=True)
    if not res.ok:
        return None
    out = {}
    for line in res.stdout.splitlines():
        name, when, rest = (line.split("|", 2) + ["", ""])[:3]
        out.update({n: (st, when.strip()) for n, st in slurm.parse_sinfo(f"{name}|{rest}").items()})
    return out


def wake(cl: Cluster, say: Say, poll_s: float = 2.0, timeout_s: float | None = None) -> list[str]:
    """Start every stopped GPU node of the inventory and wait until all are on.

    Returns the nodes that were not on. Nodes still stopping are started once they have
    stopped (Slurm refuses to power up a node in the middle of powering down).
    """
    inv = cl.inventory
    names = [n.name for n in inv.gpu_nodes]
    seen = node_states(cl.controller)
    if seen is None:
        return []
    nodes = {n: st for n, (st, _) in seen.items()}
    power = {n: power_state(st.state) for n, st in nodes.items()}
    waking = [n for n in names if power.get(n, ON) != ON]
    if not waking:
        return []
    power_save = inv.facts.power_save
    eta = (targets.of(inv).power_up_time if power_save else None) or DEFAULT_POWER_UP_TIME
    # A failed start from before this one is history: only a new reason (or time) is this start's failure.
    before = {n: seen[n] for n in waking}
    for n in waking:
        say("      " + describe(n, power[n], eta))
        if start_failure(nodes[n]):
            say(f"      (its last start failed: {shown(nodes[n].reason)}; trying again)")
    timeout_s = timeout_s or float(power_save.resume_timeout if power_save else DEFAULT_WAKE_TIMEOUT_S)
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
        failed = {n: nodes[n].reason for n in requested if n in nodes and start_failure(nodes[n])
                  and seen[n] != before[n]}
        if failed:
            raise slurm.SlurmError(
                "could not start " + "; ".join(f"{n} ({shown(why)})" for n, why in failed.items())
                + ": " + shown(advice(next(iter(failed.values())))))
        if time.monotonic() >= deadline:
            raise slurm.SlurmError(
                f"nodes not started after {timeout_s:.0f} s: "
                + ", ".join(f"{n} ({power.get(n, 'unknown')})" for n in waking if power.get(n) != ON)
                + "; see /var/log/slurm/slurm-gpu-power.log and slurmctld.log on the controller")
        time.sleep(poll_s)
        seen = node_states(cl.controller) or seen
        nodes = {n: st for n, (st, _) in seen.items()}
        power = {n: power_state(st.state) for n, st in nodes.items()}
