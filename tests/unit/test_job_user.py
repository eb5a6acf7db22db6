"""Jobs run as the cluster's job user, never the admin user fab connects as (docs/SECURITY.md).

What fab sends to the controller for it: the job's folder made as root (the admin's, its writable
folders the job user's), sbatch and release as the job user, each value quoted. The boot test runs
the same path for real (tests/boot/test_boot_cluster.py::test_jobs_run_as_their_own_user_...)."""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import pytest
from invoke.runners import Result

from bootstrap import render
from cluster.facts import JOB_USER, ClusterFacts
from cluster.inventory import Inventory
from localcluster.plan import cluster_facts
from ops.actions import slurm
from tests.support import inventories


class Controller:
    """A Fabric connection that records what it is asked to run and answers `answer`."""

    def __init__(self, user: str, answer: Result | None = None) -> None:
        self.user, self.calls = user, []
        self.answer = answer if answer is not None else Result(stdout="42;cluster\n", exited=0)

    def run(self, cmd: str, **kw):
        self.calls.append(("as " + self.user, cmd))
        return self.answer

    def sudo(self, cmd: str, user: str = "root", **kw):
        self.calls.append(("sudo as " + user, cmd))
        return self.answer


def inventory(job_user: str = JOB_USER, ssh_user: str = "ubuntu", scratch: str = "/scratch") -> Inventory:
    return inventories.make(cluster_name="c", ssh_user=ssh_user, gpus_per_node=1, python="/p",
                            service_cmd="systemctl {action} {service}", job_user=job_user, scratch=scratch)


def inner(cmd: str) -> list[str]:
    """The words of the command under `sh -c '...'`."""
    words = shlex.split(cmd)
    assert words[:2] == ["sh", "-c"] and len(words) == 3, cmd
    return shlex.split(words[2])


def test_sbatch_and_release_run_as_the_job_user_through_sudo():
    ctl = Controller("ubuntu")
    assert slurm.submit(ctl, "/scratch/j x/finetune.sbatch", "--hold", user=JOB_USER) == "42"
    slurm.as_job_user(ctl, JOB_USER, "rm -f /scratch/logs/a.out && scontrol release 42")
    (who1, cmd1), (who2, cmd2) = ctl.calls
    assert who1 == who2 == f"sudo as {JOB_USER}"
    assert inner(cmd1) == ["sbatch", "--parsable", "--hold", "/scratch/j x/finetune.sbatch"]
    # Both halves run as the job user: one shell under sudo, not `sudo rm ... && scontrol ...`.
    assert inner(cmd2) == ["rm", "-f", "/scratch/logs/a.out", "&&", "scontrol", "release", "42"]


def test_the_job_folder_is_the_admins_and_only_its_work_folders_the_jobs():
    ctl, job_dir = Controller("ubuntu"), "/scratch/slurm-gpu/jobs/x'; touch /pwned; '"
    slurm.make_job_dir(ctl, inventory(), job_dir, "work", "output")
    [(who, cmd)] = ctl.calls
    assert who == "sudo as root"
    words = inner(cmd)
    first = words.index("install")
    assert words[first:first + 7] == ["install", "-d", "-o", "ubuntu", "-m", "0755", job_dir]
    last = words.index("install", first + 1)
    assert words[last:] == ["install", "-d", "-o", JOB_USER, "-g", JOB_USER, "-m", "0755", f"{job_dir}/work",
                            f"{job_dir}/output", "/scratch/logs", "/scratch/hf-cache", "/scratch/torch-compile-cache"]


class LocalRoot(Controller):
    """The controller is this machine, we are root on it: commands really run."""

    def run(self, cmd: str, **kw):
        res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
        return Result(stdout=res.stdout, stderr=res.stderr, exited=res.returncode)


