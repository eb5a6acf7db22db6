"""`fab down` and `fab train --down` (ops/actions/stack_down.py): refused while a job runs, while a finished run
is not home and verified, and on the local target; otherwise `pulumi destroy` of the stack, and what it removed.

The controller's side is the real shell script run by invoke on files laid out as a job leaves them
(jobs/finetune.sbatch.j2's SLURM_GPU_JOB line, output/COMPLETED, adapter files); `squeue` and `pulumi` are
stand-ins on PATH that answer as the real ones print and record their argv (the Pulumi CLI cannot run here).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from invoke import Context

from cluster.inventory import Inventory, Node
from ops.actions import options, stack_down
from ops.finetune import sbatch as jobs
from ops.ssh.remote import Cluster

REPO = Path(__file__).resolve().parent.parent
JOB_DIR_NAME = "20261207-031500-a1b2c3"
RESOURCES = [  # what `pulumi stack export` holds: Pulumi's own entries are not the cloud's
    {"type": "pulumi:pulumi:Stack", "urn": "urn:pulumi:dev::slurm-gpu::pulumi:pulumi:Stack::slurm-gpu-dev"},
    {"type": "pulumi:providers:aws", "urn": "urn:...:default", "id": "prov-1"},
    {"type": "slurm-gpu:infra:Cluster", "urn": "urn:...:mini"},
    {"type": "aws:ec2/instance:Instance", "urn": "urn:...:ctl", "id": "i-0ctl"},
    {"type": "aws:ec2/instance:Instance", "urn": "urn:...:g01", "id": "i-0g01"},
    {"type": "aws:ec2/natGateway:NatGateway", "urn": "urn:...:nat", "id": "nat-0abc"},
    {"type": "aws:ec2/vpc:Vpc", "urn": "urn:...:vpc", "id": "vpc-0abc"},
]

FAKE_PULUMI = """#!{python}
import json, os, sys
with open(os.environ["FAKE_PULUMI_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[:2] == ["stack", "--show-name"]:
    print("dev")
elif args[:2] == ["stack", "export"]:
    print(json.dumps({{"version": 3, "deployment": {{"resources": json.loads(os.environ["FAKE_PULUMI_RESOURCES"])}}}}))
elif args[:3] == ["stack", "output", "--json"]:
    print(open(os.environ["FAKE_PULUMI_OUTPUTS"]).read())
elif args[:1] == ["destroy"]:
    # What `pulumi destroy --skip-preview` prints as it goes (abridged).
    print("Destroying (dev):")
    for r in json.loads(os.environ["FAKE_PULUMI_RESOURCES"]):
        print(" -  " + r["type"] + " " + r["urn"].rsplit(":", 1)[-1] + " deleted")
    print("Resources:\\n    - 7 deleted\\n\\nDuration: 2m31s")
else:
    sys.exit("fake pulumi: unexpected " + " ".join(args))
"""


class LocalController(Context):
    """The controller's shell, run here by invoke (the same `run(cmd, hide=, warn=, in_stream=)` as Fabric)."""

    def close(self) -> None:
        pass


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """A fake `pulumi` and `squeue` first on PATH; returns (squeue's answer file, pulumi's argv log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pulumi").write_text(FAKE_PULUMI.format(python=sys.executable))
    squeue_out = tmp_path / "squeue.out"
    squeue_out.write_text("")
    # squeue -h -o '%i|%j|%T' prints one job a line in that format.
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {squeue_out}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "pulumi-argv.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_PULUMI_LOG", str(log))
    monkeypatch.setenv("FAKE_PULUMI_RESOURCES", json.dumps(RESOURCES))
    return squeue_out, log


def pulumi_calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def inventory(scratch: Path) -> Inventory:
    return Inventory(
        target="aws", cluster_name="mini", ssh_user="ubuntu",
        controller=Node("controller", "10.0.0.10", "controller", "198.51.100.7"),
        gpu_nodes=(Node("gpu-node-01", "10.0.1.11", "gpu"), Node("gpu-node-02", "10.0.1.12", "gpu")),
        gpus_per_node=4, gpu_type="l4", nvlink=False, efa=True, python="/opt/slurm-gpu/venv/bin/python",
        service_cmd="sudo systemctl {action} {service}", scratch=str(scratch),
        extra={"region": "ap-northeast-2", "idle_stop_s": 1800})


def finished_run(scratch: Path, job_id: str = "12", name: str = JOB_DIR_NAME, completed: bool = True) -> Path:
    """A run's directory on the cluster as the job leaves it: its log names the directory (first line)."""
    job_dir = scratch / "slurm-gpu" / "jobs" / name
    out = job_dir / "output"
    out.mkdir(parents=True)
    (out / "adapter_model.safetensors").write_bytes(b"\x00weights" * 1000)
    (out / "adapter_config.json").write_text('{"r": 16}\n')
    (out / "checkpoint-8").mkdir()
    if completed:
        (out / "COMPLETED").write_text("done\n")
    logs = scratch / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"{jobs.FINETUNE_NAME}-{job_id}.out").write_text(
        f'SLURM_GPU_JOB {{"job_id": "{job_id}", "restart": 0, "job_dir": "{job_dir}", "nodes": "gpu-node-[01-02]"}}\n'
        "step 1 loss 2.0\n")
    return job_dir


def bring_home(runs: Path, job_dir: Path, job_id: str = "12") -> Path:
    """What pipeline.finish leaves in runs/<job>/: the job_dir marker and the adapters."""
    dest = runs / job_id
    dest.mkdir(parents=True)
    (dest / "job_dir").write_text(f"{job_dir}\n")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (dest / f).write_bytes((job_dir / "output" / f).read_bytes())
    return dest


def cluster(scratch: Path) -> Cluster:
    return Cluster(inventory(scratch), LocalController(), {})


# ---------------------------------------------------------------- bad input: not a stack


def test_fab_down_on_the_local_target_is_refused_naming_local_down():
    res = subprocess.run([str(REPO / ".venv/bin/fab"), "down", "--target", "local"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "fab down: the local cluster is not a Pulumi stack, there is nothing to destroy; "
        "`fab local.down` takes the local cluster down"]


def test_train_down_on_the_local_target_is_refused_before_the_config_is_read(tmp_path):
    with pytest.raises(options.OptionError) as err:  # a config that does not exist: the flag is named first
        options.parse(target="local", down=True, config=str(tmp_path / "missing.yaml"))
    assert str(err.value).startswith("--down: the local cluster is not a Pulumi stack")
    assert "`fab local.down`" in str(err.value)
    with pytest.raises(options.OptionError, match="python -m boottest.teardown"):
        options.parse(target="boot", down=True)


# ---------------------------------------------------------------- refusals on the cluster


def test_a_job_in_flight_refuses_down_naming_it(tmp_path, tools):
    squeue_out, log = tools
    squeue_out.write_text("12|slurm-gpu-finetune|RUNNING\n13|slurm-gpu-finetune|PENDING\n")
    runs = tmp_path / "runs"
    with pytest.raises(stack_down.DownRefused) as err:
        stack_down.down(cluster(tmp_path / "scratch"), runs, "dev", say=lambda s: None)
    msg = str(err.value)
    assert msg.startswith("a run is in flight: job(s) 12 (slurm-gpu-finetune, RUNNING), 13 (slurm-gpu-finetune, PENDING) "
                          "on the cluster")
    assert "`fab cancel --stack dev --job N`" in msg
    assert pulumi_calls(log) == []  # nothing destroyed, nothing even asked


def test_the_run_train_down_just_brought_home_may_still_be_completing(tmp_path, tools):
    """Slurm shows a finished job as COMPLETING while its epilog runs: `fab train --down` leaves its own job
    out then, and no other (nor its own while RUNNING)."""
    squeue_out, _ = tools
    ctl = LocalController()
    squeue_out.write_text("12|slurm-gpu-finetune|COMPLETING\n")
    assert stack_down.jobs_in_flight(ctl, done_job="12") == []
    assert stack_down.jobs_in_flight(ctl, done_job="11") == ["12 (slurm-gpu-finetune, COMPLETING)"]
    squeue_out.write_text("12|slurm-gpu-finetune|RUNNING\n")
    assert stack_down.jobs_in_flight(ctl, done_job="12") == ["12 (slurm-gpu-finetune, RUNNING)"]


def test_a_finished_run_not_home_refuses_naming_the_run_until_its_adapters_match(tmp_path, tools):
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    job_dir = finished_run(scratch)
    finished_run(scratch, job_id="14", name="20261207-040000-ffffff", completed=False)  # failed: nothing to bring
    said: list[str] = []

    with pytest.raises(stack_down.DownRefused) as err:
        stack_down.down(cluster(scratch), runs, None, say=said.append)
    msg = str(err.value)
    assert msg.startswith(f"finished run(s) not home: job 12 ({JOB_DIR_NAME}) is not in {runs}. "
                          "`fab logs --job 12` brings it home")
    assert "ffffff" not in msg

    dest = bring_home(runs, job_dir)
    (dest / "adapter_model.safetensors").write_bytes(b"cut short")  # a download that did not finish
    with pytest.raises(stack_down.DownRefused) as err:
        stack_down.down(cluster(scratch), runs, None, say=said.append)
    assert (f"job 12 ({JOB_DIR_NAME}): adapter_model.safetensors in {dest} missing or not the controller's"
            in str(err.value))
    assert pulumi_calls(log) == []

    (dest / "adapter_model.safetensors").write_bytes((job_dir / "output" / "adapter_model.safetensors").read_bytes())
    stack_down.down(cluster(scratch), runs, None, say=said.append)
    assert pulumi_calls(log) == [["stack", "--show-name"], ["stack", "export", "--stack", "dev"],
                                 ["destroy", "--yes", "--skip-preview", "--non-interactive", "--stack", "dev"]]
    text = "\n".join(said)
    assert f"no job on the cluster; 1 finished run(s), all home in {runs} with their adapters verified" in text
    assert "removed from stack dev: 2 Instance, 1 NatGateway, 1 Vpc" in text
    for rid in ("i-0ctl", "i-0g01", "nat-0abc", "vpc-0abc"):
        assert rid in text
    assert "prov-1" not in text


def test_a_failed_destroy_says_the_stack_may_be_partly_up(tmp_path, tools, monkeypatch):
    _, log = tools
    bad = tmp_path / "bin" / "pulumi"
    bad.write_text(bad.read_text().replace('print("Destroying (dev):")',
                                           'print("error: deleting nat-0abc: DependencyViolation"); sys.exit(255)'))
    with pytest.raises(stack_down.DownRefused) as err:
        stack_down.destroy("dev", say=lambda s: None)
    assert "`pulumi destroy --stack dev` failed (exit 255); the stack may be partly up" in str(err.value)
    assert "DependencyViolation" in str(err.value)


# ---------------------------------------------------------------- fab train --down


def test_train_down_is_refused_while_another_run_is_in_flight(tmp_path, tools, monkeypatch):
    """The whole of `fab train --down` up to its first look at the cluster: the inventory from the stack
    (`pulumi stack output`), then squeue, before anything is uploaded or submitted."""
    squeue_out, log = tools
    squeue_out.write_text("9|slurm-gpu-finetune|RUNNING\n")
    inv = inventory(tmp_path / "scratch")
    key = tmp_path / "id_test"
    key.write_text("not a key: never used, no host is reached\n")
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"inventory": dataclasses.asdict(inv)}))
    monkeypatch.setenv("FAKE_PULUMI_OUTPUTS", str(outputs))
    from ops.finetune import pipeline

    monkeypatch.setattr(pipeline, "connect", lambda inv, identity: Cluster(inv, LocalController(), {}))
    monkeypatch.setattr(pipeline, "run", lambda *a, **k: pytest.fail("the run started"))
    opts = options.parse(target="aws", stack="dev", down=True, identity=str(key),
                         model="Qwen/Qwen3-4B", data="tatsu-lab/alpaca")
    with pytest.raises(stack_down.DownRefused) as err:
        pipeline.train(opts, say=lambda s: None)
    assert str(err.value).startswith("--down: a run is in flight: job(s) 9 (slurm-gpu-finetune, RUNNING) on the cluster")
    assert [c for c in pulumi_calls(log) if c[0] == "destroy"] == []


