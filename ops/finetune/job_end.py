"""How a followed fine-tune job ended (`fab train`, `fab logs`): a success, a run whose training completed
though Slurm says otherwise, or a failure with its log's error lines; how to reattach to one left running."""

from __future__ import annotations

from fabric import Connection

from cluster import targets
from ops.actions import slurm, stack_down
from ops.finetune import stream
from ops.finetune.trainstep import TrainError
from ops.say import Say, shown
from ops.ssh.remote import Cluster, exists


def reattach_hint(job_id: str, target: str) -> str:
    flag = targets.get(target).flag()
    return (f"\nStopped following job {job_id}; it keeps running on the cluster.\n"
            f"Reattach with `fab logs{flag} --job {job_id}`, or stop it with `fab cancel{flag} --job {job_id}`.")



def succeeded(followed: stream.Followed) -> bool:
    """COMPLETED in Slurm, or (when Slurm has already forgotten the job) final metrics in the log."""
    if followed.job is not None:
        return followed.job.ok
    return followed.log.metrics is not None


COMPLETED_MARKER = stack_down.COMPLETED_MARKER  # training.train.COMPLETED_MARKER, written after the adapters


def training_completed(ctl: Connection, job_dir: str | None) -> bool:
    """Whether the run's output holds the completion marker (training finished, adapters written)."""
    return bool(job_dir) and exists(ctl, f"{job_dir}/output/{COMPLETED_MARKER}")


def outcome(cl: Cluster, job_id: str, followed: stream.Followed, job_dir: str | None, say: Say) -> bool:
    """True when the run is a success: Slurm says COMPLETED, or training wrote its completion
    marker before the job ended otherwise (a node lost at the very end): a finished run is kept."""
    if succeeded(followed):
        return True
    if training_completed(cl.controller, job_dir):
        job = followed.job
        state = f"{job.state} ({shown(job.reason)})" if job else "gone from Slurm"
        say(f"job {job_id} ended {state}, but its training had completed ({job_dir}/output/"
            f"{COMPLETED_MARKER} is there): the finished run is downloaded")
        return True
    return False


def failure(job_id: str, followed: stream.Followed, log_path: str) -> TrainError:
    job = followed.job
    state = f"{job.state} (exit {job.exit_code}, {shown(job.reason)})" if job else "gone from Slurm"
    errors = followed.log.errors
    cause = ("; the job log's error lines:\n" + "\n".join(f"  {shown(line)}" for line in errors)) if errors \
        else "; the job log has no error line (see its last lines)"
    tail = "\n".join(f"  {shown(line)}" for line in list(followed.log.tail)[-15:])
    return TrainError(f"job {job_id} {state}{cause}\nlast lines of {log_path}:\n{tail}")


def controller_lost(exc: slurm.ControllerUnreachable, job_id: str, target: str) -> TrainError:
    """Giving up on a job whose state slurmctld cannot tell: say how to reattach later."""
    return TrainError(f"{exc}.\nCheck slurmctld on the controller (`fab status`); once it answers, "
                      + reattach_hint(job_id, target).strip().split("\n", 1)[1])

