"""Idle GPU nodes stop and come back for a job: Slurm power saving on the local cluster.

The same slurm.conf keys as AWS (SuspendProgram, ResumeProgram, SuspendTime, ...) with
the local programs (localcluster/power.sh), which stop and start a host's slurmd. Idle
stop is 5 s here; slurmctld looks every second, a stop takes SuspendTimeout (2 s), and a
batch job on powered-up nodes leaves CONFIGURING at slurmctld's next periodic check
(every 30 s in Slurm 22.05), so the test takes about a minute.
"""

from __future__ import annotations

import re
import shlex
import time
import uuid

import pytest
from fabric import Config
from invoke import Context

from ops import power, remote, slurm
from tests.localcluster_fixture import fresh_cluster

pytestmark = pytest.mark.cluster

IDLE_STOP_S = 5
NODES = ("gpu-node-01", "gpu-node-02")
POWER_LOG = "/var/log/slurm/slurm-gpu-power.log"


def wait_power(ctl, want: str, timeout_s: float = 60) -> list[dict[str, str]]:
    """Poll until every GPU node's power state is `want`; return the states seen on the way."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while True:
        states = power.node_power(ctl) or {}
        if not seen or states != seen[-1]:
            seen.append(states)
        if all(states.get(n) == want for n in NODES):
            return seen
        assert time.monotonic() < deadline, f"GPU nodes not all {want} after {timeout_s} s: {seen}"
        time.sleep(0.5)


def power_log_hosts(ctl, action: str) -> set[str]:
    """The hosts the power programs were asked to stop or start: slurmctld passes the nodes of
    one power-save scan as one hostlist, and nodes that went idle in different seconds as two."""
    log = ctl.run(f"cat {POWER_LOG}", hide=True).stdout
    hosts: set[str] = set()
    for hostlist in re.findall(rf"slurm-gpu-power: {action} (\S+)$", log, re.M):
        hosts.update(ctl.run(f"scontrol show hostnames {shlex.quote(hostlist)}", hide=True).stdout.split())
    return hosts


def slurmd_running(cl, name: str) -> bool:
    res = remote.service(cl.nodes[name], cl.inventory, "status", "slurmd", warn=True)
    return res.ok


def test_idle_nodes_stop_and_a_job_starts_them(capsys):
    with fresh_cluster(nodes=2, gpus=1, idle_stop_s=IDLE_STOP_S) as (inv, job_dirs):
        assert inv.extra["idle_stop_s"] == IDLE_STOP_S
        cl = remote.connect(inv)
        try:
            ctl = cl.controller
            conf = ctl.run("cat /etc/slurm/slurm.conf", hide=True).stdout
            assert f"SuspendTime={IDLE_STOP_S}\n" in conf and "ResumeProgram=" in conf

            # Idle nodes power down: idle -> idle% (stopping) -> idle~ (stopped), slurmd gone.
            seen = wait_power(ctl, "stopped")
            assert any(s.get("gpu-node-01") == "stopping" for s in seen), seen
            assert not any(slurmd_running(cl, n) for n in NODES)
            assert power_log_hosts(ctl, "stop") == set(NODES)

            # fab status shows the power state per node.
            import fabfile

            fabfile.status(Context(config=Config()), target="local")
            out = capsys.readouterr().out
            assert "idle GPU nodes stop after 5 s" in out
            for n in NODES:
                line = next(ln for ln in out.splitlines() if ln.strip().startswith(n + " "))
                assert "power stopped" in line and "no SSH while stopped" in line, line

            # A job submitted now starts its nodes, waits for them (CONFIGURING), runs, completes.
            job_dir = f"/scratch/power-test-{uuid.uuid4().hex[:6]}"
            job_dirs.append(job_dir)
            ctl.run(f"mkdir -p {job_dir}", hide=True)
            res = ctl.run("sbatch --parsable -N 2 -o " + shlex.quote(f"{job_dir}/out-%j.txt")
                          + " --wrap 'srun hostname'", hide=True)
            job_id = res.stdout.strip()
            states = set()
            deadline = time.monotonic() + 120
            while (job := slurm.job(ctl, job_id)) is not None and not job.finished:
                states.add(job.state)
                assert time.monotonic() < deadline, f"job {job_id} still {job.state}"
                time.sleep(0.5)
            assert job is not None and job.ok, job
            assert "CONFIGURING" in states, states  # it waited for its nodes to start
            out = ctl.run(f"cat {job_dir}/out-{job_id}.txt", hide=True).stdout.split()
            assert sorted(out) == list(NODES)
            assert power_log_hosts(ctl, "start") == set(NODES)
            assert all(slurmd_running(cl, n) for n in NODES)

            # fab train's first step: stopped nodes are started before anything touches them.
            wait_power(ctl, "stopped")
            said: list[str] = []
            assert power.wake(cl, said.append) == list(NODES)
            assert "gpu-node-01 is stopped (idle power-save); Slurm is starting it, a few seconds" in \
                [s.strip() for s in said]
            assert all(slurmd_running(cl, n) for n in NODES)
        finally:
            cl.close()
