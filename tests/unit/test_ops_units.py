"""Parsers of ops/: sinfo/scontrol output, cloud-init status, job log progress, summary and loss curve."""

import json
from pathlib import Path

import pytest

from ops.actions import cloudinit, slurm
from ops.finetune import joblog, summary
from ops.ssh.remote import HostError, WholeInput, each

REPO = Path(__file__).resolve().parents[2]


def test_sinfo_states_and_health_drain():
    nodes = slurm.parse_sinfo(
        "gpu-node-01|idle|none\n"
        "gpu-node-02|down*|Not responding\n"
        "gpu-node-03|drained|gpu-health: /dev/nvidia1 missing\n"
        "gpu-node-04|drained|Kill task failed\n"
        "gpu-node-01|idle|none\n"
    )
    assert list(nodes) == ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]
    assert nodes["gpu-node-01"].idle and not nodes["gpu-node-01"].needs_resume
    assert nodes["gpu-node-02"].needs_resume
    assert nodes["gpu-node-03"].health_drained and not nodes["gpu-node-03"].needs_resume
    assert nodes["gpu-node-04"].needs_resume and not nodes["gpu-node-04"].health_drained


def test_scontrol_job_fields():
    line = ("JobId=42 JobName=slurm-gpu-finetune UserId=root(0) JobState=COMPLETED Reason=None "
            "Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:0 RunTime=00:01:05 "
            "NodeList=gpu-node-[01-02] StdOut=/scratch/logs/slurm-gpu-finetune-42.out")
    job = slurm.job_from_fields(slurm.parse_scontrol_job(line))
    assert (job.id, job.state, job.restarts, job.run_time) == ("42", "COMPLETED", 1, "00:01:05")
    assert job.ok and job.finished and job.nodes == "gpu-node-[01-02]"
    pending = slurm.job_from_fields(slurm.parse_scontrol_job("JobId=43 JobState=REQUEUED Reason=NodeDown"))
    assert not pending.finished and not pending.ok


@pytest.mark.parametrize("status,verdict", [
    ({"status": "running", "errors": []}, None),
    ({"status": "not run"}, None),
    ({"status": "done", "errors": []}, ""),
    ({"status": "error", "errors": ["('scripts_user', RuntimeError('1'))"]}, "scripts_user"),
    ({"status": "done", "errors": ["boom"]}, "boom"),
    ({"status": "disabled"}, "disabled"),
])
def test_cloud_init_status(status, verdict):
    got = cloudinit.interpret(json.dumps(status))
    if verdict in (None, ""):
        assert got == verdict
    else:
        assert verdict in got and "cloud-init-output.log" in got or "disabled" in got


def test_cloud_init_status_from_real_cli():
    # This machine's cloud-init never ran: the real CLI's JSON must read as "not yet".
    import shutil
    import subprocess
    if not shutil.which("cloud-init"):
        pytest.fail("cloud-init is not installed (scripts/setup.sh installs it)")
    out = subprocess.run(["cloud-init", "status", "--format", "json"], capture_output=True, text=True).stdout
    assert cloudinit.interpret(out) is None


def test_each_reports_every_failing_host():
    def fn(name, conn):
        if name != "a":
            raise RuntimeError(f"{name} broke")
        return 1

    with pytest.raises(HostError) as err:
        each("step x", {"a": object(), "b": object(), "c": object()}, fn)
    assert err.value.failures == {"b": "RuntimeError: b broke", "c": "RuntimeError: c broke"}
    assert "step x failed on b, c" in str(err.value)