@pytest.mark.root
def test_shared_folders_of_another_user_become_the_job_users_once_and_nothing_linked_in_later(tmp_path):
    """Run for real (as root, `daemon` standing in for the job user): a cluster from before jobs had
    their own user has its shared folders, with their files, handed over; a folder already the job
    user's is left as it is, so a root file a job linked into it never becomes the job's."""
    scratch, job = tmp_path / "scratch", "daemon"
    (scratch / "logs").mkdir(parents=True)
    (scratch / "logs" / "old.out").write_text("an old job's log")
    (scratch / "hf-cache").mkdir()
    os.chown(scratch / "hf-cache", pwd.getpwnam(job).pw_uid, grp.getgrnam(job).gr_gid)
    (scratch / "hf-cache" / "linked-in").write_text("root's")  # what a hard link to a root file would be
    inv = inventory(job_user=job, scratch=str(scratch))
    slurm.make_job_dir(LocalRoot("root"), inv, str(scratch / "jobs" / "a"), "work")

    def owner(p):
        return pwd.getpwuid((scratch / p).stat().st_uid).pw_name

    assert [owner(p) for p in ("logs", "logs/old.out", "hf-cache", "torch-compile-cache", "jobs/a/work")] == [job] * 5
    assert owner("hf-cache/linked-in") == "root" and owner("jobs/a") == "root"
    assert oct((scratch / "jobs" / "a").stat().st_mode & 0o7777) == "0o755"


def test_as_root_the_job_user_is_reached_through_runuser_and_root_jobs_run_directly():
    ctl = Controller("root")
    slurm.submit(ctl, "/s/a.sbatch", user=JOB_USER)
    slurm.submit(ctl, "/s/a.sbatch", user="root")  # the local cluster: jobs run as root
    (who1, cmd1), (who2, cmd2) = ctl.calls
    assert who1 == who2 == "as root"
    assert shlex.split(cmd1)[:4] == ["runuser", "-u", JOB_USER, "--"]
    assert inner(cmd1.split(" -- ", 1)[1]) == ["sbatch", "--parsable", "/s/a.sbatch"]
    assert inner(cmd2) == ["sbatch", "--parsable", "/s/a.sbatch"]


@pytest.mark.parametrize("said", ["sudo: unknown user slurmjob", "install: invalid user 'slurmjob'"])
def test_a_controller_without_the_job_user_is_named_with_the_fix(said):
    ctl = Controller("ubuntu", Result(stderr=said, exited=1))
    with pytest.raises(slurm.SlurmError, match="made before jobs ran as slurmjob.*jobuser and scratch steps"):
        slurm.make_job_dir(ctl, inventory(), "/scratch/j")
    with pytest.raises(slurm.SlurmError, match="made before jobs ran as slurmjob"):
        slurm.submit(ctl, "/scratch/j/a.sbatch", user=JOB_USER)


def test_who_jobs_run_as_per_target():
    assert slurm.job_user(inventory()) == JOB_USER
    assert slurm.job_user(inventory(job_user="")) == "ubuntu"  # an inventory from before: as then
    local = cluster_facts(2, 1)
    assert (local.job_user, local.job_uid) == ("root", 0)
    assert ClusterFacts.__dataclass_fields__["job_user"].default == JOB_USER


@pytest.mark.parametrize("user,uid", [("ubuntu; rm -rf /", 2950), ("root", 2950), ("jobs", 0), ("Jobs", 2950)])
def test_a_job_user_the_bootstrap_cannot_make_is_refused(user, uid):
    facts = dataclasses.replace(cluster_facts(2, 1), job_user=user, job_uid=uid)
    with pytest.raises(ValueError, match="job_user"):
        render.render_files(facts)


@pytest.fixture
def open_dir():
    """A folder any user can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="sgpu-jobuser-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.mark.root
def test_a_model_the_jobs_user_cannot_read_is_refused_before_anything_is_written(open_dir):
    """Run for real (as root, `daemon` standing in for the jobs' user): weights saved 0600 by their maker
    (safetensors does) are named with the fix before any job folder exists, and pass once readable."""
    from ops.actions.options import TrainOptions
    from ops.finetune import inputs

    model = open_dir / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"weights")
    weights.chmod(0o600)
    inv = inventory(job_user="daemon", scratch=str(open_dir))
    cl = types.SimpleNamespace(inventory=inv, controller=LocalRoot("root"), nodes={})
    opts = TrainOptions(target="aws", stack=None, config=Path("c.yaml"), nodes=None, gpus_per_node=None,
                        examples=None, model=str(model), data=None, identity=None)
    with pytest.raises(inputs.TrainError, match=r"jobs' user daemon cannot read .*model\.safetensors.*chmod -R a\+rX"):
        inputs.check_inputs(cl, opts, print)
    assert sorted(p.name for p in open_dir.iterdir()) == ["model"]  # nothing else written
    weights.chmod(0o644)
    inputs.check_inputs(cl, opts, print)
