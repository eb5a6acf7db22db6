"""A spot interruption notice in the middle of a fine-tune, on the real local cluster (2 GPU hosts x 2 ranks).

Every GPU host runs the spot watcher (bootstrap/spot_watch.py, as its service would) against a stand-in
metadata service on that host's own loopback (tests/support/imds_standin.py). While `fab train` streams,
gpu-node-02's stand-in starts answering a stop notice. Within seconds the job checkpoints the step in
progress on every rank and stops, the node is drained with the notice as its reason, the job requeues;
the node's watcher starting again with no notice standing (the instance back after the stop) resumes
the node, the job resumes from that checkpoint and ends with an uninterrupted run's step count.
"""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.cluster.test_node_loss import (
    FAB,
    NODES,
    REPO,
    Streamed,
    frozen,
    holder,
    on,
    output_dir,
    restarts,
    submitted,
    wait_for,
)
from tests.support.local_cluster import fresh_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PORT = 18169  # each host's own 127.0.0.1: the stand-in metadata service


# No node is lost here (the job script requeues itself after the notice): the requeued job need not wait out the
# default cred_expire (localcluster.plan.CRED_EXPIRE_S, kept for a lost node's late terminate retry).
CRED_EXPIRE_S = 20


@pytest.fixture(scope="module")
def local_cluster():
    with fresh_cluster(nodes=2, gpus=2, fresh_keys=False, cred_expire=CRED_EXPIRE_S) as (inv, job_dirs):
        yield inv, job_dirs