LOG = (
    'SLURM_GPU_JOB {"job_id": "7", "restart": 0, "job_dir": "/scratch/slurm-gpu/jobs/20260101-120000-abc123", "nodes": "gpu-node-[01-02]"}\n'
    "0: gpu-node-01:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct\n"
    "0: Training:  40%|####      | 2/5 [00:01<00:02,  1.2it/s]\r"
    "0: SLURM_GPU_LOG {\"step\": 1, \"max_steps\": 5, \"loss\": 2.5, \"num_tokens\": 1000.0, \"mean_token_accuracy\": 0.2, \"epoch\": 0.2}\n"
    "0: {'loss': '2.5', 'grad_norm': '1.1', 'learning_rate': '0.003', 'epoch': '0.2'}\n"
    "0: SLURM_GPU_LOG {\"step\": 2, \"max_steps\": 5, \"loss\": 2.0, \"num_tokens\": 3000.0, \"mean_token_accuracy\": 0.3, \"epoch\": 0.4}\n"
    "0: SLURM_GPU_LOG {\"step\": 2, \"max_steps\": 5, \"train_runtime\": 3.0}\n"
    'SLURM_GPU_JOB {"job_id": "7", "restart": 1, "job_dir": "/scratch/slurm-gpu/jobs/20260101-120000-abc123", "nodes": "gpu-node-[01-02]"}\n'
    '0: SLURM_GPU_RESUMED {"checkpoint": "/scratch/slurm-gpu/jobs/20260101-120000-abc123/output/checkpoint-2", "step": 2}\n'
    '0: SLURM_GPU_METRICS {"train_runtime": 3.0, "train_steps": 5, "mean_token_accuracy": 0.5, "tokens_per_s": 900.0}\n'
)


def test_job_log_events_in_pieces():
    log = joblog.JobLog()
    events = []
    # fed in awkward chunks (a line split across reads) with a growing clock
    for i in range(0, len(LOG), 37):
        events += log.feed(LOG[i:i + 37], now=float(i))
    events += log.feed("\n", now=float(len(LOG)))
    kinds = [e.kind for e in events]
    assert kinds == ["start", "step", "step", "start", "resumed", "metrics"]
    assert [s["loss"] for s in log.steps] == [2.5, 2.0]  # the HF dict duplicate is ignored
    assert log.max_steps == 5 and log.restarts == 1 and log.resumed_from == 2
    assert log.job_dir == "/scratch/slurm-gpu/jobs/20260101-120000-abc123" and log.metrics["train_steps"] == 5
    assert len(log.nccl_lines) == 1
    line = log.progress(log.steps[1])
    assert line.startswith("step 2/5  loss 2.0000  acc 0.300") and "tok/s" in line
    assert "requeue (restart 1)" in log.describe(events[3])
    assert "resumed from checkpoint step 2" in log.describe(events[4])


def test_hf_dicts_alone_give_progress():
    log = joblog.JobLog()
    log.feed("0: {'loss': '1.9', 'grad_norm': '0.5', 'epoch': '0.5'}\n0: {'loss': 1.7, 'epoch': 1.0}\n", now=1.0)
    assert [s["loss"] for s in log.steps] == [1.9, 1.7] and [s["step"] for s in log.steps] == [1, 2]


