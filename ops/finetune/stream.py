"""Following a job on the controller: its log (over SFTP, by byte offset) and its Slurm state.

The log is read from where the last read stopped, so nothing is printed twice and a
reattach (`fab logs --job JOB`) starts from the top. Slurm state changes (pending, requeued)
are reported as they happen; the loop ends when Slurm says the job has finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fabric import Connection

from ops.actions import slurm
from ops.finetune import spot_notice
from ops.finetune.joblog import Event, JobLog
from ops.say import shown


@dataclass
class Followed:
    job: slurm.Job | None  # the last state Slurm reported (None: no longer known to Slurm)
    log: JobLog


def read_from(sftp, path: str, offset: int) -> tuple[bytes, int]:
    """Bytes of `path` after `offset` (nothing when the file does not exist yet)."""
    try:
        with sftp.open(path, "rb") as f:
            size = f.stat().st_size
            if size < offset:  # truncated (a requeue without append): read it again
                offset = 0
            f.seek(offset)
            data = f.read(size - offset) if size > offset else b""
    except FileNotFoundError:
        return b"", offset
    except OSError as exc:
        if getattr(exc, "errno", None) == 2:
            return b"", offset
        raise
    return data, offset + len(data)


def _report(log: JobLog, data: bytes, say: Callable[[str], None], raw: bool, final: bool = False,
            explain: Callable[[Event], str] | None = None) -> None:
    """Feed new log bytes to the parser and say them (raw, or as compact progress lines); `explain`
    gives the line of a spot event (it asks Slurm which node was drained). What the job wrote is
    `shown`: its control characters reach the terminal escaped, never as escape sequences."""
    if not data:
        return
    text = data.decode("utf-8", errors="replace")
    events = log.feed(text + "\n" if final else text)  # the last read may end mid-line
    if raw:
        say(shown(text.rstrip("\n"), block=True))
        return
    for ev in events:
        if ev.kind == "spot" and explain is not None:
            say(shown(explain(ev)))
        elif line := log.describe(ev):
            say(shown(line))


# How long to keep following while slurmctld does not answer (a restart, an upgrade): the job
# may well be running meanwhile, and its log keeps growing on /scratch.
CONTROLLER_WAIT_S = 20 * 60


def follow(ctl: Connection, job_id: str, log_path: str, say: Callable[[str], None] = print,
           raw: bool = False, poll_s: float = 1.0, log: JobLog | None = None,
           controller_wait_s: float = CONTROLLER_WAIT_S) -> Followed:
    """Stream `log_path` until job `job_id` has finished; report progress through `say`.

    While slurmctld does not answer, keep following the log and say so; after
    `controller_wait_s` without an answer raise slurm.ControllerUnreachable.
    """
    log = log or JobLog()
    sftp = ctl.sftp()
    offset, last_state, last_restarts = 0, None, 0
    lost_since: float | None = None
    last_error = ""

    def explain(ev: Event) -> str:
        return spot_notice.describe(ctl, log, ev)

    while True:
        try:
            if lost_since is not None and not slurm.controller_up(ctl):  # a quick probe while it is down
                raise slurm.ControllerUnreachable(last_error)
            job = slurm.job(ctl, job_id)
        except slurm.ControllerUnreachable as exc:
            last_error = str(exc)
            now = time.monotonic()
            if lost_since is None:
                lost_since = now
                say(f"{exc}; job {job_id} may still be running: following its log and waiting for the "
                    f"controller to answer again (up to {controller_wait_s / 60:.0f} min)")
            elif now - lost_since >= controller_wait_s:
                raise slurm.ControllerUnreachable(
                    f"{exc} for {now - lost_since:.0f} s; gave up waiting for job {job_id}, whose state "
                    "is unknown (it may still be running)") from None
            data, offset = read_from(sftp, log_path, offset)
            _report(log, data, say, raw)
            time.sleep(poll_s)
            continue
        if lost_since is not None:
            say(f"slurmctld answers again after {time.monotonic() - lost_since:.0f} s; "
                f"job {job_id} is {job.state if job else 'no longer known to Slurm'}")
            lost_since = None
        data, offset = read_from(sftp, log_path, offset)
        _report(log, data, say, raw, explain=explain)
        if job is not None:
            if job.restarts > last_restarts:
                say(f"job {job_id} was requeued by Slurm (restart {job.restarts}): {shown(job.reason)}; "
                    "it resumes from its last checkpoint when nodes are back")
                last_restarts = job.restarts
            if job.state != last_state and job.state not in ("RUNNING", "COMPLETING") and not job.finished:
                why = f" ({shown(job.reason)})" if job.reason and job.reason != "None" else ""
                say(f"job {job_id} is {job.state}{why}")
            last_state = job.state
        if job is None or job.finished:
            # One last read: the final lines land after the state change.
            data, offset = read_from(sftp, log_path, offset)
            _report(log, data, say, raw, final=True)
            return Followed(job, log)
        time.sleep(poll_s)
