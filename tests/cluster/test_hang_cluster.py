"""A rank that blocks in the middle of a fine-tune, on the real local cluster (2 GPU hosts x 2 ranks).

While `fab train` streams, rank 3 blocks for ever when step 7 begins (the test-only SLURM_GPU_STALL, which reaches
the job through the controller's sshd: OpenSSH's SetEnv, so `fab train`'s sbatch passes it on); the other ranks
wait for it in a collective. The hang watchdog fires after its deadline, every rank's stack lands in the run's
hangs/, the job script prints which rank hung and where and requeues the job; the requeued job (which runs clean)
resumes from the last checkpoint and ends with an uninterrupted run's step count. `fab train` says which rank hung
and where, and brings the stacks home.
"""

import json
import math
import os
import re
import subprocess

import pytest
import yaml

from tests.cluster.test_node_loss import FAB, REPO, Streamed, holder, wait_for
from tests.support.local_cluster import fresh_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
STALL = "3:6:inf"  # rank 3, when step 7 begins, for ever (the first attempt only)


# No node is lost here (the job script requeues itself after the hang): the requeued job need not wait out the
# default cred_expire (localcluster.plan.CRED_EXPIRE_S, kept for a lost node's late terminate retry).
CRED_EXPIRE_S = 20


@pytest.fixture(scope="module")
def local_cluster():
    with fresh_cluster(nodes=2, gpus=2, fresh_keys=False, cred_expire=CRED_EXPIRE_S) as (inv, job_dirs):
        yield inv, job_dirs


def controller_sshd_env(env: str | None) -> None:
    """Set (or drop, None) a SetEnv line in the controller's sshd_config and restart its sshd: every
    later session there, `fab train`'s sbatch included, gets the variable."""
    from localcluster import daemons, state
    from localcluster import topology as layout

    path = layout.host_dir("controller") / "sshd_config"
    lines = [line for line in path.read_text().splitlines() if not line.startswith("SetEnv ")]
    path.write_text("\n".join(lines + ([f"SetEnv {env}"] if env else [])) + "\n")
    daemons.hostctl(holder("controller"), "controller", "restart", "sshd")
    ip = state.load().host("controller").ip
    daemons.poll("the controller's sshd", lambda: daemons.port_open(ip, 22), 20)


def test_a_blocked_rank_is_named_and_the_run_requeues_and_completes(local_cluster, tmp_path):
    inv, job_dirs = local_cluster
    ranks = len(inv.gpu_nodes) * inv.gpus_per_node
    examples, save_steps = 320, 2
    cfg = yaml.safe_load((REPO / "training" / "configs" / "local-tiny.yaml").read_text())
    # A 15 s floor: 4 CPU ranks on a shared 2-core machine must not look hung between two steps.
    cfg.update(save_steps=save_steps, save_total_limit=3, num_train_epochs=2, eval_split=0,
               hang_timeout_floor_s=15, hang_first_step_s=120)
    config = tmp_path / "hang.yaml"
    config.write_text(yaml.safe_dump(cfg))
    per_rank_batches = math.ceil(math.ceil(examples / ranks) / cfg["per_device_train_batch_size"])
    expected_steps = per_rank_batches // cfg["gradient_accumulation_steps"] * int(cfg["num_train_epochs"])
    assert expected_steps > 7

    runs = tmp_path / "runs"
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs), "PYTHONUNBUFFERED": "1"}
    controller_sshd_env(f"SLURM_GPU_STALL={STALL}")
    try:
        proc = subprocess.Popen([FAB, "train", "--target", "local", "--skip-check", "--config", str(config),
                                 "--examples", str(examples)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = Streamed(proc)
        try:
            said = wait_for("fab to say which rank hung", lambda: re.search(
                r"^\s*hang: no training progress for (\d+) s \(deadline (\d+) s\) after step (\d+); "
                r"rank 3 on (\S+) hung at (\S+) in (\S+);.*$", out.text, re.M) or proc.poll() is not None, 400, 0.2)
            assert proc.poll() is None, out.text
            rc = proc.wait(timeout=400)
            out.thread.join(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        controller_sshd_env(None)
    text = out.text
    m = re.search(r"submitted job (\d+): .* in (\S+);", text)
    assert m, text
    job_id = m[1]
    job_dirs.append(m[2])
    assert rc == 0, text
    print("\n" + said[0])
    idle, deadline, step = int(said[1]), int(said[2]), int(said[3])
    assert step == 6 and 15 <= deadline <= idle, said[0]  # measured steps: the floor, not the first step's 120 s
    assert said[4] in ("gpu-node-01", "gpu-node-02") and said[5].startswith("training/watchdog.py:") \
        and said[6] == "_stall", said[0]
    assert re.search(r"ranks 0, 1, 2 waiting for it \(torch/", said[0]), said[0]

    # The job requeued from its last checkpoint and completed like an uninterrupted run.
    assert "job restarted after a requeue (restart 1)" in text, text
    resumed = re.search(r"resumed from checkpoint step (\d+)", text)
    # checkpoint-6 (written in the background at step 6's end), or checkpoint-4 had that not completed.
    assert resumed and int(resumed[1]) in (4, 6), text
    run = runs / job_id
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train_steps"] == expected_steps and metrics["resumed_from_step"] == int(resumed[1]), metrics
    log = (run / "job.log").read_text()
    assert re.search(r"^SLURM_GPU_HANG \{", log, re.M), log[-3000:]
    assert "slurm-gpu: training hung (the watchdog ended it" in log and "requeueing (restart 1 of 3)" in log
    # Every rank's stack and flight recorder came home; rank 3's names the blocking frame.
    stacks = sorted(p.name for p in (run / "hangs").glob("stacks-attempt0-rank*.txt"))
    assert stacks == [f"stacks-attempt0-rank{r}.txt" for r in range(ranks)], stacks
    assert " in _stall" in (run / "hangs" / "stacks-attempt0-rank3.txt").read_text()
    assert len(list((run / "hangs").glob("flight-recorder-attempt0-rank*.json"))) == ranks
