"""Idle GPU nodes stop and come back for a job: Slurm power saving on the local cluster.

The same slurm.conf keys as AWS (SuspendProgram, ResumeProgram, SuspendTime, ...) with
the local programs (localcluster/power.sh), which stop and start a host's slurmd. Idle
stop is 5 s here; slurmctld looks every second, a stop takes SuspendTimeout (2 s), and a
batch job on powered-up nodes leaves CONFIGURING at slurmctld's next periodic check
(every 30 s in Slurm 22.05), so the test takes about a minute. A node that cannot start is
powered down again at once with the reason (about 20 s).
"""

from __future__ import annotations

import re
import shlex
import time
import uuid

import pytest
from fabric import Config
from invoke import Context

from ops.actions import node_power as power
from ops.actions import slurm
from ops.ssh import remote
from tests.support.local_cluster import fresh_cluster, wait_for

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
        assert inv.idle_stop_s == IDLE_STOP_S
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


def test_a_node_that_cannot_start_is_powered_down_at_once_with_the_reason():
    """A start that fails (here: gpu-node-02's sshd is down, so the local power program cannot reach
    it; on AWS an EC2 error such as InsufficientInstanceCapacity) goes through the same program's
    start-failed path: Slurm powers the node down again at once with the error as its reason, well
    before ResumeTimeout; the node that did start is left alone; `fab train`'s wake step and
    `fab status` show the reason and what to do; once the cause is gone the node starts again."""
    from localcluster import daemons
    from localcluster.power_save import RESUME_TIMEOUT_S
    from tests.cluster.test_faults_cluster import fab
    from tests.cluster.test_node_loss import holder

    with fresh_cluster(nodes=2, gpus=1, idle_stop_s=IDLE_STOP_S) as (inv, _):
        cl = remote.connect(inv)
        try:
            ctl = cl.controller
            wait_power(ctl, "stopped")
            daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "stop", "sshd")
            try:
                # fab train's first step starts both; it ends as soon as Slurm has the failure (the
                # bound is half of ResumeTimeout: today's code only times out).
                said: list[str] = []
                with pytest.raises(slurm.SlurmError) as err:
                    power.wake(cl, said.append, timeout_s=RESUME_TIMEOUT_S / 2)
                msg = str(err.value)
                assert msg.startswith("could not start gpu-node-02 (start failed: HostUnreachable: "), msg
                assert "Connection refused" in msg and "fix what the error says" in msg, msg
                assert "starts it again" in msg, msg

                # The real scontrol: powered down (not DOWN after ResumeTimeout), with the reason.
                node = ctl.run("scontrol show node gpu-node-02", hide=True).stdout
                assert "Reason=start failed: HostUnreachable: " in node, node
                state = re.search(r"State=(\S+)", node)[1]  # e.g. IDLE+POWER_DOWN, IDLE+POWERING_DOWN
                assert state.split("+")[0] == "IDLE" and "POWER" in state, node
                assert "ResumeTimeout reached" not in node
                # Only the node that did not start (gpu-node-01 started; idle, it may stop again soon).
                one = slurm.node_states(ctl)["gpu-node-01"]
                assert not one.reason and "down" not in one.state, one
                log = ctl.run(f"cat {POWER_LOG}", hide=True).stdout
                assert "could not start gpu-node-02: start failed: HostUnreachable" in log, log
                assert "could not start gpu-node-01" not in log, log

                # fab status, once it has stopped: the reason and the advice, exit 1.
                assert wait_for(lambda: (power.node_power(ctl) or {}).get("gpu-node-02") == "stopped", 30)
                rc, out = fab("status", "--target", "local")
                assert rc == 1, out
                note = next(ln for ln in out.splitlines() if ln.startswith("note: gpu-node-02"))
                assert note.startswith("note: gpu-node-02 could not start (start failed: HostUnreachable: "), out
                assert "fix what the error says" in note and POWER_LOG in note, note
                assert "1 of 2 GPU node(s) not in service" in out, out
            finally:
                daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "start", "sshd")

            # The cause gone, the node starts again (what the next job or `fab train` does).
            said = []
            assert "gpu-node-02" in power.wake(cl, said.append)
            assert any("its last start failed: start failed: HostUnreachable" in s for s in said), said
            assert slurmd_running(cl, "gpu-node-02")
        finally:
            cl.close()
