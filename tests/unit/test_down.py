"""`fab down` and `fab train --down` (ops/actions/stack_down.py): refused while a job runs, while a finished run
is not home and verified, and on the local target; otherwise `pulumi destroy` of the stack, and what it removed.

The controller's side is the real shell script run by invoke on files laid out as a job leaves them
(jobs/finetune.sbatch.j2's SLURM_GPU_JOB line, output/COMPLETED, adapter files); `squeue` and `pulumi` are
stand-ins on PATH that answer as the real ones print and record their argv (the Pulumi CLI cannot run here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fabric
import pytest
from invoke import Context

import fabfile
from cluster.inventory import Inventory
from cluster.spec import AwsResources
from ops.actions import options, stack_down
from ops.finetune import sbatch as jobs
from ops.ssh import remote
from ops.ssh.remote import Cluster
from tests.support import inventories
from tests.unit.test_memory_model import hub  # noqa: F401  (the stand-in hub serving config.json: a fixture)

REPO = Path(__file__).resolve().parents[2]
JOB_DIR_NAME = "20261207-031500-a1b2c3"
LATER = "20261208-000000-bbbbbb"  # a run listed after JOB_DIR_NAME's
RESOURCES = [  # what `pulumi stack export` holds: Pulumi's own entries are not the cloud's
    {"type": "pulumi:pulumi:Stack", "urn": "urn:pulumi:dev::slurm-gpu::pulumi:pulumi:Stack::slurm-gpu-dev"},
    {"type": "pulumi:providers:aws", "urn": "urn:...:default", "id": "prov-1"},
    {"type": "slurm-gpu:infra:Cluster", "urn": "urn:...:mini"},
    {"type": "aws:ec2/instance:Instance", "urn": "urn:...:ctl", "id": "i-0ctl"},
    {"type": "aws:ec2/instance:Instance", "urn": "urn:...:g01", "id": "i-0g01"},
    {"type": "aws:ec2/natGateway:NatGateway", "urn": "urn:...:nat", "id": "nat-0abc"},
    {"type": "aws:ec2/vpc:Vpc", "urn": "urn:...:vpc", "id": "vpc-0abc"},
]

# A stand-in `pulumi`: FAKE_PULUMI_STACKS maps each stack to its state's resources and `inventory` output.
# The selected stack is "dev" until the inventory has been read without --stack (`pulumi stack output`),
# then "other": a `pulumi stack select other` in another terminal while fab checks the runs.
FAKE_PULUMI = """#!{python}
import json, os, sys
log = os.environ["FAKE_PULUMI_LOG"]
earlier = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
stacks = json.loads(open(os.environ["FAKE_PULUMI_STACKS"]).read())
read_selected = any(a[:3] == ["stack", "output", "--json"] and "--stack" not in a for a in earlier)
selected = "other" if read_selected else "dev"
named = [a.split("=", 1)[1] for a in args if a.startswith("--stack=")]
named += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--stack"]
stack = stacks[named[0] if named else selected]
if args[:2] == ["stack", "--show-name"]:
    print(selected)
elif args[:2] == ["stack", "export"]:
    root = {{**stack["resources"][0], "outputs": {{"inventory": stack["inventory"]}}}}
    print(json.dumps({{"version": 3, "deployment": {{"resources": [root, *stack["resources"][1:]]}}}}))
elif args[:3] == ["stack", "output", "--json"]:
    print(json.dumps({{"inventory": stack["inventory"]}}))
elif args[:1] == ["destroy"]:
    # What `pulumi destroy --skip-preview` prints as it goes (abridged).
    print("Destroying (dev):")
    for r in stack["resources"]:
        print(" -  " + r["type"] + " " + r["urn"].rsplit(":", 1)[-1] + " deleted")
    print("Resources:\\n    - 7 deleted\\n\\nDuration: 2m31s")
else:
    sys.exit("fake pulumi: unexpected " + " ".join(args))