def test_train_down_destroys_the_stack_once_its_run_is_home(tmp_path, tools, monkeypatch):
    """`fab train --down` end to end around the run itself (which other tests cover): squeue empty, the run
    brought home (as pipeline.finish leaves it), then the checks, `pulumi destroy` and what it removed."""
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    inv = inventory(scratch)
    key = tmp_path / "id_test"
    key.write_text("not a key: never used, no host is reached\n")
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"inventory": dataclasses.asdict(inv)}))
    monkeypatch.setenv("FAKE_PULUMI_OUTPUTS", str(outputs))
    from ops.actions import nccl
    from ops.finetune import pipeline, summary

    def the_run(cl, opts, nodes, gpus, say, closing=None, **kwargs):
        job_dir = finished_run(scratch)
        said.extend(closing)
        return summary.RunSummary("12", "", {}, [], nccl.parse([]), dest=bring_home(runs, job_dir))

    said: list[str] = []
    monkeypatch.setattr(pipeline, "RUNS", runs)
    monkeypatch.setattr(pipeline, "connect", lambda inv, identity: Cluster(inv, LocalController(), {}))
    monkeypatch.setattr(pipeline, "run", the_run)
    opts = options.parse(target="aws", stack="dev", down=True, identity=str(key),
                         model="Qwen/Qwen3-4B", data="tatsu-lab/alpaca")
    pipeline.train(opts, say=said.append)
    assert [c for c in pulumi_calls(log) if c[0] == "destroy"] == [
        ["destroy", "--yes", "--skip-preview", "--non-interactive", "--stack", "dev"]]
    text = "\n".join(said)
    assert "  stack         --down: `pulumi destroy` once the adapters are home and verified" in text
    assert f"--down: no job on the cluster; 1 finished run(s), all home in {runs} with their adapters verified" in text
    assert "removed from stack dev: 2 Instance, 1 NatGateway, 1 Vpc" in text
