"""`fab logs` and `fab cancel`: finding our fine-tune jobs on a cluster, following one, cancelling one.

"Our latest job" is the newest job Slurm knows by the fine-tune's name; once Slurm has forgotten it
(finished jobs leave its memory after MinJobAge), the newest log of that name on /scratch.
"""

from __future__ import annotations

import re
import shlex

from ops.actions import slurm
from ops.finetune import job_end, run_home, stream
from ops.finetune import sbatch as jobs
from ops.finetune.trainstep import TrainError
from ops.say import Say, shown
from ops.ssh.remote import Cluster, exists

_LOG_NAME = re.compile(rf"^{re.escape(jobs.FINETUNE_NAME)}-(\d+)\.out$")


def log_path(cl: Cluster, job: str) -> str:
    return f"{cl.inventory.scratch}/logs/{jobs.FINETUNE_NAME}-{job}.out"


def job_ids_in_log_names(names: list[str]) -> list[int]:
    """The job ids of the fine-tune logs among file names (`slurm-gpu-finetune-<id>.out`)."""
    return [int(m.group(1)) for m in map(_LOG_NAME.match, names) if m]


def latest(cl: Cluster, running_only: bool = False) -> str:
    """Our newest fine-tune job (only a queued or running one with `running_only`)."""
    known = slurm.jobs_named(cl.controller, jobs.FINETUNE_NAME)
    if running_only:
        known = [j for j in known if not j.finished]
    if known:
        return known[-1].id
    if not running_only:
        logs = f"{cl.inventory.scratch}/logs"
        out = cl.controller.run(f"ls {shlex.quote(logs)} 2>/dev/null", hide=True, warn=True).stdout
        ids = job_ids_in_log_names(out.split())
        if ids:
            return str(max(ids))
    what = "running fine-tune job" if running_only else "fine-tune job"
    raise TrainError(f"no {what} of ours on this cluster; start one with `fab train`")


def follow(cl: Cluster, job: str | None, progress: bool = False, say: Say = print) -> None:
    """Stream job `job`'s log (default: our latest) from its start until it ends; when it completed,
    show the summary and download the run (as `fab train` does)."""
    job = job or latest(cl)
    path = log_path(cl, job)
    say(f"fab logs: job {job}, {path}")
    known = slurm.job(cl.controller, job)
    if known is None and not exists(cl.controller, path):
        raise TrainError(f"no job {job} on this cluster: Slurm does not know it and there is no "
                              f"log {path}; `fab status` lists the queue")
    if known is not None and not known.name.startswith(jobs.FINETUNE_NAME):
        raise TrainError(f"job {job} is {known.name!r}, not a fine-tune job of `fab train`; "
                              f"its output is {shown(known.stdout or 'unknown')}")
    try:
        followed = stream.follow(cl.controller, job, path, raw=not progress)
    except KeyboardInterrupt:
        say(job_end.reattach_hint(job, cl.inventory.target))
        raise
    except slurm.ControllerUnreachable as exc:
        raise job_end.controller_lost(exc, job, cl.inventory.target) from None
    # The job directory comes from the log (its SLURM_GPU_JOB line): only one of ours is downloaded.
    job_dir = followed.log.job_dir
    if job_dir and not job_dir.startswith(f"{cl.inventory.scratch}/slurm-gpu/jobs/"):
        say(f"fab logs: the log names {job_dir!r} as the job directory, not one under "
            f"{cl.inventory.scratch}/slurm-gpu/jobs/: nothing is downloaded from it")
        job_dir = followed.log.job_dir = None
    ok = job_end.outcome(cl, job, followed, job_dir, say)
    if ok and job_dir:
        run_home.finish(cl, job, followed, say, log_path=path)
    elif not ok:
        raise job_end.failure(job, followed, path)


def cancel(cl: Cluster, job: str | None, say: Say = print) -> None:
    """Cancel job `job` (default: our latest queued or running one)."""
    slurm.require_controller(cl, "cancel a job")
    job = job or latest(cl, running_only=True)
    was = slurm.cancel(cl.controller, job)
    say(f"fab cancel: cancelled job {job} ({was.name}, was {was.state})")