"""

# squeue as the controller has it, answering only the format stack_down asks for (-h -o '%i|%T|%j').
FAKE_SQUEUE = """#!/bin/sh
[ "$1" = -h ] && [ "$2" = -o ] && [ "$3" = '%i|%T|%j' ] && [ $# -eq 3 ] || {{ echo "squeue: unexpected $*" >&2; exit 2; }}
cat {answer}
"""


class LocalController(Context):
    """The controller's shell, run here by invoke (the same `run(cmd, hide=, warn=, in_stream=)` as Fabric),
    logged in as the inventory's user, who is also its jobs' (an inventory without job_user)."""

    user = "ubuntu"

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass


def write_stacks(path: Path, specs: dict[str, Inventory]) -> None:
    path.write_text(json.dumps({name: {"resources": RESOURCES, "inventory": inv.to_dict()}
                                for name, inv in specs.items()}))


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """A fake `pulumi` and `squeue` first on PATH; returns (squeue's answer file, pulumi's argv log).
    Both stacks, dev and other, hold the inventory of scratch tmp_path/scratch unless a test says otherwise."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pulumi").write_text(FAKE_PULUMI.format(python=sys.executable))
    squeue_out = tmp_path / "squeue.out"
    squeue_out.write_text("")
    (bin_dir / "squeue").write_text(FAKE_SQUEUE.format(answer=squeue_out))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "pulumi-argv.jsonl"
    stacks = tmp_path / "stacks.json"
    inv = inventory(tmp_path / "scratch")
    write_stacks(stacks, {"dev": inv, "other": inventory(tmp_path / "scratch", "other", "203.0.113.9")})
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_PULUMI_LOG", str(log))
    monkeypatch.setenv("FAKE_PULUMI_STACKS", str(stacks))
    return squeue_out, log


def pulumi_calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def inventory(scratch: Path, cluster_name: str = "mini", public_ip: str = "198.51.100.7") -> Inventory:
    return inventories.make(cluster_name=cluster_name, public_ip=public_ip,
                            gpu_nodes=(("gpu-node-01", "10.0.1.11"), ("gpu-node-02", "10.0.1.12")),
                            scratch=str(scratch), idle_stop_s=1800, aws=AwsResources(), region="ap-northeast-2")


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
    """What run_home.finish leaves in runs/<job>/: the job_dir marker and the adapters."""
    dest = runs / job_id
    dest.mkdir(parents=True)
    (dest / "job_dir").write_text(f"{job_dir}\n")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (dest / f).write_bytes((job_dir / "output" / f).read_bytes())
    return dest


def cluster(scratch: Path) -> Cluster:
    return Cluster(inventory(scratch), LocalController(), {})


@pytest.fixture
def opened(monkeypatch):
    """open_cluster reaches the controller through LocalController (the inventory is the stack's)."""
    monkeypatch.setattr(remote, "connect", lambda inv, identity: Cluster(inv, LocalController(), {}))


def fab_down(stack: str | None, runs: Path, say: list[str], drop_unfinished: bool = False) -> None:
    stack_down.down(options.parse_cluster(target="aws", stack=stack), runs, drop_unfinished, say=say.append)


def destroyed(log: Path) -> list[list[str]]:
    return [c for c in pulumi_calls(log) if c[0] == "destroy"]


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
    with pytest.raises(options.OptionError, match="^--drop-unfinished .* pass it with --down"):
        options.parse(target="aws", drop_unfinished=True)


# ---------------------------------------------------------------- one stack from the checks to the destroy


def test_fab_down_destroys_the_stack_it_checked_when_another_is_selected_meanwhile(tmp_path, tools, opened):
    """No --stack: the selected stack is settled before the inventory is read; a `pulumi stack select`
    elsewhere while the runs are checked (the stand-in's selection moves to "other") destroys nothing else."""
    _, log = tools
    fabfile.down(Context(config=fabric.Config()), target="aws")
    calls = pulumi_calls(log)
    assert calls[0] == ["stack", "--show-name"]
    assert [c for c in calls if c[:2] == ["stack", "--show-name"]] == [["stack", "--show-name"]]
    assert ["stack", "output", "--json", "--stack", "dev"] in calls
    assert destroyed(log) == [["destroy", "--yes", "--skip-preview", "--non-interactive", "--stack=dev"]]


def test_a_stack_whose_state_holds_another_cluster_is_not_destroyed(tmp_path, tools):
    """`pulumi stack export` of the stack must hold the inventory whose controller was checked."""
    _, log = tools
    checked = inventory(tmp_path / "scratch", public_ip="203.0.113.50")
    with pytest.raises(stack_down.DownRefused) as err:
        stack_down.destroy("dev", checked, say=lambda s: None)
    assert str(err.value).startswith(
        "stack dev holds cluster 'mini', controller 198.51.100.7, not the cluster whose runs were checked "
        "(cluster 'mini', controller 203.0.113.50): nothing destroyed")
    assert destroyed(log) == []


