"""The batch script's requeue and restart policy (training/requeue.py), branch by branch, and its job-side
half run for real: `python -m training.requeue` with a stand-in `scontrol` on PATH that records its calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from training import protocol
from training.requeue import CONTINUE, Attempt, after_step, at_start

REPO = Path(__file__).resolve().parents[2]


def never_lost() -> list[str]:
    raise AssertionError("lost nodes asked for")


def test_completed_run_is_not_trained_again():
    d = at_start(Attempt(2, 0, 3), '{"train_loss": 1.0}')
    assert d.code == 0 and d.message == 'SLURM_GPU_METRICS {"train_loss": 1.0}' and not d.requeue


def test_start_gives_up_over_the_restart_limit_but_not_for_spot_requeues():
    assert at_start(Attempt(5, 4, 3), None).code == CONTINUE
    d = at_start(Attempt(5, 0, 3), None)
    assert d.code == 1 and "requeued 5 times, 5 after failures (limit 3); giving up" in d.message


def test_spot_interrupted_within_its_limit_requeues_and_notes_it():
    d = after_step(Attempt(1, 1, 3, 20), 0, False, '{"step": 3}', False, never_lost)
    assert d.requeue and d.code == 0 and d.spot_note.endswith(' {"step": 3}')
    assert "requeueing (restart 2, spot requeue 2)" in d.message and d.refused[1] == 1


def test_spot_interrupted_over_its_limit_gives_up():
    d = after_step(Attempt(20, 20, 3, 20), 0, False, "x", False, never_lost)
    assert not d.requeue and d.code == 1 and "20 spot requeues already (limit 20)" in d.message


def test_hang_requeues_within_the_restart_limit_then_gives_up():
    d = after_step(Attempt(1, 0, 3, 20), 143, False, None, True, never_lost, "/o")
    assert d.requeue and "training hung (the watchdog ended it: exit 143); requeueing (restart 2 of 3)" in d.message
    d = after_step(Attempt(3, 0, 3, 20), 143, False, None, True, never_lost, "/o")
    assert not d.requeue and d.code == 1 and "no restarts left (limit 3); every rank's stack is in /o/hangs" in d.message


def test_node_loss_restarts_within_max_restarts_then_fails_with_the_step_status():
    d = after_step(Attempt(0, 0, 3, 20), 1, False, None, False, lambda: ["gpu-node-02"])
    assert d.requeue and "lost node(s): gpu-node-02; requeueing (restart 1 of 3)" in d.message
    assert d.refused == ("slurm-gpu: training step failed (exit 1); lost node(s): gpu-node-02, no restarts left", 1)
    d = after_step(Attempt(4, 1, 3, 20), 9, False, None, False, lambda: ["gpu-node-02"])
    assert not d.requeue and d.code == 9 and "lost node(s): gpu-node-02, no restarts left" in d.message


def test_failure_with_every_node_answering_is_a_training_error():
    d = after_step(Attempt(0, 0, 3, 20), 2, False, None, False, lambda: [])
    assert not d.requeue and d.code == 2 and d.message == "slurm-gpu: training step failed (exit 2)"


def test_a_failed_step_after_completion_keeps_the_run_and_success_ends_cleanly():
    assert after_step(Attempt(0, 0, 3), 1, True, None, False, never_lost, "/o").code == 0
    assert after_step(Attempt(0, 0, 3), 0, False, None, False, never_lost) .code == 0


def _run(tmp_path: Path, *args: str, scontrol_rc: int = 0) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/bash\necho "$*" >>{tmp_path}/scontrol.calls\nexit {scontrol_rc}\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "gpu-node-01"}
    return subprocess.run([sys.executable, "-m", "training.requeue", *args], env=env, capture_output=True,
                          text=True, cwd=tmp_path)


def test_spot_requeue_runs_scontrol_and_records_it(tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    (out / protocol.INTERRUPTED).write_text('{"step": 3}\n')
    res = _run(tmp_path, "end", str(out), "0", "3", "20", "0")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 7\n"
    assert (out / protocol.SPOT_REQUEUES).read_text().count("\n") == 1 and not (out / protocol.INTERRUPTED).exists()


def test_a_refused_spot_requeue_fails_and_records_nothing(tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    (out / protocol.INTERRUPTED).write_text('{"step": 3}\n')
    res = _run(tmp_path, "end", str(out), "0", "3", "20", "0", scontrol_rc=1)
    assert res.returncode == 1 and "requeue after the spot interruption failed" in res.stderr
    assert not (out / protocol.SPOT_REQUEUES).exists()


def test_start_on_a_completed_run_prints_its_metrics(tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    (out / protocol.COMPLETED).write_text('{"train_loss": 1.0}\nmore\n')
    res = _run(tmp_path, "start", str(out), "1", "3")
    assert res.returncode == 0 and 'SLURM_GPU_METRICS {"train_loss": 1.0}\n' in res.stdout
