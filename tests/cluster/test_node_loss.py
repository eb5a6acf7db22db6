"""Things going wrong on the real local cluster (2 GPU hosts x 2 ranks): a node with a stale munge
key, and a node lost in the middle of a fine-tune.

- Wrong key: gpu-node-01 comes up with a different munge key (as a stale node would). Slurm can no
  longer talk to it: a job step on it fails and the controller marks it not responding. The key
  step of `fab train` finds it, repairs it, names it (and only it), and jobs run on both nodes again.
- Node loss: while `fab train` streams, gpu-node-02 dies (its slurmd and job processes killed, as
  in a crash) after the first checkpoint. Slurm requeues the job; once the node is back the job
  resumes from the checkpoint and finishes with the same global step count as an uninterrupted run;
  `fab train` reports the requeue and the resume step and streams to the summary.

The local cluster renders slurm.conf with SlurmdTimeout=15 and cred_expire=70 (AWS: 180 and 120),
so Slurm notices the loss within seconds and restarts the job about a minute later.
"""

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.support.local_cluster import fresh_cluster

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
# Processes that are part of the host, not of Slurm or the job: they survive the "crash", so the
# host can be reached again (as a rebooted node would be).
KEEP = {"munged", "sshd", "sleep"}

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODES = ("gpu-node-01", "gpu-node-02")

@pytest.fixture(scope="module")
def local_cluster():
    """A healthy cluster (every host has the controller's key), torn down at the end."""
    with fresh_cluster(nodes=2, gpus=2, fresh_keys=False) as (inv, job_dirs):
        yield inv, job_dirs


def holder(name: str) -> int:
    """PID of a host's holder process (every command in that host is nsenter'ed through it)."""
    from localcluster import state

    return state.load().host(name).pid