# ---------------------------------------------------------------- refusals on the cluster


def test_a_job_in_flight_refuses_down_naming_it(tmp_path, tools, opened):
    squeue_out, log = tools
    squeue_out.write_text("12|RUNNING|slurm-gpu-finetune\n13|PENDING|slurm-gpu-finetune\n")
    with pytest.raises(stack_down.DownRefused) as err:
        fab_down("dev", tmp_path / "runs", [])
    msg = str(err.value)
    assert msg.startswith("a run is in flight: job(s) 12 (slurm-gpu-finetune, RUNNING), 13 (slurm-gpu-finetune, PENDING) "
                          "on the cluster")
    assert "`fab cancel --stack=dev --job N`" in msg
    assert destroyed(log) == []


def test_a_job_name_with_the_separator_is_read_and_a_line_squeue_cannot_explain_refuses(tools):
    squeue_out, _ = tools
    ctl = LocalController()
    squeue_out.write_text("21|RUNNING|eval|sweep\n")  # a job named eval|sweep
    assert stack_down.jobs_in_flight(ctl) == ["21 (eval|sweep, RUNNING)"]
    for line in ("21|RUNNING", "slurm_load_jobs error: Socket timed out", "21 RUNNING eval"):
        squeue_out.write_text(f"{line}\n")
        with pytest.raises(stack_down.DownRefused, match="^squeue answered a line fab cannot read"):
            stack_down.jobs_in_flight(ctl)


def test_the_run_train_down_just_brought_home_may_still_be_completing(tmp_path, tools):
    """Slurm shows a finished job as COMPLETING while its epilog runs: `fab train --down` leaves its own job
    out then, and no other (nor its own while RUNNING)."""
    squeue_out, _ = tools
    ctl = LocalController()
    squeue_out.write_text("12|COMPLETING|slurm-gpu-finetune\n")
    assert stack_down.jobs_in_flight(ctl, done_job="12") == []
    assert stack_down.jobs_in_flight(ctl, done_job="11") == ["12 (slurm-gpu-finetune, COMPLETING)"]
    squeue_out.write_text("12|RUNNING|slurm-gpu-finetune\n")
    assert stack_down.jobs_in_flight(ctl, done_job="12") == ["12 (slurm-gpu-finetune, RUNNING)"]


def test_a_finished_run_not_home_refuses_naming_the_run_until_its_adapters_match(tmp_path, tools, opened):
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    job_dir = finished_run(scratch)
    said: list[str] = []

    with pytest.raises(stack_down.DownRefused) as err:
        fab_down(None, runs, said)
    msg = str(err.value)
    assert msg.startswith(f"finished run(s) not home: job 12 ({JOB_DIR_NAME}) is not in {runs}. "
                          "`fab logs --stack=dev --job 12` brings it home")
    assert msg.endswith("To drop them anyway, `pulumi destroy --stack=dev` (it checks nothing)")

    dest = bring_home(runs, job_dir)
    (dest / "adapter_model.safetensors").write_bytes(b"cut short")  # a download that did not finish
    with pytest.raises(stack_down.DownRefused) as err:
        fab_down("dev", runs, said)
    assert (f"job 12 ({JOB_DIR_NAME}): adapter_model.safetensors in {dest} missing or not the controller's"
            in str(err.value))
    assert destroyed(log) == []

    (dest / "adapter_model.safetensors").write_bytes((job_dir / "output" / "adapter_model.safetensors").read_bytes())
    log.unlink()
    fab_down("dev", runs, said)
    assert pulumi_calls(log) == [["stack", "output", "--json", "--stack", "dev"], ["stack", "export", "--stack=dev"],
                                 ["destroy", "--yes", "--skip-preview", "--non-interactive", "--stack=dev"]]
    text = "\n".join(said)
    assert f"no job on the cluster; 1 finished run(s), all home in {runs} with their adapters verified" in text
    assert "     -  aws:ec2/instance:Instance ctl deleted" in said  # pulumi's progress, as it comes
    assert "removed from stack dev: 2 Instance, 1 NatGateway, 1 Vpc" in text
    for rid in ("i-0ctl", "i-0g01", "nat-0abc", "vpc-0abc"):
        assert rid in text
    assert "prov-1" not in text
    assert "`fab spot-requests` lists them" in text


