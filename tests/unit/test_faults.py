"""Faults and bad input that need no cluster: the training config's contents, a requeued
job whose training had completed, the job log's own error lines, the first progress line, data
files that are not UTF-8. The cluster side is in tests/cluster/test_faults_cluster.py; the table of every
case and its test is docs/FAULTS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from ops.actions import options, slurm
from ops.finetune import inputs, job_end, stream
from ops.finetune import sbatch as jobs
from ops.finetune.joblog import JobLog
from tests.unit.test_bad_input import FAB, _host_state, _made
from tests.unit.test_jobs_render import inventory
from training import train
from training.data import DataError, load_local_rows

REPO = Path(__file__).resolve().parents[2]
LOCAL_TINY = yaml.safe_load((REPO / "training" / "configs" / "local-tiny.yaml").read_text())

# ------------------------------------------------------------------ the training config's contents

# (changes to local-tiny.yaml, expected substrings: the key and the fix)
CONFIGS = [
    ({"learning_rat": 1e-3}, ["unknown setting 'learning_rat'", "did you mean 'learning_rate'?",
                              "remove it or fix its name"]),
    ({"per_device_train_batch_size": "four"},
     ["per_device_train_batch_size: 'four' is the wrong type", "set per_device_train_batch_size to a whole number"]),
    ({"learning_rate": [1e-3]}, ["learning_rate: [0.001] is the wrong type", "set learning_rate to a number"]),
    ({"bf16": "maybe"}, ["bf16: 'maybe' is the wrong type", "set bf16 to true or false"]),
    ({"save_strategy": "sometimes"}, ["save_strategy: 'sometimes'", "one of: no, steps, epoch"]),
    ({"dtype": "int8"}, ["dtype: 'int8' is not allowed", "one of: auto, bfloat16, float16, float32"]),
    ({"learning_rate": 0}, ["learning_rate: 0 is out of range", "greater than 0"]),
    ({"lora_dropout": 1.5}, ["lora_dropout: 1.5 is out of range", "from 0 up to (not including) 1"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps: 0 is out of range", "at least 1"]),
    ({"n_examples": -5}, ["n_examples: -5 is out of range", "0 (all rows) or more"]),
    ({"save_total_limit": 0}, ["save_total_limit: 0 is out of range", "at least 1"]),
    ({"hang_timeout_factor": 1}, ["hang_timeout_factor: 1 is out of range", "0 (no hang watchdog) or at least 2"]),
    ({"hang_timeout_floor_s": 0}, ["hang_timeout_floor_s: 0 is out of range", "at least 5 seconds"]),
    ({"model_name_or_path": "Qwen/Qwen3-4B"},
     ["model_name_or_path in --config", "'Qwen/Qwen3-4B'", "runs offline",
      "pass --config training/configs/local-tiny.yaml"]),
    ({"dataset_name": "data.jsonl"}, ["dataset_name in --config", "'data.jsonl'", "absolute path"]),
]


def _write_config(tmp_path: Path, changes: dict) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**LOCAL_TINY, **changes}))
    return path


def _all_in(message: str, expected: list[str]) -> None:
    for text in expected:
        assert text in message, f"{text!r} not in: {message}"


@pytest.mark.parametrize("changes,expected", CONFIGS, ids=[next(iter(c)) + "=" + str(next(iter(c.values())))
                                                           for c, _ in CONFIGS])
def test_bad_training_config_is_refused_naming_the_key(tmp_path, changes, expected):
    path = _write_config(tmp_path, changes)
    with pytest.raises(options.OptionError) as info:
        options.parse(target="local", config=str(path))
    _all_in(str(info.value), [f"{path.name}"] + expected)


def test_every_problem_of_a_config_is_named_at_once(tmp_path):
    path = _write_config(tmp_path, {"lora_r": 0, "seed_": 1})
    with pytest.raises(options.OptionError) as info:
        options.parse(target="local", config=str(path))
    _all_in(str(info.value), ["lora_r: 0 is out of range", "unknown setting 'seed_'", "did you mean 'seed'?"])


@pytest.mark.parametrize("name", ["local-tiny.yaml", "qwen3-4b-lora.yaml"])
def test_the_shipped_configs_pass(name):
    target = "local" if name.startswith("local") else "aws"
    opts = options.parse(target=target, config=str(REPO / "training" / "configs" / name))
    assert opts.model_path and opts.data_path


def test_the_job_reads_the_configs_paths_and_flags_win(tmp_path):
    """No silent substitution: what the job will read is the config's path, or the flag's."""
    path = _write_config(tmp_path, {"model_name_or_path": "/scratch/mine/model",
                                    "dataset_name": "/scratch/mine/data.jsonl"})
    opts = options.parse(target="local", config=str(path))
    assert (opts.model_path, opts.data_path) == ("/scratch/mine/model", "/scratch/mine/data.jsonl")
    assert inputs.where(opts, "model") == f"model_name_or_path /scratch/mine/model (from --config {path.name})"
    opts = options.parse(target="local", config=str(path), data="/scratch/other.jsonl")
    assert opts.data_path == "/scratch/other.jsonl" and inputs.where(opts, "data") == "--data /scratch/other.jsonl"


def test_fab_train_with_a_bad_config_touches_nothing(tmp_path):
    """As a user runs it: exit 1, the key named, no traceback, nothing made on this machine."""
    from tests.support.local_cluster import cluster_lock

    path = _write_config(tmp_path, {"lora_alpah": 32})
    with cluster_lock():
        before = _host_state()
        res = subprocess.run([FAB, "train", "--target", "local", "--config", str(path)], cwd=REPO,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "SLURM_GPU_RUNS": "/nonexistent-runs"})
        made = _made(before, _host_state())
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    _all_in(out, [f"fab train: --config {path}: unknown setting 'lora_alpah'", "did you mean 'lora_alpha'?"])
    assert "Traceback" not in out and made == {}, out


# ------------------------------------------------------------------ a completed run is never retrained


def _finetune_script(tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "output"
    spec = jobs.base_spec(inventory(target="local", gpu_type="cpu", gpus=2), jobs.FINETUNE_NAME, 2, 2,
                          str(tmp_path), config=str(tmp_path / "config.yaml"), output_dir=str(out))
    script = tmp_path / "finetune.sbatch"
    script.write_text(jobs.render_finetune(spec))
    # The job's folder holds the code, as fab stages it: the script runs `python -m training.requeue` there.
    (tmp_path / "training").symlink_to(REPO / "training")
    out.mkdir()
    return script, out


def _run_batch_script(script: Path, restart: int) -> subprocess.CompletedProcess:
    """The rendered batch script under bash, as Slurm starts a requeued attempt, with no Slurm
    commands on PATH: reaching srun/scontrol fails the script (command not found)."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restart),
           "SLURM_JOB_NODELIST": "gpu-node-[01-02]", "SLURM_JOB_NUM_NODES": "2"}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=env)


