"""The local cluster as data, before anything is made: its hosts, the ClusterFacts the
rendered files come from, and its cluster spec (cluster/spec.py), written as the inventory `fab`
reaches it with."""

from __future__ import annotations

from pathlib import Path

from cluster.facts import ClusterFacts, NodeShape, plan_hosts, this_machine_topology
from cluster.inventory import Inventory
from cluster.platform import LOCAL
from cluster.spec import Access
from localcluster import power_save as power
from localcluster import topology as layout
from localcluster.state import HostSpec

REPO = Path(__file__).resolve().parent.parent


def host_specs(nodes: int) -> list[HostSpec]:
    """The controller, then gpu-node-01..NN, at the addresses of docs/ARCHITECTURE.md."""
    ctl, gpu_hosts = plan_hosts(layout.SUBNET, nodes)
    return [HostSpec(ctl.name, ctl.ip, "controller", 0)] + [
        HostSpec(h.name, h.ip, "gpu", i) for i, h in enumerate(gpu_hosts, start=1)
    ]


def machine_shape(gpus: int) -> NodeShape:
    """What every GPU host reports: this machine's CPUs and their topology (as its slurmd counts
    them), memory a little under its own."""
    mem_kib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal:"))
    cpus, sockets, threads = this_machine_topology()
    return NodeShape(cpus=cpus, real_memory_mib=int(mem_kib / 1024 * 0.9), gpu_count=gpus,
                     gpu_type=layout.GPU_TYPE, sockets=sockets, threads_per_core=threads)


# How long a requeued job waits before it starts again (AuthInfo=cred_expire). It must stay above
# slurmctld's 60 s retry of the terminate request to a lost node, or that late retry kills the new
# attempt (same job id) when the node is back. A cluster where no node is ever lost (a job that
# requeues itself: a hang, a spot notice) may pass a shorter one (up's cred_expire).
CRED_EXPIRE_S = 70


def cluster_facts(nodes: int, gpus: int, idle_stop_s: int = 0, cred_expire: int | None = None) -> ClusterFacts:
    ctl, gpu_hosts = plan_hosts(layout.SUBNET, nodes)
    return ClusterFacts(
        cluster_name=layout.CLUSTER_NAME, controller=ctl, gpu_nodes=gpu_hosts,
        shape=machine_shape(gpus), subnet_cidr=layout.SUBNET, ssh_user="root",
        # Jobs run as root here: the nodes' Python is the repo's venv, whose interpreter may lie in
        # root's home, out of another user's reach. The boot test runs them as JOB_USER, as on AWS.
        job_user="root", job_uid=0,
        scratch="/scratch", platform=LOCAL, efa=False, nvlink=False,
        # A lost host is marked DOWN (and its job requeued) in seconds, not AWS's 180 s. The
        # requeued job waits cred_expire before it starts again (CRED_EXPIRE_S above).
        slurmd_timeout=15, cred_expire=CRED_EXPIRE_S if cred_expire is None else cred_expire,
        power_save=power.power_save(idle_stop_s),
        # A removed stand-in GPU drains its node within 15 s (AWS: 60 s between checks).
        health_check_interval=15,
        # A requeued job starts within seconds of its start time (Slurm's next pass: 60 s by default).
        sched_interval=5,
    )


def make_inventory(nodes: int, gpus: int, idle_stop_s: int = 0, cred_expire: int | None = None) -> Inventory:
    facts = cluster_facts(nodes, gpus, idle_stop_s, cred_expire)
    return Inventory(target="local", facts=facts, access=Access(
        controller_public_ip=facts.controller.ip,
        # Hosts share this machine's filesystem, so the repo's venv is the nodes' Python.
        python=str(REPO / ".venv" / "bin" / "python"),
        service_cmd=f"{layout.HOSTCTL} {{action}} {{service}}",
        ssh_key_file=str(layout.CLUSTER_KEY),
        known_hosts=str(layout.KNOWN_HOSTS),
    ))