def test_a_completed_run_without_adapters_is_not_home_though_its_folder_is(tmp_path, tools, opened):
    """runs.run_dir writes runs/<job>/job_dir before the download: the marker alone proves nothing, and a
    COMPLETED run must have its adapter_config.json and adapter_model.* on both sides."""
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    job_dir = finished_run(scratch)
    for f in (job_dir / "output").glob("adapter_*"):
        f.unlink()
    (runs / "12").mkdir(parents=True)
    (runs / "12" / "job_dir").write_text(f"{job_dir}\n")
    bring_home(runs, finished_run(scratch, job_id="30", name=LATER), job_id="30")  # listed after it, all fine
    with pytest.raises(stack_down.DownRefused) as err:
        fab_down("dev", runs, [])
    assert (f"job 12 ({JOB_DIR_NAME}): COMPLETED but no adapter_config.json or adapter_model.* on the controller"
            in str(err.value))
    assert destroyed(log) == []


def test_an_adapter_the_controller_cannot_hash_refuses_naming_the_run(tmp_path, tools, opened):
    """sha256sum failing on the controller (a read error: a stand-in sha256sum fails on one file) is said per
    run, not taken for "nothing to check"."""
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    bring_home(runs, finished_run(scratch))
    failing = tmp_path / "bin" / "sha256sum"
    failing.write_text('#!/bin/sh\n[ "$2" = adapter_model.safetensors ] && { echo "sha256sum: $2: Input/output '
                       f'error" >&2; exit 1; }}\nexec {shutil.which("sha256sum")} "$@"\n')
    failing.chmod(0o755)
    with pytest.raises(stack_down.DownRefused) as err:
        fab_down("dev", runs, [])
    assert (f"job 12 ({JOB_DIR_NAME}): sha256sum could not read adapter_model.safetensors on the controller"
            in str(err.value))
    assert destroyed(log) == []


def test_a_job_directory_fab_did_not_name_refuses(tmp_path, tools, opened):
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    finished_run(scratch, job_id="15", name="-odd")
    bring_home(runs, finished_run(scratch, job_id="30", name=LATER), job_id="30")  # its lines come after
    with pytest.raises(stack_down.DownRefused) as err:
        fab_down("dev", runs, [])
    assert str(err.value).startswith("the controller's list of runs has a line fab cannot read ('run -odd')")
    assert destroyed(log) == []


def test_unfinished_runs_with_checkpoints_are_named_and_dropped_only_when_asked(tmp_path, tools, opened):
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    job_dir = finished_run(scratch, job_id="14", name="20261207-040000-ffffff", completed=False)
    (job_dir / "output" / "checkpoint-16").mkdir()
    finished_run(scratch, job_id="16", name="20261207-050000-000000", completed=False)
    shutil.rmtree(scratch / "slurm-gpu" / "jobs" / "20261207-050000-000000" / "output" / "checkpoint-8")
    with pytest.raises(stack_down.DownRefused) as err:
        fab_down("dev", runs, [])
    assert str(err.value) == (
        "unfinished run(s) would lose their checkpoints on /scratch: job 14 (20261207-040000-ffffff), "
        "checkpoint-16. `fab logs --stack=dev --job N` shows why one stopped; pass --drop-unfinished to destroy "
        "the stack with them")
    assert destroyed(log) == []
    said: list[str] = []
    fab_down("dev", runs, said, drop_unfinished=True)
    assert len(destroyed(log)) == 1
    assert (f"no job on the cluster; 0 finished run(s), all home in {runs} with their adapters verified; dropped "
            "with the stack (--drop-unfinished): job 14 (20261207-040000-ffffff), checkpoint-16") in said


def test_a_failed_destroy_says_the_stack_may_be_partly_up(tmp_path, tools):
    bad = tmp_path / "bin" / "pulumi"
    bad.write_text(bad.read_text().replace('print("Destroying (dev):")',
                                           'print("error: deleting nat-0abc: DependencyViolation"); sys.exit(255)'))
    said: list[str] = []
    with pytest.raises(stack_down.DownRefused) as err:
        stack_down.destroy("dev", None, say=said.append)
    assert "`pulumi destroy --stack=dev` failed (exit 255); the stack may be partly up" in str(err.value)
    assert "DependencyViolation" in str(err.value)
    assert "    error: deleting nat-0abc: DependencyViolation" in said


# ---------------------------------------------------------------- fab train --down