def test_requeued_job_with_completed_training_exits_0_without_training(tmp_path):
    script, out = _finetune_script(tmp_path)
    unfinished = _run_batch_script(script, restart=1)
    assert unfinished.returncode != 0  # no marker: it goes on to scontrol/srun (absent here)

    metrics = {"train_steps": 25, "last_loss": 4.0}
    train.write_completed(str(out), {**metrics, "log_history": [{"loss": 6.0}]})
    res = _run_batch_script(script, restart=4)  # even past the restart limit: the run is done
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"training already completed ({out}/COMPLETED); not training again" in res.stdout
    line = next(x for x in res.stdout.splitlines() if x.startswith("SLURM_GPU_METRICS "))
    assert json.loads(line.split(" ", 1)[1]) == metrics
    # fab reads that line as the run's final metrics
    log = JobLog()
    log.feed(res.stdout)
    assert log.metrics == metrics


def test_the_marker_name_is_the_one_fab_and_the_job_check():
    # The job checks it in training/requeue.py (the test above runs that check for real).
    assert job_end.COMPLETED_MARKER == train.COMPLETED_MARKER


# ------------------------------------------------------------------ what a failed job says

FAILED_LOG = """SLURM_GPU_JOB {"job_id": "9", "restart": 0, "job_dir": "/scratch/j", "nodes": "gpu-node-[01-02]"}
0: [rank0]: Traceback (most recent call last):
0: [rank0]:   File "/scratch/j/training/train.py", line 210, in main
0: [rank0]:     trainer = build_trainer(model, tokenizer, dataset)
0: [rank0]: ValueError: Target modules {'nope_proj'} not found in the base model. Please check the target modules.
1: [rank1]: ValueError: Target modules {'nope_proj'} not found in the base model. Please check the target modules.
0: W1204 torch/distributed/elastic/multiprocessing/api.py: Sending process 12 closing signal SIGTERM
0: torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
srun: error: gpu-node-01: task 0: Exited with exit code 1
slurm-gpu: training step failed (exit 1)
slurm-gpu: batch script failed at line 88
"""