def on(name: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    from localcluster import hosts

    return hosts.run(holder(name), list(argv), check=False, timeout=timeout)


def node_state(name: str) -> str:
    return on("controller", "sinfo", "-h", "-n", name, "-o", "%T").stdout.strip()


def wait_for(what: str, probe, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)


# ---------------------------------------------------------------- wrong munge key


def test_node_with_wrong_munge_key_is_repaired_and_named(local_cluster):
    from localcluster import daemons
    from localcluster import topology as layout
    from ops.finetune import pipeline as flow
    from ops.ssh import remote

    inv, _ = local_cluster
    assert on("controller", "srun", "-N2", "hostname").returncode == 0  # healthy to begin with

    # gpu-node-01 comes up with a key of its own (a stale image, a re-made node).
    key = layout.host_dir("gpu-node-01") / "etc-munge" / "munge.key"
    key.chmod(0o600)
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    shutil.chown(key, "munge", "munge")
    daemons.hostctl(holder("gpu-node-01"), "gpu-node-01", "restart", "munge")

    # Slurm cannot use it: a step there is refused (the node cannot decode the controller's
    # credentials, nor the controller the node's replies) ...
    res = on("controller", "srun", "-N1", "-w", "gpu-node-01", "-t", "1", "hostname", timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "gpu-node-01" not in res.stdout.split()
    # ... and the controller, whose pings it can no longer answer, marks it DOWN "Not responding"
    # after SlurmdTimeout (the repair below then returns it: ReturnToService=1, or fab's resume).
    wait_for("gpu-node-01 to be marked down", lambda: node_state("gpu-node-01") == "down*", 60)
    reason = on("controller", "sinfo", "-h", "-n", "gpu-node-01", "-o", "%E").stdout.strip()
    assert reason == "Not responding", reason
    assert on("controller", "srun", "-N1", "-w", "gpu-node-02", "hostname").stdout.strip() == "gpu-node-02"

    # `fab train`'s key and service steps find it, repair it, and say so.
    said: list[str] = []
    cl = remote.connect(inv)
    try:
        changed = flow.sync_munge_key(cl, said.append)
        flow.nodes_to_service(cl, changed, said.append, timeout_s=90)
    finally:
        cl.close()
    out = "\n".join(said)
    assert changed == ["gpu-node-01"], out
    assert "gpu-node-01 (repaired: it had a different key)" in out, out
    assert "skipped gpu-node-02 (already matching)" in out, out
    assert not re.search(r"gpu-node-02 \((repaired|installed)", out), out
    assert "restarted slurmd on gpu-node-01; all 2 nodes idle" in out, out

    res = on("controller", "srun", "-N2", "hostname")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == ["gpu-node-01", "gpu-node-02"]


# ---------------------------------------------------------------- node loss


def crash(name: str) -> list[str]:
    """SIGKILL slurmd and every job process inside host `name` (the host's own namespace only:
    a pkill in the root namespace would hit every host's processes). Returns what was killed."""
    from localcluster import hosts

    pid = holder(name)
    net = hosts.ns_ids(pid)["net"]
    killed = []
    for p in hosts.processes_in({net}):
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if p == pid or comm in KEEP:
            continue
        try:
            os.kill(p, signal.SIGKILL)
            killed.append(comm)
        except ProcessLookupError:
            pass
    return killed


def restarts(job_id: str) -> int:
    out = on("controller", "scontrol", "show", "job", "-o", job_id).stdout
    m = re.search(r"\bRestarts=(\d+)", out)
    return int(m[1]) if m else 0


@contextmanager
def frozen(job_id: str, nodes, per_node: int) -> Iterator[list[int]]:
    """The job's training ranks on `nodes` (`per_node` on each) stopped (SIGSTOP) while the test makes its fault,
    and continued after: the fault lands mid-run whatever this machine's speed (the tiny model trains a step in
    a tenth of a second on a fast machine, and `fab train` shows the log a poll late, so an unfrozen run can end
    between the test seeing a step and its fault landing). Ranks killed or ended meanwhile are skipped. The
    freeze lasts seconds: the hang watchers' floor (training/args.py hang_timeout_floor_s, 600 s by default)
    and gloo's 30-minute timeout are far off, and a signal sent to a stopped rank is delivered when it goes on."""
    from bootstrap.spot_watch import training_pids

    found = {n: training_pids(job_id, n) for n in nodes}
    # At least a rank per GPU on each node (a rank may have forked helpers: they run the same command line).
    assert all(len(p) >= per_node for p in found.values()), f"job {job_id}'s training processes: {found}"
    pids = [p for ps in found.values() for p in ps]
    stopped = []
    try:
        for p in pids:
            try:
                os.kill(p, signal.SIGSTOP)
                stopped.append(p)
            except ProcessLookupError:
                pass
        yield stopped
    finally:
        for p in stopped:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


def output_dir(job_dir: str) -> Path:
    """Where this machine sees a job's output folder (the job's /scratch is the local cluster's)."""
    from localcluster import topology as layout

    return layout.SCRATCH / os.path.relpath(job_dir, "/scratch") / "output"


def submitted(out: "Streamed", proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    """(job id, job folder) once `fab train` has said it submitted the job."""
    m = wait_for("fab train to submit the job",
                 lambda: re.search(r"submitted job (\d+): .* in (\S+);", out.text) or proc.poll() is not None,
                 timeout, 0.05)
    assert m is not True and proc.poll() is None, out.text
    return m[1], m[2]


class Streamed:
    """`fab train`'s output, read in a thread so the test can act on what it has seen so far."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def steps(self) -> list[int]:
        return [int(m[1]) for line in self.lines if (m := re.search(r"^\s+step (\d+)/\d+  loss", line))]


def test_node_loss_requeues_and_resumes_from_checkpoint(local_cluster, tmp_path):
    """Sharded over the 4 ranks of both nodes (training/sharding.py): the killed node's ranks held a quarter of the
    model each; the requeued job resumes sharded from the checkpoint's adapters and each rank's optimizer shard.
    The same crash unsharded differs only in the checkpoint read back, which the spot and hang tests
    (test_spot_cluster.py, test_hang_cluster.py) resume from after their requeues; each crash costs the
    requeue's cred_expire wait (localcluster/plan.py), so it runs once."""
    inv, job_dirs = local_cluster
    ranks = len(inv.gpu_nodes) * inv.gpus_per_node  # 2 x 2
    examples, save_steps = 320, 2
    cfg = yaml.safe_load((REPO / "training" / "configs" / "local-tiny.yaml").read_text())
    # Two epochs (40 optimizer steps): the ranks are frozen while the node is crashed (frozen()), so the run cannot
    # end before the fault lands however fast this machine trains. eval_split 0: every row trains, so the step
    # count below is an uninterrupted run's.
    cfg.update(save_steps=save_steps, save_total_limit=3, num_train_epochs=2, eval_split=0, sharding="fsdp")
    config = tmp_path / "node-loss.yaml"
    config.write_text(yaml.safe_dump(cfg))
    # What an uninterrupted run does: each rank sees ceil(examples / ranks) rows per epoch.
    per_rank_batches = math.ceil(math.ceil(examples / ranks) / cfg["per_device_train_batch_size"])
    expected_steps = per_rank_batches // cfg["gradient_accumulation_steps"] * int(cfg["num_train_epochs"])

    runs = tmp_path / "runs"
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs), "PYTHONUNBUFFERED": "1"}  # lines as they come
    proc = subprocess.Popen([FAB, "train", "--target", "local", "--skip-check", "--config", str(config),
                             "--examples", str(examples)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Streamed(proc)
    try:
        job_id, job_dir = submitted(out, proc)
        job_dirs.append(job_dir)
        # A checkpoint is complete (its trainer_state.json is written last): the ranks are frozen there, one node
        # is crashed, the others go on and find their peers gone.
        # Any complete one: save_total_limit rotates the first away a few steps later.
        output = output_dir(job_dir)
        wait_for("the first checkpoint",
                 lambda: any(output.glob("checkpoint-*/trainer_state.json")) or proc.poll() is not None, 240, 0.02)
        assert proc.poll() is None, out.text
        with frozen(job_id, NODES, inv.gpus_per_node):
            killed = crash("gpu-node-02")
        assert "slurmd" in killed and "slurmstepd" in killed, killed
        step_at_fault = max(out.steps(), default=0)
        assert step_at_fault < expected_steps, f"the run finished before the fault:\n{out.text}"

        # Slurm requeues the job (same id, restart count 1) ...
        wait_for(f"job {job_id} to be requeued", lambda: restarts(job_id) >= 1, 90)
        # ... and the node comes back: its slurmd starts again and registers (ReturnToService=1
        # returns a node that was DOWN only for not responding); the job waits for both nodes.
        from localcluster import daemons

        daemons.hostctl(holder("gpu-node-02"), "gpu-node-02", "start", "slurmd")
        rc = proc.wait(timeout=240)
        out.thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.text
    if rc != 0:  # what Slurm did, for the failure message
        from localcluster import topology as layout
        for h in ("controller", "gpu-node-02"):
            for f in (layout.host_dir(h) / "log-slurm").glob("*.log"):
                text += f"\n--- {h} {f.name}\n" + "\n".join(f.read_text().splitlines()[-60:])
    assert rc == 0, text

    # `fab train` reported the requeue and the resume, then kept streaming to the summary.
    assert re.search(rf"job {job_id} was requeued by Slurm \(restart 1\)", text), text
    assert "job restarted after a requeue (restart 1)" in text, text
    resumed = re.search(r"resumed from checkpoint step (\d+) \(\S*checkpoint-(\d+)\)", text)
    assert resumed, text
    resumed_step = int(resumed[1])
    assert resumed_step == int(resumed[2]) and resumed_step % save_steps == 0
    # Training goes on between reading the progress and the kill landing, so the bound is the last step
    # of the first attempt: every line streamed before the restarted attempt's header.
    restart_at = next(i for i, line in enumerate(out.lines) if "job restarted after a requeue" in line)
    first_attempt = [int(m[1]) for line in out.lines[:restart_at]
                     if (m := re.search(r"^\s+step (\d+)/\d+  loss", line))]
    assert step_at_fault <= max(first_attempt) < expected_steps, text
    assert save_steps <= resumed_step <= max(first_attempt), text
    later = out.lines[next(i for i, line in enumerate(out.lines) if "resumed from checkpoint" in line):]
    streamed = [int(m[1]) for line in later if (m := re.search(r"^\s+step (\d+)/\d+  loss", line))]
    assert streamed == list(range(resumed_step + 1, expected_steps + 1)), text  # streamed to the end
    assert f"job {job_id}: completed" in text, text
    assert re.search(r"^\s+steps\s+\S", text, re.M), text

    # The run's artifacts: adapters, and the same global step as an uninterrupted run.
    run = runs / job_id
    assert (run / "adapter_model.safetensors").is_file()
    metrics = json.loads((run / "metrics.json").read_text())
    state = json.loads((run / "trainer_state.json").read_text())
    assert metrics["train_steps"] == state["global_step"] == expected_steps, (metrics, state["global_step"])
    assert metrics["resumed_from_step"] == resumed_step
    assert metrics["world_size"] == ranks
    assert metrics["choices"]["sharding"] == {"value": f"fsdp {ranks}-way",
                                              "by": "config"}
    log = (run / "job.log").read_text()
    assert log.count("SLURM_GPU_JOB") == 2  # the first attempt's log kept (--open-mode=append)