def train_down(tmp_path, monkeypatch, the_run, say) -> None:
    """`fab train --down` on the default stack, Qwen/Qwen3-4B's config.json from the stand-in hub (`hub`) for
    the fit check before launch."""
    key = tmp_path / "id_test"
    key.write_text("not a key: never used, no host is reached\n")
    from ops.finetune import pipeline, runs

    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(pipeline, "connect", lambda inv, identity: Cluster(inv, LocalController(), {}))
    monkeypatch.setattr(pipeline, "run", the_run)
    opts = options.parse(target="aws", stack="dev", down=True, identity=str(key),
                         model="Qwen/Qwen3-4B", data="tatsu-lab/alpaca")
    pipeline.train(opts, say=say)


@pytest.mark.usefixtures("hub")
def test_train_down_is_refused_while_another_run_is_in_flight(tmp_path, tools, monkeypatch):
    """The whole of `fab train --down` up to its first look at the cluster: the inventory from the stack
    (`pulumi stack output`), then squeue, before anything is uploaded or submitted."""
    squeue_out, log = tools
    squeue_out.write_text("9|RUNNING|slurm-gpu-finetune\n")
    with pytest.raises(stack_down.DownRefused) as err:
        train_down(tmp_path, monkeypatch, lambda *a, **k: pytest.fail("the run started"), lambda s: None)
    assert str(err.value).startswith("--down: a run is in flight: job(s) 9 (slurm-gpu-finetune, RUNNING) on the cluster")
    assert destroyed(log) == []


@pytest.mark.usefixtures("hub")
def test_train_down_is_refused_before_training_while_an_earlier_run_is_not_home(tmp_path, tools, monkeypatch):
    _, log = tools
    finished_run(tmp_path / "scratch", job_id="7", name="20261206-010000-abcdef")
    with pytest.raises(stack_down.DownRefused) as err:
        train_down(tmp_path, monkeypatch, lambda *a, **k: pytest.fail("the run started"), lambda s: None)
    assert str(err.value).startswith("--down: finished run(s) not home: job 7 (20261206-010000-abcdef) is not in")
    assert destroyed(log) == []


@pytest.mark.usefixtures("hub")
def test_train_down_refused_after_its_run_still_says_what_bills(tmp_path, tools, monkeypatch):
    """The run finished but its adapters did not all come home: no destroy, and the summary's bill after all."""
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    from ops.actions import nccl
    from ops.finetune import summary

    def the_run(cl, opts, nodes, gpus, say, closing=None, **kwargs):
        dest = bring_home(runs, finished_run(scratch))
        (dest / "adapter_model.safetensors").unlink()
        return summary.RunSummary("12", "", {}, [], nccl.parse([]), dest=dest)

    said: list[str] = []
    with pytest.raises(stack_down.DownRefused, match="^--down: finished run\\(s\\) not home: job 12"):
        train_down(tmp_path, monkeypatch, the_run, said.append)
    assert destroyed(log) == []
    text = "\n".join(said)
    assert "  still billing $" in text and "  stop it: `fab down --stack=dev`" in text
    assert (runs / "12" / "run.json").is_file()  # the run's record is kept all the same


@pytest.mark.usefixtures("hub")
def test_train_down_destroys_the_stack_once_its_run_is_home(tmp_path, tools, monkeypatch):
    """`fab train --down` end to end around the run itself (which other tests cover): squeue empty, the run
    brought home (as run_home.finish leaves it), then the checks, `pulumi destroy` and what it removed."""
    _, log = tools
    scratch, runs = tmp_path / "scratch", tmp_path / "runs"
    from ops.actions import nccl
    from ops.finetune import summary

    def the_run(cl, opts, nodes, gpus, say, closing=None, **kwargs):
        job_dir = finished_run(scratch)
        said.extend(closing)
        return summary.RunSummary("12", "", {}, [], nccl.parse([]), dest=bring_home(runs, job_dir))

    said: list[str] = []
    train_down(tmp_path, monkeypatch, the_run, said.append)
    assert destroyed(log) == [["destroy", "--yes", "--skip-preview", "--non-interactive", "--stack=dev"]]
    text = "\n".join(said)
    assert "  stack         --down: `pulumi destroy` once the adapters are home and verified" in text
    assert f"--down: no job on the cluster; 1 finished run(s), all home in {runs} with their adapters verified" in text
    assert "removed from stack dev: 2 Instance, 1 NatGateway, 1 Vpc" in text
