"""The whole `fab train --target local` flow on the real local cluster (2 GPU hosts x 2 ranks).

The cluster starts with a different munge key on every GPU host (`fresh_keys`, as a fresh AWS
node): the first `fab train` must install the controller's key, run the sanity job and the
fine-tune, print the summary and bring adapters home; its timeline (runs/<job>/timeline.json) has
every phase in order adding up to the wall time, and its prediction holds. The second run is interrupted with Ctrl-C
while it streams (the job must keep running) and finished with `fab logs --job JOB`; its key step
must skip every node. Then everything both runs left (fab's output, runs/, the job directories,
every host's logs, the repository) is searched for the munge key's bytes.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.local_cluster import fresh_cluster
from tests.unit.test_security_invariants import _found, _key_forms, _repo_files

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GAP_SLACK_S = 1.0
# The estimate (ops/cost/estimate.py) holds against the measured wall time within this factor (docs/ESTIMATE.md).
ESTIMATE_FACTOR = 2.0
STARTUP_SLACK_S = 15.0
# fab-side phases, then the job's own (from the log's stamps and metrics.json), then the download.
EXPECTED = ["setup", "estimate", "setup", "wake", "inputs", "prefetch", "keys", "reconfigure", "service", "sanity", "network",
            "staging",
            "queue",
            "startup", "data", "model", "build", "first_step", "steps", "save", "exit", "seen", "download"]

FAB_OUTPUT: list[str] = []  # every fab output of this module, searched for the munge key at the end


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def local_cluster():
    # A fresh cluster whose GPU hosts have their own keys, as new EC2 nodes do.
    with fresh_cluster(nodes=2, gpus=2, fresh_keys=True) as (inv, job_dirs):
        yield inv, job_dirs


def fab(runs_dir, *args, timeout=300):
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs_dir)}
    res = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    FAB_OUTPUT.append(res.stdout + res.stderr)
    return res.returncode, res.stdout + res.stderr


def submitted(out: str) -> tuple[str, str]:
    m = re.search(r"submitted job (\d+): .* in (\S+);", out)
    assert m, out
    return m[1], m[2]


@pytest.fixture(scope="module")
def first_run(local_cluster, runs_dir):
    """The first `fab train --target local` on the fresh cluster: (exit code, output, job id, fab's wall time)."""
    inv, job_dirs = local_cluster
    t0 = time.time()
    rc, out = fab(runs_dir, "train", "--target", "local")
    wall = time.time() - t0
    job_id, job_dir = submitted(out)
    job_dirs.append(job_dir)
    return rc, out, job_id, wall


def test_train_end_to_end(first_run, runs_dir):
    rc, out, job_id, _ = first_run
    assert rc == 0, out

    # each step reported; the key was installed on both fresh nodes
    assert "[1/7] cloud-init: skipped" in out
    assert re.search(r"\[2/7\] munge key: gpu-node-01 \(repaired.*gpu-node-02 \(repaired", out), out
    assert "[3/7] slurm: restarted slurmd on gpu-node-01, gpu-node-02; all 2 nodes idle" in out
    assert re.search(r"\[4/7\] sanity job \d+: gpu-node-01 2 GPUs .*gpu-node-02 2 GPUs", out), out
    assert re.search(r"step \d+/\d+  loss \d", out), out  # streamed progress

    # the summary
    assert f"job {job_id}: completed" in out
    for label in ("runtime", "steps", "loss", "token acc", "tokens/s"):
        assert re.search(rf"^\s+{label}\s+\S", out, re.M), label
    assert "NCCL          no NCCL lines in the log" in out

    run = runs_dir / job_id
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json",
                 "metrics.json", "loss.png", "job.log"):
        assert (run / name).is_file(), name
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"

    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 4  # 2 hosts x 2 ranks
    losses = [h["loss"] for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(losses) >= 5 and losses[-1] < losses[0], losses

    # the adapters load onto the base model with peft and change what it predicts
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = "/var/lib/slurm-gpu-local/scratch/tiny/model"  # /scratch/tiny/model inside the hosts
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    ids = tok("### Instruction:\nWhat is the capital of Peru?\n\n### Response:\n", return_tensors="pt")
    with torch.no_grad():
        before = base(**ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, str(run)).eval()
        after = tuned(**ids).logits
    assert (after - before).abs().max().item() > 1e-3

    # held-out evaluation, sample answers, TensorBoard, GPU telemetry, `fab runs`
    evaluation = metrics["eval"]
    assert evaluation["rows"] == 20 and evaluation["tuned"]["loss"] < evaluation["base"]["loss"], evaluation
    assert re.search(r"eval loss\s+\d+\.\d+ base -> \d+\.\d+ tuned", out), out
    assert "GPUs          no GPU metrics (stand-in GPUs)" in out and not (run / "gpus.png").exists()
    assert not (run / "tensorboard" / "gpus").exists()  # no samples, no GPU events: no made-up numbers
    samples_md = (run / "samples.md").read_text()
    assert samples_md.count("**Base**") == samples_md.count("**Tuned**") == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (run / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "eval/loss", "eval/base_loss", "throughput/tokens_per_s",
            "phases/steps_s"} <= tags, sorted(tags)
    rc, listed = fab(runs_dir, "runs")
    assert rc == 0 and listed.splitlines()[1].split()[0] == job_id, listed
    assert "2 x 2" in listed and "->" in listed, listed


def test_timeline_has_every_phase_in_order_adding_up_to_the_wall_time(first_run, runs_dir):
    """The first run's timeline (runs/<job>/timeline.json): every phase, in order, contiguous, together the
    run's wall time: what no phase covers (gaps) stays under GAP_SLACK_S, and the timeline misses at most
    STARTUP_SLACK_S of fab's own wall time (the interpreter and fab's imports run before the task can take
    its first timestamp)."""
    rc, out, job_id, process_wall = first_run
    assert rc == 0, out
    run_dir = runs_dir / job_id
    tl = json.loads((run_dir / "timeline.json").read_text())
    phases = tl["phases"]
    keys = [p["key"] for p in phases if p["key"] != "gap"]
    assert keys == EXPECTED, keys
    for a, b in zip(phases, phases[1:], strict=False):
        assert a["end"] <= b["start"] + 1e-6, (a, b)  # in order, no overlap
        assert a["seconds"] >= 0
    total = sum(p["seconds"] for p in phases)
    assert abs(total - tl["wall_s"]) < 0.01, (total, tl["wall_s"])
    gaps = sum(p["seconds"] for p in phases if p["key"] == "gap")
    assert gaps < GAP_SLACK_S, [p for p in phases if p["key"] == "gap"]
    assert 0 <= process_wall - tl["wall_s"] < STARTUP_SLACK_S, (process_wall, tl["wall_s"])
    by = {p["key"]: p for p in phases}
    assert by["startup"]["source"] == "job log" or by["queue"]["source"] == "job log"
    assert by["steps"]["source"] == "metrics.json" and by["steps"]["seconds"] > 0
    # the summary printed the same table
    assert re.search(r"^timeline$", out, re.M) and re.search(r"^\s+wall time\s+[\d.]+s", out, re.M), out
    for p in phases:
        if p["key"] != "gap":
            assert p["label"][:38] in out, p["label"]


def test_estimate_beside_the_timeline_holds_within_the_stated_factor(first_run, runs_dir):
    """The run's prediction, printed beside the timeline, is within ESTIMATE_FACTOR of the measured wall time."""
    rc, out, job_id, _ = first_run
    assert rc == 0, out
    run_dir = runs_dir / job_id
    tl = json.loads((run_dir / "timeline.json").read_text())
    predicted = tl["predicted_s"]
    measured = {}
    for p in tl["phases"]:
        measured[p["key"]] = measured.get(p["key"], 0.0) + p["seconds"]
    assert set(predicted) <= set(measured), set(predicted) - set(measured)
    total = sum(predicted.values())
    assert tl["wall_s"] / ESTIMATE_FACTOR <= total <= tl["wall_s"] * ESTIMATE_FACTOR, (total, tl["wall_s"])
    assert re.search(r"phase\s+took\s+share\s+predicted", out), out
    # the same prediction as `fab estimate` prints for this cluster, before anything runs
    res = subprocess.run([FAB, "estimate", "--target", "local"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    m = re.search(r"^\s+total\s+([\d.]+)s", res.stdout, re.M)
    assert m and abs(float(m[1]) - total) < 0.1, (m and m[1], total)


def test_second_run_skips_key_and_survives_ctrl_c(local_cluster, runs_dir):
    inv, job_dirs = local_cluster
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs_dir)}
    proc = subprocess.Popen([FAB, "train", "--target", "local", "--skip-check", "--examples", "96"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # read until the job is submitted, then press Ctrl-C
        out += line
        if "submitted job" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out += rest
    FAB_OUTPUT.append(out)
    assert proc.returncode != 0
    job_id, job_dir = submitted(out)
    job_dirs.append(job_dir)
    assert "[2/7] munge key: skipped every node (gpu-node-01, gpu-node-02 already match" in out, out
    assert f"Reattach with `fab logs --target local --job {job_id}`" in out, out

    # the job kept running: reattach and let it finish
    rc, logs_out = fab(runs_dir, "logs", "--target", "local", "--job", job_id)
    assert rc == 0, logs_out
    assert f"job {job_id}: completed" in logs_out
    assert (runs_dir / job_id / "adapter_model.safetensors").is_file()


def test_munge_key_absent_after_real_runs(local_cluster, runs_dir):
    """Search everything the two runs above left for the cluster key's bytes: fab's output,
    runs/<job>/, the job directories on /scratch, the Slurm and munge logs of every host, and
    the repository (the first run installed the key on fresh nodes, so it did travel)."""
    from localcluster import topology as layout

    inv, job_dirs = local_cluster
    assert len(FAB_OUTPUT) >= 3 and len(job_dirs) == 2, (len(FAB_OUTPUT), job_dirs)  # both runs happened
    assert re.search(r"munge key: gpu-node-01 \(repaired", "\n".join(FAB_OUTPUT))

    keys = sorted(layout.HOSTS_DIR.glob("*/**/munge.key"))
    assert {k.relative_to(layout.HOSTS_DIR).parts[0] for k in keys} >= {
        "controller", "gpu-node-01", "gpu-node-02"}, keys
    key = next(k for k in keys if k.relative_to(layout.HOSTS_DIR).parts[0] == "controller").read_bytes()
    assert all(k.read_bytes() == key for k in keys)  # one cluster key everywhere
    forms = _key_forms(key)

    searched = {f"fab output {i}": out.encode() for i, out in enumerate(FAB_OUTPUT)}
    job_files = [p for d in job_dirs for p in (layout.SCRATCH / Path(d).relative_to("/scratch")).rglob("*")]
    logs = [p for p in layout.HOSTS_DIR.rglob("*")
            if p.is_file() and p.name != "munge.key" and ("log" in p.name or "log" in p.parent.name)]
    for p in [*runs_dir.rglob("*"), *job_files, *logs, *_repo_files()]:
        if p.is_file() and p.stat().st_size < 64 << 20:
            searched[str(p)] = p.read_bytes()
    assert any("job" in n or n.endswith(".log") for n in searched), sorted(searched)[:20]
    assert len([n for n in searched if n.startswith(str(runs_dir))]) >= 6  # both runs' files
    assert _found(forms, b"noise" + key + b"noise") == {key[:24]}  # the probe finds a planted copy
    leaks = [n for n, data in searched.items() if _found(forms, data)]
    assert leaks == [], f"the munge key is in {leaks}"
