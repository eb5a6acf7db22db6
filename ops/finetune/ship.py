"""`fab merge`: a run's LoRA adapters merged into its base model on the cluster, ready to serve.

A Slurm job on one GPU node (jobs/merge.sbatch.j2 running jobs/merge_adapters.py) writes bf16 safetensors,
the tokenizer with its chat template and the model card (model_card.py) into the run's own folder on the
shared /scratch, `<job dir>/merged/`. The merged model stays there (a 4B model is 8 GB) unless --download
brings it home to runs/<run>/merged/ (with run_home.download's caps); the model card is kept in
runs/<run>/README.md either way.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from pathlib import Path

from cluster.errors import UserError
from ops.actions import slurm
from ops.actions.options import REPO
from ops.finetune import model_card, run_home, runs
from ops.finetune import sbatch as jobs
from ops.say import Say, shown
from ops.ssh.remote import Cluster, exists, put_bytes, put_text, read_text

MERGED = "merged"  # in the run's job folder on the cluster, and in runs/<run>/ with --download
TIME_LIMIT = "02:00:00"  # a 70B model's 140 GB read from /scratch and written back, with room to spare
WAIT_S = 2 * 3600 + 300  # Slurm ends the job at TIME_LIMIT; fab waits a little longer
# A job folder as launch.new_job_dir names it: nothing else in runs/<run>/job_dir reaches a command line.
_JOB_DIR = re.compile(r"/[A-Za-z0-9_./-]+/slurm-gpu/jobs/[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")


class MergeError(UserError):
    pass


def find_run(root: Path, name: str | None) -> Path:
    """runs/<name>/ (default: the newest run with adapters), checked to hold a run's adapters and job folder."""
    run = runs.with_adapters(root, name, MergeError, "fab merge --run N")
    job_dir = (run / "job_dir").read_text().strip() if (run / "job_dir").is_file() else ""
    if not _JOB_DIR.fullmatch(job_dir) or ".." in job_dir.split("/"):
        raise MergeError(f"run {run.name}: {run / 'job_dir'} does not name the run's job folder on the cluster "
                         "(a run brought home by `fab train` or `fab logs` has it); it cannot be merged")
    return run


def merge(cl: Cluster, run: Path, download: bool = False, say: Say = print) -> dict:
    """Merge runs/<run>/'s adapters on the cluster; returns the job's MERGED record plus `where` (and `home`)."""
    inv, ctl = cl.inventory, cl.controller
    job_dir = (run / "job_dir").read_text().strip()
    adapters, out = f"{job_dir}/{jobs.OUTPUT}", f"{job_dir}/{MERGED}"
    if not exists(ctl, f"{adapters}/adapter_config.json"):
        raise MergeError(f"run {run.name}: its adapters are no longer on the cluster ({adapters}; a new cluster, "
                         "or /scratch cleaned): nothing to merge there")
    card = model_card.render(run, read_text(ctl, f"{job_dir}/config.yaml"))
    (run / "README.md").write_text(card)
    slurm.make_job_dir(ctl, inv, job_dir, MERGED)  # the folder exists; the merged one becomes the job user's
    put_bytes(ctl, jobs.MERGE_PROGRAM.read_bytes(), f"{job_dir}/{jobs.MERGE_PROGRAM.name}")
    put_text(ctl, card, f"{job_dir}/README.md")
    script = f"{job_dir}/merge-{uuid.uuid4().hex[:6]}.sbatch"
    spec = jobs.base_spec(inv, jobs.MERGE_NAME, 1, 1, job_dir, script_path=script, output_dir=out,
                          time_limit=TIME_LIMIT)
    put_text(ctl, jobs.render_merge(spec, adapters), script, 0o755)
    job_id = slurm.submit(ctl, script, user=slurm.job_user(inv))
    say(f"fab merge: run {run.name}: job {job_id} merges {adapters} into its base model on one node")
    job = slurm.wait_job(ctl, job_id, WAIT_S)
    log_path = f"{inv.scratch}/logs/{jobs.MERGE_NAME}-{job_id}.out"
    log = _job_log(ctl, inv, log_path)
    result = _result(log)
    if not job.ok or result is None:
        tail = shown("\n".join(log.splitlines()[-15:]), block=True)
        raise MergeError(f"merge job {job_id} {job.state} (exit {job.exit_code}); its log {log_path} ends:\n{tail}")
    slurm.let_admin_read(ctl, inv, out)  # safetensors saves with mode 0600
    result["where"] = out
    say(f"      merged model: {len(result['files'])} files, {result['bytes'] / 1e9:.2f} GB of bf16 safetensors, "
        f"tokenizer and model card in {out} on the cluster")
    say(f"      model card: {_local(run / 'README.md')}")
    if download:
        dest = run / MERGED
        # into runs/<run>/merged/, which holds no record of fab's: the model card (README.md) comes home too
        got = run_home.download(ctl, out, dest, say, owner=run_home.job_owner(inv), reserved=frozenset())
        result["home"] = str(dest)
        size = sum((dest / f).stat().st_size for f in got if (dest / f).is_file())
        say(f"      downloaded to {_local(dest)}/: {len(got)} files, {size / 1e9:.2f} GB")
    else:
        say(f"      not downloaded (--download brings it home to {_local(run / MERGED)}/)")
    (run / "merged.json").write_text(json.dumps({"job_id": job_id, **result}, indent=2) + "\n")
    return result


def _result(log: str) -> dict | None:
    """The merge program's MERGED record (its last line of the kind), checked for shape; else None."""
    lines = [ln for ln in log.splitlines() if ln.startswith("MERGED ")]
    try:
        data = json.loads(lines[-1][len("MERGED "):]) if lines else None
    except ValueError:
        return None
    ok = isinstance(data, dict) and isinstance(data.get("files"), dict) and isinstance(data.get("bytes"), int) \
        and all(isinstance(k, str) and isinstance(v, int) for k, v in data["files"].items())
    return data if ok else None


def _local(p: Path) -> str:
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


LOG_TAIL_BYTES = 64 * 1024  # of the merge job's log: its result line and an error's last lines


def _job_log(ctl, inv, path: str) -> str:
    """The end of the merge job's log, read as the jobs' user: the log folder is that user's, so a
    job may have put a link to a file only the admin can read (or to /dev/zero) at the log's name;
    read as the job's user, such a link shows no more than the job could read itself, and the read
    stops at LOG_TAIL_BYTES. Empty when there is no log."""
    res = slurm.as_job_user(ctl, slurm.job_user(inv), f"tail -c {LOG_TAIL_BYTES} -- {shlex.quote(path)}",
                            warn=True, hide=True)
    return res.stdout if res.ok else ""
