"""Step 5 of `fab train`: a new job directory with the training code, config and batch script (the admin
user's; the job writes only its work and output folders), the fine-tune submitted held, its stale log
removed, then released."""

from __future__ import annotations

import io
import shlex
import tarfile
import time
import uuid

from cluster.inventory import Inventory
from ops.actions import fetch_files, slurm
from ops.actions.options import REPO, TrainOptions
from ops.finetune import inputs
from ops.finetune import sbatch as jobs
from ops.finetune.trainstep import TrainError, step
from ops.say import Say
from ops.ssh.remote import Cluster, put_bytes, put_text

TRAINING_DIR = REPO / "training"


def new_job_dir(inv: Inventory) -> str:
    return f"{inv.scratch}/slurm-gpu/jobs/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def training_tarball() -> bytes:
    """training/ as a tar.gz (no caches), so `-m training.train` imports from the job dir. Only
    regular files and folders under training/, each name one that stays inside the job dir
    (fetch_files.safe_name): the controller extracts it with `tar -xzf` (launch)."""
    buf = io.BytesIO()

    def keep(info: tarfile.TarInfo):
        name = info.name
        if "__pycache__" in name.split("/") or name.endswith(".pyc"):
            return None
        if not (info.isreg() or info.isdir()):
            raise TrainError(f"{TRAINING_DIR}: {name} is not a regular file or folder (a link?): "
                             "the training code is uploaded as plain files only; replace it with a file")
        fetch_files.safe_name(name, nested=True)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(TRAINING_DIR, arcname="training", filter=keep)
    return buf.getvalue()


def put_training(ctl, job_dir: str) -> None:
    """training/ into `job_dir` (the login user's folder), so `python -m training.<module>` imports from there."""
    q = shlex.quote
    put_bytes(ctl, training_tarball(), f"{job_dir}/training.tar.gz")
    # Our own archive (training_tarball: plain files under training/); GNU tar also skips ".." members
    # (https://www.gnu.org/software/tar/manual/html_node/absolute.html).
    ctl.run(f"tar --no-same-owner -xzf {q(job_dir)}/training.tar.gz -C {q(job_dir)} && rm {q(job_dir)}/training.tar.gz",
            hide=True)


def launch(cl: Cluster, opts: TrainOptions, nodes: int, gpus: int, say: Say,
           submitted: list[str] | None = None, extra: dict[str, object] | None = None) -> tuple[str, str, str]:
    """Upload code, config and script; submit. Returns (job id, job dir, log path). `extra`: more
    training settings for the job's command line (the cost cap's).

    The job id is also appended to `submitted` as soon as Slurm gives it, so a Ctrl-C that
    lands before this returns can still say which job keeps running.
    """
    inv, ctl = cl.inventory, cl.controller
    q = shlex.quote
    job_dir = new_job_dir(inv)
    # The code, config and script are the admin user's, in a folder no job can write: the job runs as
    # the job user and writes only its work and output folders (docs/SECURITY.md).
    slurm.make_job_dir(ctl, inv, job_dir, jobs.WORK, jobs.OUTPUT)
    put_training(ctl, job_dir)
    put_text(ctl, opts.config.read_text(), f"{job_dir}/config.yaml")

    # The job reads exactly what the flags or the config name; only the tiny model and data
    # (local-tiny.yaml's paths) are made here when missing, and that is said.
    flags: dict[str, object] = {"model_name_or_path": opts.model, "dataset_name": opts.data,
                                "n_examples": opts.examples, **(extra or {})}
    if {opts.model_path, opts.data_path} & set(inputs.tiny_paths(inv)):
        inputs.ensure_tiny(cl, job_dir, say)
    say(f"      model {inputs.where(opts, 'model')}; data {inputs.where(opts, 'data')}")
    spec = jobs.base_spec(inv, jobs.FINETUNE_NAME, nodes, gpus, job_dir,
                          script_path=f"{job_dir}/finetune.sbatch", config=f"{job_dir}/config.yaml",
                          output_dir=f"{job_dir}/{jobs.OUTPUT}", train_args=jobs.train_flags(flags))
    put_text(ctl, jobs.render_finetune(spec), spec.script_path, 0o755)
    # Held until a stale log of the same name is gone: job ids start again at 1 on a new local
    # cluster while /scratch/logs stays, and the job appends to its log (--open-mode=append, so a
    # requeued attempt keeps the first one's lines): an old file would be streamed as this job's.
    user = slurm.job_user(inv)
    job_id = slurm.submit(ctl, spec.script_path, "--hold", user=user)
    if submitted is not None:
        submitted.append(job_id)
    log_path = f"{inv.scratch}/logs/{jobs.FINETUNE_NAME}-{job_id}.out"
    released = slurm.as_job_user(ctl, user, f"rm -f {q(log_path)} && scontrol release {q(job_id)}", warn=True)
    if not released.ok:
        raise TrainError(f"job {job_id} is held and could not be released: "
                         f"{(released.stderr or released.stdout).strip()}; "
                         f"run `sudo -u {user} scontrol release {job_id}` on the controller or "
                         f"`fab cancel --job {job_id}`")
    step(say, 5, f"submitted job {job_id}: {nodes} node(s) x {gpus} rank(s), code and config in {job_dir}; "
                 f"log {log_path}")
    return job_id, job_dir, log_path