class Host:
    """One GPU host's stand-in metadata service and watcher, started inside its namespaces."""

    def __init__(self, name, tmp_path):
        from localcluster import hosts

        self.name, self.tmp = name, tmp_path
        self.state = tmp_path / f"imds-{name}.json"
        self.state.write_text("{}")
        self.log = tmp_path / f"watch-{name}.log"
        self.imds = subprocess.Popen(
            hosts.nsenter_argv(holder(name), [sys.executable, str(REPO / "tests" / "support" / "imds_standin.py"), str(PORT),
                                               str(self.state)]),
            stdin=subprocess.DEVNULL)
        self.watch = None
        self.start_watch()

    def start_watch(self):
        from localcluster import hosts

        env = {**os.environ, "SLURM_GPU_IMDS": f"http://127.0.0.1:{PORT}", "SLURM_GPU_SPOT_POLL_S": "1",
               "SLURM_GPU_NODE": self.name, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "a") as log:
            self.watch = subprocess.Popen(
                hosts.nsenter_argv(holder(self.name), ["/usr/bin/python3", str(REPO / "bootstrap" / "spot_watch.py")]),
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def stop_watch(self):
        self.watch.terminate()
        self.watch.wait(timeout=10)

    def close(self):
        for p in (self.watch, self.imds):
            if p and p.poll() is None:
                p.terminate()
                p.wait(timeout=10)


def test_spot_notice_checkpoints_drains_requeues_and_resumes(local_cluster, tmp_path):
    inv, job_dirs = local_cluster

    ranks = len(inv.gpu_nodes) * inv.gpus_per_node
    examples, save_steps = 320, 10
    cfg = yaml.safe_load((REPO / "training" / "configs" / "local-tiny.yaml").read_text())
    # save_steps 10: the notice's checkpoint is not one the schedule would have written anyway.
    cfg.update(save_steps=save_steps, save_total_limit=3, num_train_epochs=3, eval_split=0)
    config = tmp_path / "spot.yaml"
    config.write_text(yaml.safe_dump(cfg))
    per_rank_batches = math.ceil(math.ceil(examples / ranks) / cfg["per_device_train_batch_size"])
    expected_steps = per_rank_batches // cfg["gradient_accumulation_steps"] * int(cfg["num_train_epochs"])

    hosts = {n: Host(n, tmp_path) for n in NODES}
    runs = tmp_path / "runs"
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([FAB, "train", "--target", "local", "--skip-check", "--config", str(config),
                             "--examples", str(examples)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Streamed(proc)
    try:
        job_id, job_dir = submitted(out, proc)
        job_dirs.append(job_dir)
        output = output_dir(job_dir)
        # Ten steps in (the schedule's first checkpoint is complete), every rank is frozen while the notice is posted
        # and the watcher signals gpu-node-02's ranks; then the run goes on and meets the signal at the end of its
        # step in progress. Frozen, a fast machine cannot finish the run before the notice lands.
        first = output / f"checkpoint-{save_steps}" / "trainer_state.json"
        wait_for("the first checkpoint", lambda: first.is_file() or proc.poll() is not None, 240, 0.02)
        assert proc.poll() is None, out.text
        notice_time = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
        with frozen(job_id, NODES, inv.gpus_per_node):
            shown_before = max(out.steps(), default=0)
            t0 = time.time()  # the notice appears: the watcher's poll, the drain and the signal count from here
            hosts["gpu-node-02"].state.write_text(json.dumps({"instance-action": {"action": "stop", "time": notice_time}}))
            wait_for("the watcher to signal gpu-node-02's ranks",
                     lambda: len(set(re.findall(r"SIGUSR1 to rank pid (\d+)", hosts["gpu-node-02"].log.read_text()))) >= 2,
                     30, 0.1)

        said = wait_for("fab to report the interruption",
                        lambda: re.search(r"spot interruption on (\S+) \((.*?)\): checkpoint at step (\d+), requeued",
                                          out.text) or proc.poll() is not None, 60, 0.1)
        assert proc.poll() is None, out.text
        node, reason, step = said[1], said[2], int(said[3])
        state_file = output / f"checkpoint-{step}" / "trainer_state.json"
        assert state_file.is_file(), out.text
        seconds = state_file.stat().st_mtime - t0
        print(f"\nnotice -> checkpoint-{step} complete: {seconds:.2f} s (the ranks frozen for part of it)")
        assert node == "gpu-node-02" and reason == f"stop at {notice_time}", out.text
        assert json.loads(state_file.read_text())["global_step"] == step
        # the step in progress at the notice, or the next: after the schedule's first checkpoint, which is not it
        assert step >= shown_before and step > save_steps, out.text

        # The node is drained with the notice as its reason; the job is requeued and waits for nodes.
        assert on("controller", "sinfo", "-h", "-n", "gpu-node-02", "-o", "%E").stdout.strip() == \
            f"spot interruption: stop at {notice_time}"
        wait_for(f"job {job_id} to be requeued", lambda: restarts(job_id) >= 1, 60)
        assert "drain" in on("controller", "sinfo", "-h", "-n", "gpu-node-02", "-o", "%T").stdout

        # Capacity is back: the instance starts again with no notice standing, its watcher with it.
        h = hosts["gpu-node-02"]
        h.stop_watch()
        h.state.write_text("{}")
        h.start_watch()
        rc = proc.wait(timeout=300)
        out.thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for h in hosts.values():
            h.close()
    text = out.text
    watch_log = hosts["gpu-node-02"].log.read_text()
    assert rc == 0, text + "\n--- watcher\n" + watch_log
    assert "gpu-node-02 is back; resumed it" in watch_log, watch_log
    # The watcher signalled the node's ranks itself (on AWS, proctrack/cgroup would not pass a
    # `scancel --signal` on from torchrun's agent): both of gpu-node-02's ranks, once each.
    assert len(set(re.findall(r"SIGUSR1 to rank pid (\d+)", watch_log))) == 2, watch_log
    assert "job restarted after a requeue (restart 1)" in text, text

    # Nothing trained after the checkpoint in the first attempt: at most the step in progress is redone.
    restart_at = next(i for i, line in enumerate(out.lines) if "job restarted after a requeue" in line)
    first_attempt = [int(m[1]) for line in out.lines[:restart_at]
                     if (m := re.search(r"^\s+step (\d+)/\d+  loss", line))]
    assert max(first_attempt) <= step, text
    assert re.search(rf"resumed from checkpoint step {step} \(\S*checkpoint-{step}\)", text), text

    run = runs / job_id
    metrics = json.loads((run / "metrics.json").read_text())
    state = json.loads((run / "trainer_state.json").read_text())
    assert metrics["train_steps"] == state["global_step"] == expected_steps, (metrics, state["global_step"])
    assert metrics["resumed_from_step"] == step
    log = (run / "job.log").read_text()
    assert log.count("SLURM_GPU_JOB") == 2
    assert "checkpointed after a spot interruption notice" in log
