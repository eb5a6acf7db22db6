"""Apply the stack's node list to a running cluster (`fab reconfigure`, and a step of `fab train`).

GPU nodes run slurmd configless: only the controller holds slurm.conf and gres.conf. After
`pulumi up` changed `gpuNodeCount`, `apply` renders both (and the hosts block) from the
cluster facts the inventory carries, installs them on the controller, restarts slurmctld
(Slurm 21.08 and 22.05 take added or removed nodes only at a restart; running jobs survive
it, their state is saved in StateSaveLocation) and runs `scontrol reconfigure`, which makes
every slurmd fetch the new configuration. Added nodes get the cluster's munge key and a slurmd
restart (their first start, before the controller knew them, could not register).

A node to be removed that still runs a job is refused unless `force`, which cancels such jobs
first: Slurm 22.05 marks a job whose node left its configuration NODE_FAIL at once and leaves
its processes running on the node, unmanaged (seen on the local cluster; docs/AWS.md, "Scale").
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fabric import Connection

from bootstrap import node_layout, render
from cluster import targets
from cluster.errors import UserError
from cluster.facts import ClusterFacts
from cluster.inventory import Inventory
from ops.actions import cloudinit, munge, slurm
from ops.ssh.remote import Cluster, each, install_text, read_text, service, sudo

# The programs slurm.conf's SuspendProgram/ResumeProgram name: idleStopMinutes turned on after the
# first `pulumi up` needs them too (the controller ignores user-data changes).
POWER_PROGRAMS = (node_layout.SUSPEND_PATH, node_layout.RESUME_PATH, node_layout.POWER_PATH)


def controller_files(rendered: dict[str, str]) -> dict[str, str]:
    """What `apply` installs on the controller: Slurm's config dir (slurm.conf, gres.conf, and
    whatever else slurmctld serves to configless nodes), the hosts block and the power programs."""
    return {p: t for p, t in rendered.items()
            if p.startswith(node_layout.SLURM_CONF_DIR) or p == node_layout.HOSTS_BLOCK_FILE or p in POWER_PROGRAMS}


BUSY_STATES = "RUNNING,COMPLETING,CONFIGURING,SUSPENDED"


class ReconfigureError(UserError, RuntimeError):
    pass


@dataclass
class Change:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # controller files whose text changed

    @property
    def none(self) -> bool:
        return not (self.added or self.removed or self.files)


def facts_of(inv: Inventory) -> ClusterFacts:
    """What slurm.conf is rendered from: the cluster spec's facts (an inventory without them is
    refused when it is read, cluster/spec.py)."""
    return inv.facts


def slurm_nodes(ctl: Connection) -> list[str]:
    """The GPU nodes slurmctld knows now."""
    return sorted(slurm.node_states(ctl))


def busy_jobs(ctl: Connection, node: str) -> list[str]:
    """The ids of the jobs on `node` (squeue's output: only what has a job id's shape, slurm.JOB_ID)."""
    out = ctl.run(f"squeue -h -w {shlex.quote(node)} -t {BUSY_STATES} -o %i", hide=True, warn=True).stdout
    return [j for j in out.split() if slurm.JOB_ID.fullmatch(j)]


def plan(ctl: Connection, facts: ClusterFacts, files: dict[str, str]) -> Change:
    known = slurm_nodes(ctl)
    wanted = [h.name for h in facts.gpu_nodes]
    change = Change(added=[n for n in wanted if n not in known],
                    removed=[n for n in known if n not in wanted])
    change.files = [p for p in files if read_text(ctl, p) != files[p]]
    return change


def check_removals(ctl: Connection, removed: list[str], force: bool) -> dict[str, list[str]]:
    """Jobs on the nodes to remove; refused unless force, which cancels them and waits."""
    busy = {n: jobs for n in removed if (jobs := busy_jobs(ctl, n))}
    if busy and not force:
        what = "; ".join(f"{n} runs job {', '.join(j)}" for n, j in busy.items())
        names = ",".join(busy)
        raise ReconfigureError(
            f"{what}. Removing a node from Slurm's configuration ends what runs on it. Drain it "
            f"first (`scontrol update nodename={names} state=drain reason=scale-down` on the "
            "controller), let the job finish or cancel it, then run `fab reconfigure` again; "
            "--force cancels the job and removes the node")
    jobs = sorted({j for js in busy.values() for j in js}, key=lambda j: (int(j.split("_")[0]), j))
    if jobs:
        sudo(ctl, "scancel " + " ".join(map(shlex.quote, jobs)))
        deadline = time.monotonic() + 120  # KillWait (30 s) and the step's epilogue
        while any(busy_jobs(ctl, n) for n in busy):
            if time.monotonic() > deadline:
                raise ReconfigureError(f"job {', '.join(jobs)} did not end within 120 s of scancel; "
                                       "check `squeue` on the controller and try again")
            time.sleep(1)
    return busy


def wait_slurmctld(ctl: Connection, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "is UP" not in ctl.run("scontrol ping", hide=True, warn=True).stdout:
        if time.monotonic() > deadline:
            raise ReconfigureError(f"slurmctld did not answer within {timeout_s:.0f} s of its restart; "
                                   "see /var/log/slurm/slurmctld.log on the controller")
        time.sleep(0.5)


def apply(cl: Cluster, force: bool = False, say: Callable[[str], None] = print) -> Change:
    """Bring the controller's Slurm configuration to the inventory's node list."""
    inv, ctl = cl.inventory, cl.controller
    facts = facts_of(inv)
    files = controller_files(render.render_files(facts))
    change = plan(ctl, facts, files)
    if change.none:
        say(f"reconfigure: slurm.conf already lists {len(facts.gpu_nodes)} GPU nodes; nothing to do")
        return change
    busy = check_removals(ctl, change.removed, force)
    for path in change.files:
        install_text(ctl, files[path], path, node_layout.FILE_MODES.get(path, 0o644))
    if node_layout.HOSTS_BLOCK_FILE in change.files:
        hosts = read_text(ctl, "/etc/hosts") or ""
        install_text(ctl, render.merge_hosts(hosts, files[node_layout.HOSTS_BLOCK_FILE]), "/etc/hosts")
    service(ctl, inv, "restart", "slurmctld")
    wait_slurmctld(ctl)
    sudo(ctl, "scontrol reconfigure")
    if change.added:
        added = {n: cl.nodes[n] for n in change.added if n in cl.nodes}
        if targets.of(inv).cloud_init:  # a new instance may still be installing slurmd
            each("cloud-init", added, lambda n, c: cloudinit.wait_done(c))
        munge.distribute_key(ctl, added, inv.service_cmd)
        each("starting slurmd", added, lambda n, c: service(c, inv, "restart", "slurmd"))
    parts = [f"+{', +'.join(change.added)}" if change.added else "",
             f"-{', -'.join(change.removed)}" if change.removed else "",
             f"cancelled with --force: job {', '.join(j for js in busy.values() for j in js)}" if busy else ""]
    say(f"reconfigure: slurm.conf now lists {len(facts.gpu_nodes)} GPU nodes "
        f"({'; '.join(p for p in parts if p) or 'same nodes, new settings'}); slurmctld restarted, "
        "every slurmd fetched the new configuration")
    return change
