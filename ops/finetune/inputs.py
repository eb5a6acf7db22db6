"""Before `fab train` writes anything to the cluster: the model and data it names exist there and the data
is valid training data (check_inputs); the local cluster's tiny model and data, made once (ensure_tiny)."""

from __future__ import annotations

import shlex
import uuid

from fabric import Connection

from cluster.inventory import Inventory
from ops.actions import slurm
from ops.actions.options import REPO, TrainOptions
from ops.finetune.trainstep import TrainError
from ops.say import Say, shown
from ops.ssh.remote import Cluster, exists, put_bytes

TINY_DIR = "tiny"  # under scratch: made by training.make_tiny for the local cluster
DATA_CHECK = REPO / "training" / "data.py"  # the training code's own data validation, run alone on a node


def ensure_tiny(cl: Cluster, job_dir: str, say: Say) -> tuple[str, str]:
    """The tiny model and data on /scratch for the local cluster, made once (atomically)."""
    inv = cl.inventory
    tiny = f"{inv.scratch}/{TINY_DIR}"
    model, data = tiny_paths(inv)
    node = cl.nodes[inv.gpu_nodes[0].name]
    if exists(node, f"{model}/config.json") and exists(node, data):
        say(f"      tiny model and data already in {tiny}")
        return model, data
    partial = f"{tiny}.partial-{uuid.uuid4().hex[:6]}"
    q = shlex.quote
    cmd = (f"cd {q(job_dir)} && {q(inv.python)} -m training.make_tiny --out {q(partial)} && "
           f"{{ mv -T {q(partial)} {q(tiny)} 2>/dev/null || rm -rf {q(partial)}; }}")
    res = node.run(cmd, hide=True, warn=True)
    if not res.ok or not exists(node, data):
        node.run(f"rm -rf {q(partial)}", hide=True, warn=True)
        raise TrainError(f"making the tiny model on {inv.gpu_nodes[0].name} failed: "
                         f"{(res.stderr or res.stdout).strip()[-800:]}")
    say(f"      made the tiny model and data in {tiny} (training.make_tiny)")
    return model, data


def tiny_paths(inv: Inventory) -> tuple[str, str]:
    """(model, data) that training.make_tiny makes on /scratch (named by local-tiny.yaml)."""
    tiny = f"{inv.scratch}/{TINY_DIR}"
    return f"{tiny}/model", f"{tiny}/data/train.jsonl"


def where(opts: TrainOptions, flag: str) -> str:
    """How the user named the model or data: the flag, or the config's setting."""
    value = opts.model_path if flag == "model" else opts.data_path
    if getattr(opts, flag):
        return f"--{flag} {value}"
    key = "model_name_or_path" if flag == "model" else "dataset_name"
    return f"{key} {value} (from --config {opts.config.name})"


def check_data_on(node: Connection, python: str, data: str):
    """training/data.py's validation of `data`, run on `node` as that real file (copied to a
    temporary path: training/ is not uploaded yet)."""
    q = shlex.quote
    remote = f"/tmp/slurm-gpu-check-data-{uuid.uuid4().hex[:12]}.py"
    put_bytes(node, DATA_CHECK.read_bytes(), remote)
    try:
        # -I: isolated. /tmp is every job's to write; without it Python would import a json.py a job
        # left beside the script, as the admin user (who has sudo).
        return node.run(f"{q(python)} -I {q(remote)} {q(data)}", hide=True, warn=True, in_stream=False)
    finally:
        node.run(f"rm -f {q(remote)}", hide=True, warn=True, in_stream=False)


def check_inputs(cl: Cluster, opts: TrainOptions, say: Say) -> None:
    """The model and data paths the job will read (flags, else the config's) exist on the
    cluster, the model is a model directory and the data file is valid training data.

    Runs before anything is written to /scratch or submitted, so a bad path or data
    file leaves no job directory and no job behind. The tiny model and data are made later.
    """
    inv, ctl = cl.inventory, cl.controller
    tiny = tiny_paths(inv)
    for flag, value in (("model", opts.model_path), ("data", opts.data_path)):
        if not value or not value.startswith("/") or value in tiny:
            continue
        if not exists(ctl, value):
            raise TrainError(f"{where(opts, flag)}: no such path on the cluster (checked on the controller); "
                             f"copy it under {inv.scratch} first or fix the path")
        if flag == "model" and not exists(ctl, f"{value}/config.json"):
            raise TrainError(f"{where(opts, flag)}: not a model directory (no config.json in it); give the "
                             "directory that `save_pretrained` wrote (config.json, weights, tokenizer)")
        # The job reads it as the jobs' user, not as the user that made it (safetensors saves 0600).
        res = slurm.as_job_user(ctl, slurm.job_user(inv), f"find {shlex.quote(value)} -maxdepth 1 ! -readable -print",
                                warn=True)
        if res.stdout.strip() or not res.ok:
            hidden = res.stdout.split("\n")[0].strip() or (res.stderr or "").strip()[:200]
            raise TrainError(f"{where(opts, flag)}: the jobs' user {slurm.job_user(inv)} cannot read "
                             f"{shown(hidden)}; on the controller: sudo chmod -R a+rX {shlex.quote(value)}")
    data = opts.data_path
    if data and data.startswith("/") and data not in tiny:
        name = inv.gpu_nodes[0].name
        res = check_data_on(cl.nodes[name], inv.python, data)
        if not res.ok:
            why = (res.stderr or res.stdout).strip().splitlines() or [f"exit {res.exited}"]
            raise TrainError(f"{where(opts, 'data')}: {why[-1]} (checked on {name} before uploading anything)")
        # stderr: "N valid rows, format F (...); left out: ..." (training/data.py main): the format is printed here.
        say(f"      {where(opts, 'data')}: {(res.stderr or '').strip() or res.stdout.strip() + ' valid rows'}")