def test_summary_and_loss_png(tmp_path):
    history = [{"loss": 2.5, "step": 1}, {"loss": 2.0, "step": 2}, {"loss": 1.5, "step": 3},
               {"train_runtime": 3.0, "step": 3}]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": history}))
    (tmp_path / "metrics.json").write_text(json.dumps({
        "train_runtime": 3.25, "train_steps": 3, "mean_token_accuracy": 0.61, "tokens_per_s": 1234.5,
        "train_loss": 2.0, "world_size": 4}))
    log = joblog.JobLog()
    log.feed(LOG, now=0.0)
    run = summary.build("7", "00:00:09", log, tmp_path)
    text = "\n".join(run.lines())
    assert "job 7: completed" in text and "3.2 s training, 00:00:09 in Slurm" in text
    assert "2.5000 first -> 1.5000 last" in text and "0.610" in text and "1,234" in text
    assert "steps         3 (world size 4)" in text and "requeued      1 time(s); resumed from step 2" in text
    assert "1 links inside a node (SHM 1)" in text
    png = summary.plot_loss(run.losses, tmp_path / "loss.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary.plot_loss([], tmp_path / "none.png", "t") is None


def test_run_dir_never_overwrites_another_jobs_run(tmp_path, monkeypatch):
    from ops.finetune import runs

    monkeypatch.setattr(runs, "RUNS", tmp_path)
    first = runs.run_dir("2", "/scratch/slurm-gpu/jobs/20261203-091312-aaaaaa")
    (first / "metrics.json").write_text("{}")
    assert first == tmp_path / "2"
    # The same job again (fab logs --job 2) comes home to the same place.
    assert runs.run_dir("2", "/scratch/slurm-gpu/jobs/20261203-091312-aaaaaa") == first
    # A new local cluster's job 2 is another run: it must not land on the first one.
    other = runs.run_dir("2", "/scratch/slurm-gpu/jobs/20261203-101500-bbbbbb")
    assert other != first and other.name == "2-20261203-101500-bbbbbb"
    assert (first / "metrics.json").exists()


@pytest.mark.parametrize("task", ["logs", "cancel", "status"])
def test_unreachable_controller_is_a_clear_error_not_a_traceback(task, tmp_path):
    import os
    import subprocess
    import sys

    from tests.support import inventories

    # An inventory whose controller is a loopback address with no sshd behind it.
    inv = inventories.make("local", cluster_name="gone", controller=("controller", "127.0.0.1"),
                           public_ip="127.0.0.1", gpu_nodes=(("gpu-node-01", "127.0.0.2"),), gpus_per_node=1,
                           gpu_type="sim", python="python3", service_cmd="true {action} {service}")
    (tmp_path / "inventory.json").write_text(inv.to_json())
    fab = Path(sys.executable).with_name("fab")
    res = subprocess.run([str(fab), task, "--target", "local"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "SLURM_GPU_LOCAL_STATE": str(tmp_path)},
                         stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "Traceback" not in out
    assert "controller" in out or "cannot reach" in out


def test_text_for_a_commands_stdin_is_handed_over_in_one_piece():
    """Invoke reads a plain in_stream one byte per 10 ms nap (a munge credential took 1.5 s to send);
    WholeInput gives it everything in one read, and the command still gets every byte."""
    from invoke import Context

    text = "credential-" + "x" * 400 + "\n"
    src, reads = WholeInput(text), []
    read = src.read
    src.read = lambda size=-1: reads.append(got := read(size)) or got
    res = Context().run("cat", in_stream=src, hide=True)
    assert res.stdout == text
    assert [r for r in reads if r] == [text]


def test_fine_tune_job_ids_from_log_names():
    """`fab logs` with no job Slurm still remembers: the newest fine-tune log on /scratch names it."""
    from ops.finetune import follow as finetune_jobs

    names = ["slurm-gpu-finetune-7.out", "slurm-gpu-finetune-12.out", "slurm-gpu-finetune-3.err",
             "slurm-gpu-sanity-40.out", "slurm-gpu-finetune-.out", "slurm-gpu-finetune-x1.out",
             "other-slurm-gpu-finetune-99.out", "slurm-gpu-finetune-5.out.bak"]
    assert finetune_jobs.job_ids_in_log_names(names) == [7, 12]
    assert finetune_jobs.job_ids_in_log_names([]) == []


def test_status_names_the_fix_of_each_node_out_of_service():
    from ops.actions import status_view

    nodes = slurm.parse_sinfo("gpu-node-01|down*|Not responding\n"
                              "gpu-node-02|drained|gpu-health: /dev/nvidia1 missing\n"
                              "gpu-node-03|drained|Kill task failed\n")
    fixes = {name: status_view.node_fix(n) for name, n in nodes.items()}
    assert "slurmd does not answer" in fixes["gpu-node-01"]
    assert "health check drained it" in fixes["gpu-node-02"]
    assert "scontrol update nodename=gpu-node-02 state=resume" in fixes["gpu-node-02"]
    assert fixes["gpu-node-03"].startswith("`fab train` resumes it")


def test_fab_tasks_share_the_cluster_flags_and_keep_their_menu():
    """fabfile.py's tasks: the menu of `fab --list`, each with a docstring, its own flags and the
    common --target/--stack/--identity, declared once (ops/actions/options.py) with one help text."""
    import fabfile
    from ops.actions.options import CLUSTER_FLAGS_HELP

    assert sorted(fabfile.ns.task_names) == ["cancel", "chat", "check", "down", "estimate", "local.down",
                                             "local.status", "local.up", "logs", "merge", "reconfigure", "runs", "spot-requests", "ssh", "status",
                                             "train", "update-nodes"]
    assert fabfile.ns["runs"].__doc__.strip()  # local files only: no cluster flags
    # EC2 only (it works after a destroy): its own flags, none of a cluster's
    assert fabfile.ns["spot-requests"].__doc__.strip()
    assert {a.name for a in fabfile.ns["spot-requests"].get_arguments()} == {"region", "stack"}
    own = {"train": {"config", "nodes", "gpus_per_node", "examples", "model", "data", "raw", "estimate", "skip_check",
                     "healthy_only", "max_cost", "down", "drop_unfinished"}, "check": set(), "down": {"drop_unfinished"},
           "estimate": {"config", "nodes", "gpus_per_node", "examples", "model", "data", "gpu_instance_type",
                        "region", "model_gb", "tokens_per_row", "scratch_mbps"},
           "status": set(), "logs": {"job", "progress"}, "cancel": {"job"}, "reconfigure": {"force"},
           "ssh": {"host", "command"}, "update-nodes": set(),
           "chat": {"run", "prompt", "prompts_file", "max_new_tokens"}, "merge": {"run", "download"}}
    for name, flags in own.items():
        t = fabfile.ns[name]
        assert t.__doc__ and t.__doc__.strip(), name
        args = {a.name: a for a in t.get_arguments()}
        assert set(args) == flags | set(CLUSTER_FLAGS_HELP), name
        assert all(args[f].help == CLUSTER_FLAGS_HELP[f] for f in CLUSTER_FLAGS_HELP), name
        assert all(args[f].help for f in flags), f"{name}: a flag without --help text"
    assert [a.name for a in fabfile.ns["ssh"].get_arguments() if a.positional] == ["host"]


@pytest.mark.parametrize("out,shown", [
    ("@1796564193\n1796564234\n", "up 41 s"),  # systemctl's --timestamp=unix, then `date +%s`
    ("@1796564193.5\n1796564372\n", "up 2 min"),
    ("@1796564193\n1796568000\n", "up 1 h 3 min"),
    ("@1796564193\n1796764193\n", "up 2 d 7 h"),
    ("\n1796564372\n", "up"),  # no systemd of its own (a local-cluster host): no time to show
    ("@1796564400\n1796564372\n", "up"),  # a start in the future is not shown
])
def test_status_shows_how_long_the_hosts_own_systemd_has_run(out, shown):
    from ops.actions import status_view

    assert status_view.uptime_text(out) == shown
    assert "uptime" not in status_view.UPTIME_CMD and "/proc/uptime" not in status_view.UPTIME_CMD


def test_cloud_init_times_counted_from_boot_are_left_out():
    # Debian 13's cloud-init 25.1: stage times are seconds since boot, last_update a 1970 date.
    d13 = {"status": "done", "errors": [], "last_update": "Thu, 01 Jan 1970 00:09:37 +0000",
           "init": {"errors": [], "start": 563.2, "finished": 566.9},
           "modules-init": {"errors": [], "start": None, "finished": None}}
    shown = cloudinit.without_uptime_times(d13)
    assert "1970" not in json.dumps(shown) and "563" not in json.dumps(shown)
    assert shown["status"] == "done" and shown["init"] == {"errors": []}
    # Debian 12's cloud-init 22.4: real unix times, kept as they are.
    d12 = {"status": "done", "errors": [], "last_update": "Sun, 06 Dec 2026 13:37:50 +0000",
           "init": {"errors": [], "start": 1796564195.48, "finished": 1796564197.30}}
    assert cloudinit.without_uptime_times(d12) == d12
