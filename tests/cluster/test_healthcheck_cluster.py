"""The GPU health check on the real local cluster, and what `fab train` does about it.

One cluster (2 GPU hosts x 2 stand-in GPUs, keys already shared) for the whole module,
tests in order (the bad-input and Ctrl-C runs first, while the health check's first
interval runs out):
- `fab train` with a bad --data file fails before anything is written to /scratch;
- Ctrl-C while `fab train` streams leaves the job running and prints the reattach hint;
- a stand-in GPU file removed on gpu-node-01 (over ssh, inside that host, as an operator
  would) drains the node at slurmd's next periodic HealthCheckProgram run, reason in `sinfo -R`;
- with the file back and another check run (slurmd runs it at start-up, before it registers,
  slurm.conf(5)), the node STAYS drained (ReturnToService=1);
- `fab train` refuses to resume it and says why; `scontrol ... state=resume` brings it back.

The AWS side of the check (nvidia-smi failing or seeing fewer GPUs) runs against the same
rendered script in tests/unit/test_bootstrap_scripts.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from localcluster import topology as layout
from ops.ssh import remote
from tests.support.local_cluster import fresh_cluster, run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
NODE = "gpu-node-01"
OTHER = "gpu-node-02"
DEVICE = f"{layout.GPU_DEVICE_PREFIX}1"  # inside every GPU host
REASON = f"slurm-gpu-healthcheck: missing {DEVICE}"


@pytest.fixture(scope="module")
def lc():
    """(inventory, ops.ssh.remote.Cluster) of a running cluster; torn down afterwards whatever happens."""
    with fresh_cluster(nodes=2, gpus=2) as (inv, _):
        cl = remote.connect(inv)
        try:
            yield inv, cl
        finally:
            cl.close()


def node_table(ctl) -> dict[str, tuple[str, str]]:
    """{node: (state, reason)} from `sinfo -N` ("" when there is no reason)."""
    out = run(ctl, "sinfo -h -N -o '%N|%T|%E'").stdout
    rows = (line.split("|", 2) for line in out.splitlines() if line.strip())
    return {n: (state, "" if reason == "none" else reason) for n, state, reason in rows}


def drain_reasons(ctl) -> dict[str, str]:
    """{node: reason} from `sinfo -R`, what an admin reads."""
    out = run(ctl, "sinfo -R -h -N -o '%N|%E'").stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line.strip())


def slurmd_start(ctl, node: str) -> str:
    m = re.search(r"SlurmdStartTime=(\S+)", run(ctl, f"scontrol show node {node}").stdout)
    return m[1] if m else ""


def restart_slurmd(inv, cl, node: str) -> None:
    """Restart slurmd as `fab` does (service_cmd over ssh) and wait until it has registered
    again: slurmd runs the health check before registering, so after this the check has run."""
    before = slurmd_start(cl.controller, node)
    remote.service(cl.nodes[node], inv, "restart", "slurmd", hide=True, in_stream=False)
    assert wait_for(lambda: slurmd_start(cl.controller, node) not in ("", before), 30), \
        f"slurmd on {node} did not register again"


def fab(*args, timeout=120, env=None):
    res = subprocess.run([FAB, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    return res.returncode, res.stdout + res.stderr


def job_dirs() -> set[str]:
    d = layout.SCRATCH / "slurm-gpu" / "jobs"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def squeue_ids(ctl) -> set[str]:
    return set(run(ctl, "squeue -h -o %i").stdout.split())


# ------------------------------------------------------------------ start


def test_all_nodes_idle_at_start(lc):
    inv, cl = lc
    table = node_table(cl.controller)
    assert {n: s for n, (s, _r) in table.items()} == {NODE: "idle", OTHER: "idle"}, table


# ------------------------------------------------------------------ fab train: bad data, Ctrl-C


@pytest.mark.parametrize("name,text,expected", [
    ("no-output.jsonl", '{"instruction": "a", "input": ""}\n',
     "--data /scratch/bad-input/no-output.jsonl: /scratch/bad-input/no-output.jsonl: missing column 'output' (row 1)"),
    ("broken.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": \n',
     "--data /scratch/bad-input/broken.jsonl: /scratch/bad-input/broken.jsonl: line 2 is not valid JSON"),
    ("missing.jsonl", None,
     "--data /scratch/bad-input/missing.jsonl: no such path on the cluster (checked on the controller); "
     "copy it under /scratch first or fix the path"),
], ids=["missing-column", "malformed-line", "no-such-file"])
def test_fab_train_with_bad_data_writes_nothing(lc, name, text, expected):
    inv, cl = lc
    data = layout.SCRATCH / "bad-input" / name
    data.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        data.write_text(text)
    dirs = job_dirs()
    try:
        rc, out = fab("train", "--target", "local", "--data", f"/scratch/bad-input/{name}")
    finally:
        shutil.rmtree(data.parent, ignore_errors=True)
    assert rc != 0, out
    assert expected in out, out
    assert "Traceback" not in out, out
    assert "[2/7]" not in out and "submitted job" not in out, out  # before keys, sanity job, upload
    assert job_dirs() == dirs  # no half-made job directory on /scratch
    assert not squeue_ids(cl.controller)


def test_ctrl_c_leaves_the_job_running_and_says_how_to_reattach(lc, tmp_path):
    inv, cl = lc
    before = job_dirs()
    proc = subprocess.Popen([FAB, "train", "--target", "local", "--skip-check"], cwd=REPO,
                            env={**os.environ, "SLURM_GPU_RUNS": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, job_id = "", None
    try:
        deadline = time.monotonic() + 150
        for line in proc.stdout:  # until the job's own output streams
            out += line
            if m := re.search(r"submitted job (\d+)", line):
                job_id = m[1]
            if job_id and "job started on" in line or time.monotonic() > deadline:
                break
        assert job_id and "job started on" in out, out
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        out += rest
        assert proc.returncode != 0, out
        assert f"Stopped following job {job_id}; it keeps running on the cluster." in out, out
        assert f"Reattach with `fab logs --target local --job {job_id}`" in out, out
        assert "Traceback" not in out, out
        assert job_id in squeue_ids(cl.controller)  # still queued or running in Slurm
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if job_id:
            run(cl.controller, f"scancel {job_id}", warn=True)
            wait_for(lambda: job_id not in squeue_ids(cl.controller), 30)
        for d in job_dirs() - before:  # this test's job directory on the shared /scratch
            shutil.rmtree(layout.SCRATCH / "slurm-gpu" / "jobs" / d, ignore_errors=True)


# ------------------------------------------------------------------ the health check


def test_missing_device_drains_the_node(lc):
    inv, cl = lc
    node = cl.nodes[NODE]
    run(node, f"rm {DEVICE}")
    # removed inside gpu-node-01 only: its neighbour still has its file
    assert not run(node, f"test -e {DEVICE}", warn=True).ok
    assert run(cl.nodes[OTHER], f"test -e {DEVICE}", warn=True).ok

    # slurmctld asks every slurmd to run HealthCheckProgram each HealthCheckInterval (15 s here,
    # counted from slurmctld's start, most of which the tests above used up). Restarting
    # slurmd or `scontrol reconfigure` is no shortcut: slurmd re-reads gres.conf, finds the
    # File= missing and exits (fatal), leaving the node down* without a reason.
    interval = int(re.search(r"HealthCheckInterval\s*=\s*(\d+)",
                             run(cl.controller, "scontrol show config").stdout)[1])
    reasons = wait_for(lambda: (r := drain_reasons(cl.controller)).get(NODE) and r, interval + 15, 1)
    assert reasons == {NODE: REASON}, reasons  # only the broken node, with the device named
    assert "drain" in node_table(cl.controller)[NODE][0]
    assert node_table(cl.controller)[OTHER][0] == "idle"
    assert run(node, f"{inv.service_cmd.format(action='status', service='slurmd')}", warn=True).ok


def test_health_drained_node_stays_drained_after_the_fix(lc):
    inv, cl = lc
    run(cl.nodes[NODE], f"touch {DEVICE}")
    restart_slurmd(inv, cl, NODE)  # the check runs again, now passing
    time.sleep(1)  # registration is done; leave slurmctld a moment to (wrongly) resume it
    state, reason = node_table(cl.controller)[NODE]
    assert state == "drained" and reason == REASON, (state, reason)
    assert drain_reasons(cl.controller) == {NODE: REASON}


def test_fab_train_does_not_resume_a_health_drained_node(lc):
    inv, cl = lc
    dirs = job_dirs()
    rc, out = fab("train", "--target", "local")
    assert rc != 0, out
    assert f"drained by the GPU health check: {NODE} ({REASON})" in out, out
    assert "scontrol update nodename=NODE state=resume" in out, out  # the fix
    assert "[4/7]" not in out and "submitted job" not in out, out  # stopped before any job
    assert node_table(cl.controller)[NODE] == ("drained", REASON)
    assert not squeue_ids(cl.controller) and job_dirs() == dirs


def test_explicit_resume_returns_the_node_to_service(lc):
    inv, cl = lc
    run(cl.controller, f"scontrol update nodename={NODE} state=resume")
    assert wait_for(lambda: node_table(cl.controller)[NODE] == ("idle", ""), 30), node_table(cl.controller)
    assert drain_reasons(cl.controller) == {}
