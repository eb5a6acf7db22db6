"""`fab reconfigure` on the real local cluster: the node list changes on the
controller only, GPU hosts pick it up configless, a node with a running job is not removed
without --force, and a removed node comes back when the list grows again.

The stack's "pulumi up with another gpuNodeCount" is played by an inventory whose facts list
fewer nodes (what the stack's inventory output does after `pulumi up`).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from bootstrap import node_layout, render
from localcluster import topology as layout
from ops.actions import reconfigure, slurm
from ops.ssh import remote
from ops.ssh.remote import Cluster
from tests.support.local_cluster import fresh_cluster

pytestmark = pytest.mark.cluster


def _shrunk(cl: Cluster, keep: int) -> Cluster:
    inv = cl.inventory
    smaller = dataclasses.replace(inv, facts=dataclasses.replace(inv.facts, gpu_nodes=inv.facts.gpu_nodes[:keep]))
    return Cluster(smaller, cl.controller, {n.name: cl.nodes[n.name] for n in smaller.gpu_nodes})


def _job_state(ctl, job: str) -> str:
    return ctl.run(f"squeue -h -j {job} -o %T", hide=True, warn=True).stdout.strip()


def _running_job(ctl, node: str) -> str:
    job = ctl.run(f"sbatch -w {node} -t 10 -o /dev/null --wrap 'sleep 600'", hide=True).stdout.split()[-1]
    deadline = time.monotonic() + 30
    while _job_state(ctl, job) != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start: {_job_state(ctl, job)}"
        time.sleep(0.3)
    return job


def test_reconfigure_shrinks_refuses_busy_nodes_and_grows_back():
    with fresh_cluster(nodes=2, gpus=1) as (inventory, _):
        cl = remote.connect(inventory)
        ctl = cl.controller
        said: list[str] = []
        try:
            # The same node list: nothing installed, nothing restarted.
            pid = ctl.run("cat /run/slurmctld.pid", hide=True).stdout.strip()
            assert reconfigure.apply(cl, say=said.append).none
            assert "nothing to do" in said[-1]
            assert ctl.run("cat /run/slurmctld.pid", hide=True).stdout.strip() == pid

            # A job on gpu-node-02: removing that node is refused, and nothing changes.
            job = _running_job(ctl, "gpu-node-02")
            one = _shrunk(cl, 1)
            before = (layout.ETC_SLURM / "slurm.conf").read_text()
            with pytest.raises(reconfigure.ReconfigureError, match=rf"gpu-node-02 runs job {job}\b.*drain"):
                reconfigure.apply(one, say=said.append)
            assert (layout.ETC_SLURM / "slurm.conf").read_text() == before
            assert sorted(slurm.node_states(ctl)) == ["gpu-node-01", "gpu-node-02"]
            assert _job_state(ctl, job) == "RUNNING"

            # --force cancels the job first, then removes the node; a job on the node that
            # stays keeps running through slurmctld's restart.
            stays = _running_job(ctl, "gpu-node-01")
            change = reconfigure.apply(one, force=True, say=said.append)
            assert _job_state(ctl, stays) == "RUNNING"
            ctl.run(f"scancel {stays}", hide=True)
            assert (change.added, change.removed) == ([], ["gpu-node-02"])
            assert f"cancelled with --force: job {job}" in said[-1]
            assert _job_state(ctl, job) == ""  # gone from the queue
            assert sorted(slurm.node_states(ctl)) == ["gpu-node-01"]
            facts = one.inventory.facts
            assert (layout.ETC_SLURM / "slurm.conf").read_text() == render.render_slurm_conf(facts)
            assert "gpu-node-02" not in ctl.run(f"cat {node_layout.HOSTS_BLOCK_FILE} /etc/hosts", hide=True).stdout
            # The remaining GPU host fetched the new configuration (configless): it no longer lists node 2.
            cached = cl.nodes["gpu-node-01"].run("cat /run/slurm/conf/slurm.conf", hide=True).stdout
            assert cached == render.render_slurm_conf(facts)
            deadline = time.monotonic() + 60
            while _job_state(ctl, stays):
                assert time.monotonic() < deadline, f"job {stays} did not end after scancel"
                time.sleep(0.3)
            assert ctl.run("srun -N1 -t 1 hostname", hide=True, timeout=60).stdout.split() == ["gpu-node-01"]

            # The stack grows back: the node returns, gets the key and a slurmd restart, and runs jobs.
            change = reconfigure.apply(cl, say=said.append)
            assert (change.added, change.removed) == (["gpu-node-02"], [])
            states = slurm.wait_idle(ctl, ["gpu-node-01", "gpu-node-02"], timeout_s=60)
            assert all(s.idle for s in states.values()), states
            out = ctl.run("srun -N2 -t 1 hostname", hide=True, timeout=60).stdout.split()
            assert sorted(out) == ["gpu-node-01", "gpu-node-02"]
            assert reconfigure.apply(cl, say=said.append).none  # and again: a no-op
        finally:
            cl.close()
