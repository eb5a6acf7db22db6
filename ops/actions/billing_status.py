"""`fab status`'s money lines: what the stack still bills per hour and per day (ops/cost/still_bills.py),
how to stop it, and what it has cost since it was created (ops/cost/spend.py).

Kept apart from status_view.py (the hosts and Slurm) so each reads on its own. Nothing here fails
`fab status`: a price, the AWS API or the controller's power log that cannot be read is said on its line.
"""

from __future__ import annotations

import shlex

from paramiko.ssh_exception import SSHException

from cluster import targets
from cluster.errors import UserError
from cluster.facts import STACK_TAG
from cluster.inventory import Inventory
from ops.actions import node_power as power
from ops.actions.options import ClusterOptions
from ops.cost import estimate as est
from ops.cost import spend, still_bills
from ops.say import Say
from ops.ssh.remote import Cluster, sudo


def power_log(cl: Cluster) -> str | None:
    """The controller's power-program log (the GPU nodes' stops and starts), or None when unreadable."""
    try:
        res = sudo(cl.controller, f"cat {shlex.quote(power.POWER_LOG)}", warn=True)
    except (OSError, SSHException):
        return None
    return res.stdout if res.ok else None


def node_counts(cl: Cluster) -> tuple[int, int]:
    """(GPU nodes on, GPU nodes stopped) from Slurm's power states; every node counts as on when Slurm does
    not answer (the dearer guess)."""
    try:
        powers = power.node_power(cl.controller) or {}
    except (OSError, SSHException):
        powers = {}
    names = [n.name for n in cl.inventory.gpu_nodes]
    stopped = sum(1 for n in names if powers.get(n) == "stopped")
    return len(names) - stopped, stopped


def stack_tag(inv: Inventory) -> str | None:
    """The stack's STACK_TAG value (organization/project/stack) as its inventory records it (infra/
    cluster_component.py; cluster/spec.py reads an older inventory's from its power programs' copy)."""
    return inv.facts.stack


def show(cl: Cluster, where: ClusterOptions, say: Say = print, ec2=None) -> None:
    """The money lines of `fab status`. `ec2`: an EC2 client (default: boto3's in the stack's region)."""
    inv = cl.inventory
    if not targets.of(inv).real_gpus:
        say(f"  billing: nothing (the {inv.target} cluster runs on this machine)")
        return
    try:
        priced = est.cluster_for(inv.target, where.stack, inv)
    except UserError as exc:
        say(f"  billing: cannot price this stack ({exc})")
        return
    on, stopped = node_counts(cl)
    for line in still_bills.lines(still_bills.still_billing(priced, on, stopped, where.stack)):
        say(line)
    stack = stack_tag(inv)
    if not stack:
        say(f"  spent so far: unknown (this stack's inventory does not name its {STACK_TAG} tag, which the "
            "spend is looked up by: `pulumi up` adds it)")
        return
    log = power_log(cl)
    try:
        client = ec2 or spend.ec2_client(priced.region, priced.profile)
        so_far = spend.so_far(client, stack, priced.region, log)
    except Exception as exc:  # noqa: BLE001 - botocore's many errors (no credentials, denied): said, not raised
        say(f"  spent so far: unknown ({type(exc).__name__}: {exc}); it needs ec2:DescribeInstances, "
            "DescribeVolumes and DescribeNatGateways with the credentials `pulumi` uses")
        return
    if so_far.items and log is None:
        so_far.notes.append(f"the controller's power log ({power.POWER_LOG}) was not readable: GPU nodes count as "
                            "running except for EC2's last stop")
    for line in spend.lines(so_far):
        say(line)
