"""A real `fab train --target local` run's timeline (runs/<job>/timeline.json) on the local cluster.

Every phase is there, in order, contiguous, and together they are the run's wall time: what
no phase covers (gaps) stays under GAP_SLACK_S, and the timeline misses at most
STARTUP_SLACK_S of the fab process's own wall time (the interpreter and fab's imports run
before the task can take its first timestamp). The run's prediction, printed beside the
timeline, is within ESTIMATE_FACTOR of the measured wall time.
"""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.localcluster_fixture import fresh_cluster

REPO = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    with fresh_cluster(nodes=2, gpus=2) as (_inv, job_dirs):
        env = {**os.environ, "SLURM_GPU_RUNS": str(runs)}
        t0 = time.time()
        res = subprocess.run([FAB, "train", "--target", "local"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
        wall = time.time() - t0
        out = res.stdout + res.stderr
        m = re.search(r"submitted job (\d+): .* in (\S+);", out)
        assert m, out
        job_dirs.append(m[2])
        assert res.returncode == 0, out
        yield out, runs / m[1], wall


def test_timeline_has_every_phase_in_order_adding_up_to_the_wall_time(run):
    out, run_dir, process_wall = run
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


def test_estimate_beside_the_timeline_holds_within_the_stated_factor(run):
    out, run_dir, _ = run
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