def test_a_failed_job_shows_the_logs_own_error_lines():
    log = JobLog()
    log.feed(FAILED_LOG)
    job = slurm.Job("9", jobs.FINETUNE_NAME, "FAILED", "1:0", "00:00:40", 0, "gpu-node-[01-02]",
                    "NonZeroExitCode", "")
    msg = str(job_end.failure("9", stream.Followed(job, log), "/scratch/logs/x-9.out"))
    assert msg.startswith("job 9 FAILED (exit 1:0, NonZeroExitCode); the job log's error lines:\n"), msg
    cause = msg.split("error lines:\n", 1)[1].split("\nlast lines of")[0].splitlines()
    assert cause[0] == ("  ValueError: Target modules {'nope_proj'} not found in the base model. "
                        "Please check the target modules."), cause  # once, though two ranks said it
    assert "  srun: error: gpu-node-01: task 0: Exited with exit code 1" in cause
    assert "  slurm-gpu: training step failed (exit 1)" in cause
    assert not any("Sending process" in c or "File " in c for c in cause), cause
    assert "last lines of /scratch/logs/x-9.out:" in msg


def test_a_failed_job_without_error_lines_says_so():
    log = JobLog()
    log.feed("SLURM_GPU_JOB {\"job_id\": \"3\", \"restart\": 0}\nsome output\n")
    job = slurm.Job("3", jobs.FINETUNE_NAME, "CANCELLED", "0:15", "", 0, "", "None", "")
    msg = str(job_end.failure("3", stream.Followed(job, log), "/l"))
    assert "the job log has no error line (see its last lines)" in msg and "  some output" in msg


# ------------------------------------------------------------------ progress lines


def test_the_first_progress_line_is_printed_once():
    """HF's own dict for a step comes before our tagged line for the same step."""
    log = JobLog()
    text = ('SLURM_GPU_JOB {"job_id": "5", "restart": 0, "job_dir": "/scratch/j", "nodes": "n[1-2]"}\n'
            "0: {'loss': '6.3312', 'grad_norm': '1.2', 'learning_rate': '0.005', 'epoch': '0.04'}\n"
            '0: SLURM_GPU_LOG {"step": 1, "max_steps": 25, "loss": 6.3312, "epoch": 0.04}\n'
            "0: {'loss': '5.9', 'grad_norm': '1.1', 'learning_rate': '0.005', 'epoch': '0.08'}\n"
            '0: SLURM_GPU_LOG {"step": 2, "max_steps": 25, "loss": 5.9, "epoch": 0.08}\n')
    said = [line for ev in log.feed(text) if (line := log.describe(ev))]
    assert [s.split("  ")[0] for s in said] == ["job started on n[1-2]", "step 1/25", "step 2/25"], said
    assert [s["step"] for s in log.steps] == [1, 2]


# ------------------------------------------------------------------ data files


def test_data_file_that_is_not_utf8_names_the_line_and_the_fix(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "c"}\n')
    with pytest.raises(DataError) as info:
        load_local_rows(path)
    _all_in(str(info.value), [f"{path}: not UTF-8 text (line 2, byte 56: b'\\xe9')", "save it as UTF-8",
                              "iconv -f latin1 -t utf-8 latin1.jsonl"])


def test_processes_started_by_the_tests_can_be_interrupted():
    """The Ctrl-C tests need SIGINT delivered: whatever the runner inherited (a background `cmd &` or nohup
    hands SIGINT ignored), conftest.py gives this process Python's handler and children the default."""
    import signal
    import sys

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                           capture_output=True, text=True, check=True)
    assert "default_int_handler" in child.stdout, child.stdout
