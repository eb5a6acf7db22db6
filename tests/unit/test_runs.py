"""The run summary's eval, sample and GPU lines, gpus.png, the GPU sampler in the job script, and `fab runs`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ops.finetune import runs, summary
from ops.finetune.joblog import JobLog

REPO = Path(__file__).resolve().parents[2]

EVAL = {"base": {"loss": 6.4, "token_accuracy": 0.0, "tokens": 100, "rows": 24},
        "tuned": {"loss": 3.5, "token_accuracy": 0.54, "tokens": 100, "rows": 24}, "rows": 24,
        "source": "24 rows held out of the training rows", "history": []}
SAMPLE = {"prompt": "### Instruction:\nWhat is the capital of Peru?\n\n### Response:\n", "reference": "Lima.",
          "base": "cat cat cat", "tuned": "The capital of Peru is Lima."}


def _run_dir(root: Path, job: str, last_loss: float, started: float, evaluated: bool = True) -> Path:
    d = root / job
    d.mkdir(parents=True)
    metrics = {"train_steps": 24, "last_loss": last_loss, "first_loss": 6.6, "tokens_per_s": 1234.5,
               "train_rows": 380, "world_size": 4, "log_history": [{"loss": 6.6, "step": 1}]}
    if evaluated:
        metrics |= {"eval": EVAL, "samples": [SAMPLE]}
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "timeline.json").write_text(json.dumps({"started": started, "wall_s": 321.0}))
    (d / "run.json").write_text(json.dumps({"target": "aws", "nodes": 2, "gpus_per_node": 4,
                                            "model": "Qwen/Qwen3-4B", "cost_usd": 1.234}))
    os.utime(d / "metrics.json", (started, started))
    return d


def test_summary_states_base_to_tuned_eval_and_the_first_sample(tmp_path):
    d = _run_dir(tmp_path, "5", 3.0, 1.7e9)
    lines = "\n".join(summary.build("5", "", JobLog(), d).lines())
    assert "eval loss     6.4000 base -> 3.5000 tuned (24 rows held out" in lines
    assert "eval acc      0.000 base -> 0.540 tuned" in lines
    assert "tuned       The capital of Peru is Lima." in lines and "reference   Lima." in lines


def test_gpu_line_means_each_nodes_samples_and_says_when_there_are_none(tmp_path):
    d = _run_dir(tmp_path, "6", 3.0, 1.7e9)
    run = summary.build("6", "", JobLog(), d)
    run.real_gpus = False
    assert run.gpu_line() == "no GPU metrics (stand-in GPUs)"
    assert summary.plot_gpus(run.gpus, d / "gpus.png", "t") is None and not (d / "gpus.png").exists()
    # nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits
    (d / "gpus-gpu-node-01.csv").write_text(
        "2026/05/01 10:00:00.000, 0, 90, 20480, 250.5\n2026/05/01 10:00:00.000, 1, 70, 10240, 200.0\n"
        "2026/05/01 10:00:05.000, 0, 100, 20480, 260.0\n2026/05/01 10:00:05.000, 1, [N/A], 10240, 200.0\n2026/05/0")
    (d / "gpus-gpu-node-02.csv").write_text("2026/05/01 10:00:00.000, 0, 40, 4096, 100.0\n")
    run = summary.build("6", "", JobLog(), d)
    assert sorted(run.gpus) == ["gpu-node-01", "gpu-node-02"] and len(run.gpus["gpu-node-01"]) == 3
    assert run.gpu_line() == ("gpu-node-01 87% busy, 20.0 GiB peak; gpu-node-02 40% busy, 4.0 GiB peak "
                              "(mean utilisation, nvidia-smi)")
    assert summary.plot_gpus(run.gpus, d / "gpus.png", "t").stat().st_size > 0


def test_job_script_samples_gpus_where_nvidia_smi_is(tmp_path):
    from ops.finetune import sbatch as jobs

    spec = jobs.JobSpec(real_gpus=True, nccl_efa=True, cluster_name="c", job_name="j", nodes=2, gpus_per_node=4,
                        gpu_type="g6.12xlarge", nvlink=False, python="/opt/venv/bin/python", scratch="/scratch",
                        log_dir="/scratch/logs", job_dir="/scratch/jobs/x", work_dir="/scratch/jobs/x/work", config="c.yaml",
                        output_dir="/scratch/jobs/x/output")
    script = jobs.render_finetune(spec)
    assert "export GPU_SAMPLES='/scratch/jobs/x/output'" in script
    assert ("if command -v nvidia-smi >/dev/null 2>&1; then mkdir -p \"$GPU_SAMPLES\"; TZ=UTC nvidia-smi "
            "--query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits "
            "-l 5 >>\"$GPU_SAMPLES/gpus-$(hostname).csv\"") in script
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["shellcheck", str(tmp_path / "job.sh")], check=True)


def test_fab_runs_lists_newest_first_and_shows_one(tmp_path):
    _run_dir(tmp_path, "3", 3.25, 1.7e9)
    _run_dir(tmp_path, "4", 2.5, 1.8e9, evaluated=False)
    (tmp_path / "9-not-a-run").mkdir()
    env = {**os.environ, "SLURM_GPU_RUNS": str(tmp_path)}
    fab = [sys.executable, "-m", "fabric"]
    out = subprocess.run([*fab, "runs"], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["job", "date", "model"]
    assert [ln.split()[0] for ln in lines[1:]] == ["4", "3"]  # newest first
    assert "Qwen/Qwen3-4B" in lines[2] and "380 +24 eval" in lines[2] and "2 x 4" in lines[2]
    assert "3.250" in lines[2] and "6.400 -> 3.500" in lines[2] and "1,234" in lines[2]
    assert "321 s" in lines[2] and "$1.23" in lines[2]
    shown = subprocess.run([*fab, "runs", "--job", "3"], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True).stdout
    assert "job 3: completed" in shown and "6.4000 base -> 3.5000 tuned" in shown
    bad = subprocess.run([*fab, "runs", "--job", "77"], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "no run '77'" in bad.stderr + bad.stdout and "runs there: 4, 3" in bad.stderr + bad.stdout


def test_fab_runs_with_no_runs(tmp_path):
    assert runs.table(tmp_path / "none") == [f"no runs under {tmp_path / 'none'} yet: `fab train` brings each "
                                             "run home there"]


def test_fab_runs_on_malformed_records_names_the_file_and_the_fix(tmp_path):
    """A run.json (or metrics/timeline) that is not the record `fab train` writes: one clear error, no traceback."""
    d = _run_dir(tmp_path, "5", 3.0, 1.7e9)
    env = {**os.environ, "SLURM_GPU_RUNS": str(tmp_path)}
    fab = [sys.executable, "-m", "fabric"]
    for name, text, says in [("run.json", "[1, 2]", "is not a JSON object (it holds a list)"),
                             ("run.json", '{"model": 12}', "model must be a str, not 12"),
                             ("run.json", '{"model": "m", ', "cannot be read as JSON"),
                             ("timeline.json", '{"started": "yesterday"}', "started must be a int or float"),
                             ("metrics.json", '{"eval": [1]}', "eval must be a dict")]:
        original = (d / name).read_text()
        (d / name).write_text(text)
        for argv in (["runs"], ["runs", "--job", "5"]):
            res = subprocess.run([*fab, *argv], cwd=REPO, env=env, capture_output=True, text=True)
            out = res.stdout + res.stderr
            assert res.returncode == 2 and "Traceback" not in out, out
            assert f"{d / name}" in out and says in out and "fix or delete that file" in out, out
        (d / name).write_text(original)


def test_fab_runs_job_reads_nothing_outside_runs(tmp_path):
    """`--job ../x` names a directory beside runs/: refused by name, whatever is there."""
    _run_dir(tmp_path / "runs", "3", 3.25, 1.7e9)
    _run_dir(tmp_path, "x", 1.0, 1.7e9)  # a run-like directory outside runs/
    env = {**os.environ, "SLURM_GPU_RUNS": str(tmp_path / "runs")}
    for job in ("../x", "/etc", "3/../../x", ".", "٣"):
        res = subprocess.run([sys.executable, "-m", "fabric", "runs", "--job", job], cwd=REPO, env=env,
                             capture_output=True, text=True)
        out = res.stdout + res.stderr
        assert res.returncode == 2 and f"--job {job!r} is not a run's name" in out and "Traceback" not in out, out
        assert "job x" not in out
