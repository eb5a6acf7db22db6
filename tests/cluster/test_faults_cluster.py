"""Faults a user hits on a running cluster, injected on the real local cluster.

One cluster (2 GPU hosts x 1 stand-in GPU) for the module, tests in order, each leaving every
node idle for the next:
- a wrong --identity key is named as the cause, not the network;
- `fab cancel`/`fab logs` of a job that does not exist fail and say so;
- a config naming a model path that does not exist fails before any host is changed;
- slurmctld down during a job: `fab status`, `fab local.status`, `fab cancel` and `fab reconfigure` say
  so (no traceback) while `fab ssh controller` still works, following
  the job waits it out (and says for what), giving up prints the `fab logs --job N` that reattaches;
- one slurmd stopped (half-up): `fab status` names the node and exits non-zero;
- one node's sshd stopped: `fab ssh` to it names the host and the fix;
- Ctrl-C during a remote command that has not ended raises at once and ends the command;
- nodes busy with someone's job: `fab train` says which job it waits for; `fab cancel` of it
  works once, then says it already ended;
- a finished run requeued by Slurm (what a node lost at the very end does): the requeued job exits
  0 without training again and `fab logs --job N` brings the adapters home; the first progress
  line is printed once;
- a job that fails in training shows the job log's own error line, not only FAILED.
The table of every case is docs/FAULTS.md.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from localcluster import daemons
from localcluster import topology as layout
from ops.actions import slurm
from ops.finetune import job_end, stream
from ops.finetune.joblog import JobLog
from ops.ssh import remote
from tests.cluster.test_node_loss import holder, on, wait_for
from tests.support.local_cluster import fresh_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
LOCAL_TINY = yaml.safe_load((REPO / "training" / "configs" / "local-tiny.yaml").read_text())


@pytest.fixture(scope="module")
def lc():
    with fresh_cluster(nodes=2, gpus=1) as (inv, job_dirs):
        cl = remote.connect(inv)
        try:
            yield inv, cl, job_dirs
        finally:
            cl.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def fab(*args, runs_dir=None, timeout=300):
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs_dir or "/nonexistent-runs")}
    res = subprocess.run([FAB, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    return res.returncode, res.stdout + res.stderr


def sbatch(*args: str) -> str:
    res = on("controller", "sbatch", "--parsable", *args)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str:
    m = re.search(r"JobState=(\S+)", on("controller", "scontrol", "show", "job", "-o", job_id).stdout)
    return m[1] if m else ""


def all_idle() -> bool:
    out = on("controller", "sinfo", "-h", "-N", "-o", "%T").stdout.split()
    return bool(out) and set(out) == {"idle"}


def config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**LOCAL_TINY, **changes}))
    return path


def submitted(out: str) -> tuple[str, str]:
    m = re.search(r"submitted job (\d+): .* in (\S+);", out)
    assert m, out
    return m[1], m[2]


# ------------------------------------------------------------------ bad input on a running cluster


def test_wrong_identity_is_blamed_on_the_key_not_the_network(lc, tmp_path):
    key = tmp_path / "id_wrong"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    for task in ("status", "logs", "train"):
        rc, out = fab(task, "--target", "local", "--identity", str(key))
        assert rc == 1, out
        assert f"the cluster refused the SSH key ({key})" in out, out
        assert "Pass --identity with the private key" in out, out
        assert "cannot reach" not in out and "Traceback" not in out, out


def test_cancel_and_logs_of_a_job_that_does_not_exist_fail(lc):
    for task in ("cancel", "logs"):
        rc, out = fab(task, "--target", "local", "--job", "4242")
        assert rc == 1, out
        assert "no job 4242 on this cluster" in out and "`fab status` lists the queue" in out, out


def test_config_naming_a_missing_model_fails_before_any_host_is_changed(lc, tmp_path):
    path = config(tmp_path, model_name_or_path="/scratch/no-such-model")
    rc, out = fab("train", "--target", "local", "--config", str(path))
    assert rc == 1, out
    assert (f"model_name_or_path /scratch/no-such-model (from --config {path.name}): no such path on the "
            "cluster (checked on the controller); copy it under /scratch first or fix the path") in out, out
    assert "[2/7]" not in out and "submitted job" not in out and "Traceback" not in out, out


# ------------------------------------------------------------------ the controller's munge key

KEY = "/etc/munge/munge.key"
BAD_KEYS = {
    # a valid-looking key that the controller's running munged does not use
    "random": (f"head -c 1024 /dev/urandom > {KEY}.bad && install -o munge -g munge -m 0400 {KEY}.bad {KEY} "
               f"&& rm {KEY}.bad", "is not the key its running munged uses"),
    "short": (f"head -c 16 /dev/urandom > {KEY}.bad && install -o munge -g munge -m 0400 {KEY}.bad {KEY} "
              f"&& rm {KEY}.bad", "is too short (16 bytes"),
    "directory": (f"rm -f {KEY} && mkdir {KEY}", "Is a directory"),
}


def test_a_controller_key_that_is_not_its_munged_key_changes_no_node(lc):
    """The controller's key file replaced (by 1024 random bytes its running munged does not use, by
    a short key, by a directory): `fab train` refuses at the key step naming `controller` (not its
    address) with the fix, every node keeps its key, and the check leaves nothing on the controller."""
    from ops.actions import munge

    inv, cl, _ = lc
    names = ["controller", *(n.name for n in inv.gpu_nodes)]

    def digests() -> dict[str, str]:
        return {n: on(n, "sha256sum", KEY).stdout.split()[0] for n in names}

    good = digests()
    assert len(set(good.values())) == 1, good
    for case, (spoil, says) in BAD_KEYS.items():
        assert on("controller", "cp", "-p", KEY, f"{KEY}.good").returncode == 0
        try:
            assert on("controller", "sh", "-c", spoil).returncode == 0, case
            rc, out = fab("train", "--target", "local")
        finally:
            on("controller", "sh", "-c", f"rm -rf {KEY} && mv {KEY}.good {KEY}")
            now = digests()
            if now != good:  # the code before this check copied the bad key: repair for the next tests
                munge.distribute_key(cl.controller, cl.nodes, inv.service_cmd)
        assert now == good, f"{case}: a node's key changed:\n{out}"
        assert rc == 1, out
        assert "munge key failed on controller:" in out and "controller: " in out, f"{case}: {out}"
        assert says in out and "no node was changed" in out, f"{case}: {out}"
        assert inv.controller.private_ip not in out and "[3/7]" not in out and "Traceback" not in out, out
        if case == "random":
            assert "If the file is the key you mean the cluster to use, restart munge there (`" in out, out
        left = on("controller", "sh", "-c", "ls -d /tmp/slurm-gpu-munge-probe.* 2>/dev/null; "
                                            "pgrep -a -f '[m]unged --socket=/tmp/slurm-gpu-munge-probe'")
        assert left.stdout.strip() == "", f"{case}: the key check left {left.stdout}"


# ------------------------------------------------------------------ slurmctld down


def test_slurmctld_down_is_said_and_waited_out(lc):
    inv, cl, _ = lc
    log = "/scratch/logs/outage-%j.out"
    job_id = sbatch("-J", "outage", "-N1", "-o", log, "--wrap", "echo begun; sleep 45; echo ended")
    log = log.replace("%j", job_id)
    wait_for("the job to run", lambda: job_state(job_id) == "RUNNING", 30)
    daemons.hostctl(holder("controller"), "controller", "stop", "slurmctld")
    try:
        rc, out = fab("status", "--target", "local")
        assert rc == 1, out
        assert "slurmctld is DOWN on the controller" in out and "jobs may still run on the nodes" in out, out
        assert "restart slurmctld" in out, out  # the restart command, from the inventory's service_cmd

        res = subprocess.run([FAB, "local.status"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
        assert "slurmctld:DOWN" in res.stdout, res.stdout

        # Tasks that need the controller name it and the restart (not "no job of ours", not sinfo's stderr).
        for task, doing in (("cancel", "cancel a job"), ("reconfigure", "be reconfigured")):
            rc, out = fab(task, "--target", "local")
            assert rc == 1 and "Traceback" not in out, out
            assert f"slurmctld is DOWN on the controller (`scontrol ping`), so it cannot {doing}" in out, out
            assert "restart slurmctld" in out, out
        rc, out = fab("ssh", "controller", "--target", "local", "--command", "hostname")  # the way in to fix it
        assert rc == 0 and out.strip() == "controller", out

        # A job query says so from `scontrol ping` (at once) rather than after its own 20 s bound.
        with pytest.raises(slurm.ControllerUnreachable, match=r"slurmctld does not answer \(`scontrol ping`: .*DOWN"):
            slurm.job(cl.controller, job_id)

        # Giving up (here after 2 s without an answer) names the job and how to reattach.
        said: list[str] = []
        with pytest.raises(slurm.ControllerUnreachable) as info:
            stream.follow(cl.controller, job_id, log, say=said.append, raw=True, controller_wait_s=2)
        assert f"job {job_id} may still be running" in "\n".join(said), said
        msg = str(job_end.controller_lost(info.value, job_id, "local"))
        assert "slurmctld does not answer" in msg and f"gave up waiting for job {job_id}" in msg, msg
        assert f"Reattach with `fab logs --target local --job {job_id}`" in msg, msg

        # Following with the default patience outlasts the outage and ends with the job's real end.
        said.clear()
        result: list = []
        follower = threading.Thread(target=lambda: result.append(
            stream.follow(cl.controller, job_id, log, say=said.append, raw=True)), daemon=True)
        follower.start()
        wait_for("follow to notice the outage", lambda: any("waiting for the controller" in s for s in said), 60)
    finally:
        daemons.hostctl(holder("controller"), "controller", "start", "slurmctld")
    follower.join(timeout=120)
    assert result, said
    followed = result[0]
    text = "\n".join(said)
    assert followed.job is not None and followed.job.state == "COMPLETED", (followed.job, text)
    assert "slurmctld answers again after" in text and "begun" in text and "ended" in text, text
    wait_for("all nodes idle", all_idle, 60)


# ------------------------------------------------------------------ half up, busy


def test_a_stopped_slurmd_is_named_by_fab_status(lc):
    daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "stop", "slurmd")
    try:
        wait_for("gpu-node-02 not responding", lambda: on("controller", "sinfo", "-h", "-n", "gpu-node-02",
                                                          "-o", "%T").stdout.strip().endswith("*"), 60)
        rc, out = fab("status", "--target", "local")
        assert rc == 1, out
        assert re.search(r"note: gpu-node-02 is \S+\*.*its slurmd does not answer the controller", out), out
        assert "fab status: 1 of 2 GPU node(s) not in service" in out, out
    finally:
        daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "start", "slurmd")
    wait_for("all nodes idle", all_idle, 60)


def test_fab_ssh_to_a_node_whose_sshd_is_down_names_the_host(lc):
    daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "stop", "sshd")
    try:
        rc, out = fab("ssh", "gpu-node-02", "--target", "local", "--command", "hostname")
        assert rc == 1 and "Traceback" not in out, out
        assert "fab ssh: ssh to gpu-node-02 failed (exit 255" in out and "its sshd running?" in out, out
    finally:
        daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "start", "sshd")
    rc, out = fab("ssh", "gpu-node-02", "--target", "local", "--command", "hostname")
    assert rc == 0 and out.strip() == "gpu-node-02", out


def test_ctrl_c_ends_a_running_remote_command_at_once(lc):
    """Ctrl-C during a remote command that has not ended (a `sinfo` on a busy slurmctld, a log being
    followed) raises KeyboardInterrupt while the command still runs, and the command ends with its session.
    Fabric alone waited for the command to finish first, so `fab train` outlived Ctrl-C."""
    inv, _, _ = lc
    probe = "sgpu-ctrl-c-probe"
    done, guard_fired = threading.Event(), threading.Event()

    def running() -> bool:  # "[s]gpu-..." matches the command, not this pgrep's own nsenter
        return on("controller", "pgrep", "-f", f"[s]{probe[1:]}").returncode == 0

    def interrupt():
        try:
            wait_for("the remote command to start", running, 30)
            os.kill(os.getpid(), signal.SIGINT)
        finally:
            if not done.wait(60):  # not interrupted: end the command so the test fails instead of hanging
                guard_fired.set()
                on("controller", "pkill", "-f", f"[s]{probe[1:]}")

    cl = remote.connect(inv)
    ctrl_c = threading.Thread(target=interrupt)
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            cl.controller.run(f"while :; do echo {probe}; sleep 0.2; done", hide=True)
    finally:
        done.set()
        ctrl_c.join()
        cl.close()
    assert not guard_fired.is_set(), "the interrupt waited for the remote command to end"
    wait_for("the interrupted command to end with its session", lambda: not running(), 30)


def test_busy_nodes_are_named_and_cancel_says_what_it_did(lc, runs):
    other = sbatch("-J", "someone-else", "-N2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 300")
    wait_for("the other job to run", lambda: job_state(other) == "RUNNING", 30)
    proc = subprocess.Popen([FAB, "train", "--target", "local"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "SLURM_GPU_RUNS": str(runs), "PYTHONUNBUFFERED": "1"})
    out = ""
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            out += line
            if "waiting (up to" in line or time.monotonic() > deadline:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        out += proc.communicate(timeout=60)[0]
    assert re.search(rf"waiting \(up to 180 s\) for job {other} \(root's job 'someone-else', running "
                     r"\d+:\d\d\) to free the nodes; cancel with", out), out
    assert "submitted job" not in out, out

    rc, out = fab("cancel", "--target", "local", "--job", other)
    assert rc == 0 and f"fab cancel: cancelled job {other} (someone-else, was RUNNING)" in out, out
    wait_for("the cancel", lambda: job_state(other) == "CANCELLED", 30)
    rc, out = fab("cancel", "--target", "local", "--job", other)
    assert rc == 1 and f"job {other} already ended (CANCELLED" in out and "nothing to cancel" in out, out
    wait_for("all nodes idle", all_idle, 60)


# ------------------------------------------------------------------ finished work is never lost


def test_a_requeued_finished_run_is_kept_not_retrained(lc, runs):
    inv, cl, job_dirs = lc
    rc, out = fab("train", "--target", "local", "--skip-check", "--examples", "16", runs_dir=runs)
    job_id, job_dir = submitted(out)
    job_dirs.append(job_dir)
    assert rc == 0, out
    assert len(re.findall(r"^\s+step 1/\d+  loss", out, re.M)) == 1, out  # the first line once
    assert "model model_name_or_path /scratch/tiny/model (from --config local-tiny.yaml)" in out, out
    adapters = runs / job_id / "adapter_model.safetensors"
    first = adapters.read_bytes()
    adapters.unlink()

    # A node lost while the job was ending makes Slurm run the batch script again (a requeue).
    log = layout.SCRATCH / "logs" / f"slurm-gpu-finetune-{job_id}.out"
    steps_before = log.read_text().count("SLURM_GPU_LOG")
    assert on("controller", "scontrol", "requeue", job_id).returncode == 0
    # Slurm holds a requeued job for CredExpire + 1 s (71 s here) so a lost node's late terminate
    # cannot hit the new attempt; no node is lost in this test, so start it now.
    assert on("controller", "scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
    wait_for("the requeued attempt to end", lambda: "training already completed" in log.read_text()
             and job_state(job_id) == "COMPLETED", 120)
    text = log.read_text()
    assert text.count("SLURM_GPU_JOB") == 2 and text.count("SLURM_GPU_LOG") == steps_before, text[-2000:]

    rc, out = fab("logs", "--target", "local", "--job", job_id, runs_dir=runs)
    assert rc == 0, out
    assert f"job {job_id}: completed" in out, out
    assert adapters.read_bytes() == first  # the finished run's adapters, home again

    # Slurm reporting the end as a failure (NODE_FAIL) does not lose it either: the marker decides.
    said: list[str] = []
    lost = slurm.Job(job_id, "slurm-gpu-finetune", "NODE_FAIL", "0:0", "", 1, "", "NodeDown", "")
    assert job_end.outcome(cl, job_id, stream.Followed(lost, JobLog()), job_dir, said.append)
    assert f"job {job_id} ended NODE_FAIL (NodeDown), but its training had completed" in said[0], said
    assert not job_end.outcome(cl, job_id, stream.Followed(lost, JobLog()), "/scratch/none", said.append)
    wait_for("all nodes idle", all_idle, 60)


def test_a_job_failing_in_training_shows_its_own_error(lc, runs, tmp_path):
    inv, cl, job_dirs = lc
    path = config(tmp_path, lora_target_modules=["nope_proj"])
    rc, out = fab("train", "--target", "local", "--skip-check", "--examples", "16", "--config", str(path), runs_dir=runs)
    job_id, job_dir = submitted(out)
    job_dirs.append(job_dir)
    assert rc == 1, out
    assert f"job {job_id} FAILED" in out and "the job log's error lines:" in out, out
    cause = out.split("the job log's error lines:", 1)[1]
    assert re.search(r"^  \S*Error: Target modules \S*nope_proj\S* not found in the base model", cause, re.M), out
    assert "Traceback" not in out.split("last lines of", 1)[0], out
