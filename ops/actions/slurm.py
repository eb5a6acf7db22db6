"""Slurm on the controller: node states, returning nodes to service, jobs.

Every function takes the controller's `Connection` and runs the Slurm CLI there
(sinfo, scontrol, sbatch, squeue, scancel), so it works the same on AWS and locally.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass

from fabric import Connection

from cluster.errors import UserError
from cluster.facts import JOB_SCRATCH_DIRS
from cluster.hostpaths import BOOTSTRAP_PATH
from ops.say import shown
from ops.ssh.remote import Cluster, sudo

# Nodes drained with a reason that says "health" were drained by the GPU health check
# (HealthCheckProgram): they stay drained until someone fixes them.
HEALTH_REASON = re.compile(r"health", re.IGNORECASE)
_BAD_STATES = ("down", "drain", "fail")  # down, down*, drained, draining, fail, failing


class SlurmError(UserError, RuntimeError):
    pass


class ControllerUnreachable(SlurmError):
    """slurmctld did not answer (down, restarting, unreachable): the state of jobs is unknown."""


QUERY_TIMEOUT_S = 20
# job()'s exit status for "scontrol ping says slurmctld is not up" (scontrol itself exits 0 or 1).
PING_DOWN_EXIT = 3
# What `scontrol ping` says of a controller that answers: "Slurmctld(primary) at HOST is UP".
PING_UP = "is UP"

# A Slurm hostlist as SLURM_JOB_NODELIST prints it ("gpu-node-[01-03,05],ctl"): names of letters,
# digits, '.', '_', '-', each with optional numeric ranges in brackets; no space, quote or shell
# character. The hostlist syntax: https://slurm.schedmd.com/sinfo.html#OPT_nodes
_HOST = r"[A-Za-z0-9._-]*(?:\[[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*\][A-Za-z0-9._-]*)*"
HOSTLIST = re.compile(rf"(?=[A-Za-z0-9])(?:{_HOST})(?:,(?=[A-Za-z0-9])(?:{_HOST}))*")


# A job id as squeue's %i prints it: 123, an array task 123_4, or a pending array's 123_[5-9%2].
JOB_ID = re.compile(r"[0-9]+(?:_(?:[0-9]+|\[[0-9,%-]+\]))?")


def hostlist(text: object) -> str | None:
    """`text` when it is a Slurm hostlist (HOSTLIST), else None: data from a log never reaches a command."""
    return text if isinstance(text, str) and len(text) <= 4096 and HOSTLIST.fullmatch(text) else None


MAX_HOSTNAMES = 4096  # a hostlist expands to at most this many names (a cluster's nodes, with room)


def hostnames(text: str) -> list[str]:
    """A Slurm hostlist (HOSTLIST) as single names: 'gpu-node-[01-02],ctl' -> gpu-node-01, gpu-node-02, ctl
    (a range's zero padding kept, as Slurm does). SlurmError for text that is no hostlist or too many names."""
    if hostlist(text) is None:
        raise SlurmError(f"{text!r} is not a Slurm hostlist")
    names: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):  # commas outside brackets separate hosts
        expanded = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            if not piece.startswith("["):
                expanded = [e + piece for e in expanded]
                continue
            options = []
            for span in piece[1:-1].split(","):
                lo, _, hi = span.partition("-")
                hi = hi or lo
                if len(lo) > 9 or len(hi) > 9 or int(hi) - int(lo) >= MAX_HOSTNAMES:
                    raise SlurmError(f"{text!r}: more than {MAX_HOSTNAMES} hosts")
                options += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
            expanded = [e + o for e in expanded for o in options]
            if len(expanded) > MAX_HOSTNAMES:
                raise SlurmError(f"{text!r}: more than {MAX_HOSTNAMES} hosts")
        names += expanded
        if len(names) > MAX_HOSTNAMES:
            raise SlurmError(f"{text!r}: more than {MAX_HOSTNAMES} hosts")
    return names


def controller_up(ctl: Connection) -> bool:
    """`scontrol ping`: answers at once, also when slurmctld is down (other queries retry ~1 min)."""
    res = ctl.run("scontrol ping", hide=True, warn=True)
    return res.ok and PING_UP in res.stdout


def require_controller(cl: Cluster, doing: str) -> None:
    """slurmctld must answer before `doing`: a down controller is named with its fix, not misread."""
    if not controller_up(cl.controller):
        restart = cl.inventory.service_cmd.format(action="restart", service="slurmctld")
        raise ControllerUnreachable(
            f"slurmctld is DOWN on the controller (`scontrol ping`), so it cannot {doing}; jobs may still run "
            f"on the nodes. Restart it there (`{restart}`, log /var/log/slurm/slurmctld.log), then run this again")


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # sinfo's long state: idle, down*, drained, mixed, allocated, ...
    reason: str = ""

    @property
    def idle(self) -> bool:
        return self.state == "idle"

    @property
    def health_drained(self) -> bool:
        return "drain" in self.state and bool(HEALTH_REASON.search(self.reason))

    @property
    def needs_resume(self) -> bool:
        return any(s in self.state for s in _BAD_STATES) and not self.health_drained


def parse_sinfo(text: str) -> dict[str, NodeState]:
    """Parse `sinfo -h -N -o '%N|%T|%E'` (a node in several partitions is listed once)."""
    nodes: dict[str, NodeState] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, state, reason = (line.split("|", 2) + ["", ""])[:3]
        reason = "" if reason.strip() == "none" else reason.strip()
        nodes.setdefault(name.strip(), NodeState(name.strip(), state.strip(), reason))
    return nodes


def node_states(ctl: Connection) -> dict[str, NodeState]:
    return parse_sinfo(ctl.run("sinfo -h -N -o '%N|%T|%E'", hide=True).stdout)


def resume(ctl: Connection, nodes: list[str]) -> None:
    """Return nodes to service (state=resume), e.g. down after a slurmd restart."""
    if nodes:
        sudo(ctl, f"scontrol update nodename={shlex.quote(','.join(nodes))} state=resume", warn=True)


@dataclass(frozen=True)
class QueuedJob:
    id: str
    name: str
    user: str
    state: str
    time: str  # elapsed, as squeue prints it (M:SS, H:MM:SS, D-HH:MM:SS)
    nodes: str

    def describe(self) -> str:
        return f"job {self.id} ({self.user}'s job {self.name!r}, {self.state.lower()} {self.time})"


def jobs_on(ctl: Connection, names: list[str]) -> list[QueuedJob]:
    """Jobs that hold (or are about to hold) any of the nodes `names`."""
    res = ctl.run(f"squeue -h -t RUNNING,COMPLETING,CONFIGURING -w {shlex.quote(','.join(names))} "
                  "-o '%i|%j|%u|%T|%M|%N'", hide=True, warn=True)
    out = []
    for line in res.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6:
            out.append(QueuedJob(*(p.strip() for p in parts)))
    return out


def _busy_text(busy: list[QueuedJob]) -> str:
    ids = " ".join(j.id for j in busy)
    return (", ".join(shown(j.describe()) for j in busy) + " to free the nodes; cancel with "
            f"`fab cancel --job {busy[0].id}` (ours) or `sudo scancel {ids}` on the controller, or wait")


def wait_idle(ctl: Connection, names: list[str], timeout_s: float = 120, poll_s: float = 2.0,
              resume_down: bool = True, say=None) -> dict[str, NodeState]:
    """Wait until every node in `names` is idle; resume down/drained nodes on the way.

    A node drained by the health check is an error at once (resuming it would hide a
    broken GPU). While other jobs hold the nodes, `say` is told which ones (once per change).
    The timeout error names each node that is not idle with its state, and the jobs holding them.
    """
    deadline = time.monotonic() + timeout_s
    resumed: set[str] = set()
    told: tuple[str, ...] = ()
    while True:
        states = node_states(ctl)
        missing = [n for n in names if n not in states]
        if missing:
            raise SlurmError(f"Slurm does not know node(s) {', '.join(missing)}: "
                             "slurm.conf on the controller does not match the inventory")
        sick = [states[n] for n in names if states[n].health_drained]
        if sick:
            raise SlurmError("drained by the GPU health check: " + "; ".join(
                f"{s.name} ({shown(s.reason)})" for s in sick) + ". Fix the node, then "
                "`scontrol update nodename=NODE state=resume` on the controller.")
        if resume_down:
            todo = [n for n in names if states[n].needs_resume and n not in resumed]
            resume(ctl, todo)
            resumed.update(todo)
        if all(states[n].idle for n in names):
            return states
        held = [n for n in names if any(w in states[n].state for w in ("alloc", "mix", "complet"))]
        busy = jobs_on(ctl, held) if held else []
        if say and busy and tuple(j.id for j in busy) != told:
            told = tuple(j.id for j in busy)
            say(f"      waiting (up to {timeout_s:.0f} s) for " + _busy_text(busy))
        if time.monotonic() >= deadline:
            bad = [states[n] for n in names if not states[n].idle]
            raise SlurmError(f"nodes not idle after {timeout_s:.0f} s: " + "; ".join(
                f"{s.name} is {s.state}" + (f" ({shown(s.reason)})" if s.reason else "") for s in bad)
                + (f". Waited for {_busy_text(busy)}" if busy else ""))
        time.sleep(poll_s)


def job_user(inv) -> str:
    """Who the cluster's jobs run as (ClusterFacts.job_user); an inventory written before jobs had
    a user of their own: the SSH user, as then."""
    return inv.job_user or inv.ssh_user


def as_job_user(ctl: Connection, user: str, cmd: str, **kwargs):
    """Run the shell command `cmd` on the controller as the jobs' user (the owner of the jobs fab
    submits, who may hold, release and requeue them, and of their logs)."""
    return sudo(ctl, f"sh -c {shlex.quote(cmd)}", user=user, **kwargs)


def make_job_dir(ctl: Connection, inv, job_dir: str, *writable: str) -> None:
    """`job_dir`, for a job's code, config and script: the admin user's, so a job cannot change what
    it runs. In it the folders the job writes (`writable`, names), the job user's, as are the shared
    job logs (slurmstepd opens them as the job's user) and Hugging Face cache. One command, as root."""
    q, user = shlex.quote, job_user(inv)
    shared = [q(f"{inv.scratch}/{d}") for d in JOB_SCRATCH_DIRS]
    theirs = [q(f"{job_dir}/{name}") for name in writable] + shared
    # A shared folder that is another user's (a cluster from before jobs had their own user: its jobs
    # ran as the admin user) becomes the job user's with what is in it, once: judged by the folder's
    # own owner, which no job can change, never by what a job may have linked into it.
    cmd = (f"for d in {' '.join(shared)}; do if [ -d \"$d\" ] && [ \"$(stat -c %U \"$d\")\" != {q(user)} ]; "
           f"then chown -R {q(user)}:{q(user)} \"$d\"; fi; done && "
           f"install -d -o {q(ctl.user)} -m 0755 {q(job_dir)} && "
           f"install -d -o {q(user)} -g {q(user)} -m 0755 {' '.join(theirs)}")
    res = sudo(ctl, f"sh -c {q(cmd)}", warn=True)
    if not res.ok:
        raise SlurmError(f"cannot make {job_dir} for a job of {user}: "
                         f"{_with_hint((res.stderr or res.stdout).strip(), user)}")


def let_admin_read(ctl: Connection, inv, path: str) -> None:
    """Make what jobs wrote under `path` readable by the admin user fab reads it as: safetensors saves
    with mode 0600, and the jobs' user is not the admin. Done as the jobs' user, so only its own files
    change, never a file of another user a job may have linked in (chmod -R follows no link)."""
    as_job_user(ctl, job_user(inv), f"chmod -R a+rX {shlex.quote(path)}", warn=True, hide=True)


def _with_hint(why: str, user: str) -> str:
    """Slurm's or the tools' words, and the fix where the controller lacks the job user."""
    if re.search(r"unknown user|invalid (user|group)", why):
        why += (f" (this controller was made before jobs ran as {user}: replace it, or run its bootstrap's "
                f"jobuser and scratch steps, `sudo {BOOTSTRAP_PATH}`)")
    return why


def submit(ctl: Connection, script: str, *args: str, user: str) -> str:
    """sbatch a script already on the cluster as `user` (job_user: jobs never run as the admin
    user, who has sudo); return the job id."""
    cmd = " ".join(["sbatch", "--parsable", *map(shlex.quote, args), shlex.quote(script)])
    res = as_job_user(ctl, user, cmd, warn=True)
    if not res.ok:
        raise SlurmError(f"sbatch {script} as {user} failed: {_with_hint((res.stderr or res.stdout).strip(), user)}")
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch gave no job id: {res.stdout.strip()!r}")
    return job_id


def parse_scontrol_job(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` -> {"JobState": "RUNNING", ...} (values without spaces are enough).

    JobName is free text its job may set (`scontrol update jobid=N name=...`). scontrol prints it second,
    right before UserId (`JobId=%u JobName=%s`, then `UserId=%s(%u) GroupId=%s(%u) MCS_label=%s`: the format
    strings of Slurm's src/api/job_info.c, seen in this machine's libslurmfull.so), so its value is taken
    whole up to ` UserId=` and cannot add keys; the first of a repeated key counts. A second UserId means a
    name (or a later free-text field) imitates scontrol's fields: SlurmError, not a misread job.
    """
    head, named, tail = text.partition(" JobName=")
    name = None
    if named:
        name, _, rest = tail.partition(" UserId=")
        text = f"{head} UserId={rest}"
    fields: dict[str, str] = {}
    users = 0
    for token in text.split():
        key, sep, value = token.partition("=")
        users += key == "UserId"
        if sep and key and key not in fields:
            fields[key] = value
    if users > 1:
        raise SlurmError(f"scontrol's answer for job {fields.get('JobId', '?')} holds UserId= twice: its name or "
                         "comment imitates scontrol's fields; rename it (`scontrol update jobid=N name=NAME`)")
    if name is not None:
        fields["JobName"] = name
    return fields


@dataclass(frozen=True)
class Job:
    id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, REQUEUED, ...
    exit_code: str
    run_time: str
    restarts: int
    nodes: str
    reason: str
    stdout: str

    @property
    def finished(self) -> bool:
        return self.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"


def _count(f: dict[str, str], key: str) -> int:
    """An integer field of scontrol's answer: ASCII digits (int() would also take '٣', '1_0' and 5000 digits)."""
    value = f.get(key) or "0"
    if not re.fullmatch(r"[0-9]{1,10}", value):
        raise SlurmError(f"scontrol's answer for job {f.get('JobId', '?')!r} has {key}={value!r}, not a count: "
                         "check the controller's Slurm (`scontrol show job -o JOB`)")
    return int(value)


def job_from_fields(f: dict[str, str]) -> Job:
    _count(f, "JobId")
    return Job(id=f.get("JobId", ""), name=f.get("JobName", ""), state=f.get("JobState", "UNKNOWN"),
               exit_code=f.get("ExitCode", ""), run_time=f.get("RunTime", ""),
               restarts=_count(f, "Restarts"), nodes=f.get("NodeList", ""),
               reason=f.get("Reason", ""), stdout=f.get("StdOut", ""))


def job(ctl: Connection, job_id: str) -> Job | None:
    """The job as Slurm sees it; None when Slurm does not know it (never, or no longer: MinJobAge).

    Raises ControllerUnreachable when slurmctld does not answer: "unknown" is not "gone".
    """
    # scontrol retries for about a minute when slurmctld is down: `scontrol ping` (answers at once) first,
    # in the same ssh command, and a bound on the query for a controller that is up but does not answer.
    res = ctl.run(f"p=$(scontrol ping 2>&1); case \"$p\" in *'{PING_UP}'*) ;; *) printf '%s\\n' \"$p\"; "
                  f"exit {PING_DOWN_EXIT};; esac; "
                  f"timeout {QUERY_TIMEOUT_S} scontrol show job -o {shlex.quote(job_id)}", hide=True, warn=True)
    if res.exited == PING_DOWN_EXIT:
        # "Slurmctld(primary) at HOST is DOWN", then a box of asterisks
        said = next((line.strip() for line in res.stdout.splitlines() if "Slurmctld" in line), f"exit {res.exited}")
        raise ControllerUnreachable(f"slurmctld does not answer (`scontrol ping`: {said})")
    if res.ok and "JobId=" in res.stdout:
        return job_from_fields(parse_scontrol_job(res.stdout.splitlines()[0]))
    err = (res.stderr or res.stdout).strip() or (f"no answer within {QUERY_TIMEOUT_S} s"
                                                   if res.exited == 124 else "")
    if res.ok or "invalid job id" in err.lower():
        return None
    raise ControllerUnreachable(f"slurmctld does not answer (`scontrol show job {job_id}`: "
                                f"{err.splitlines()[-1] if err else f'exit {res.exited}'})")


def jobs_named(ctl: Connection, prefix: str) -> list[Job]:
    """Jobs Slurm still remembers whose name starts with `prefix`, oldest first."""
    res = ctl.run("scontrol show job -o", hide=True, warn=True)
    out = []
    for line in res.stdout.splitlines():
        if "JobId=" in line:
            try:
                out.append(job_from_fields(parse_scontrol_job(line)))
            except SlurmError:  # a job imitating scontrol's fields is not taken for one of ours
                continue
    return sorted((j for j in out if j.name.startswith(prefix)), key=lambda j: int(j.id))


def wait_job(ctl: Connection, job_id: str, timeout_s: float, poll_s: float = 1.0) -> Job:
    deadline = time.monotonic() + timeout_s
    while True:
        j = job(ctl, job_id)
        if j is None:
            raise SlurmError(f"job {job_id} vanished from Slurm before it finished")
        if j.finished:
            return j
        if time.monotonic() >= deadline:
            raise SlurmError(f"job {job_id} still {j.state} after {timeout_s:.0f} s "
                             f"(reason: {shown(j.reason)}); cancel it with `fab cancel --job {job_id}`")
        time.sleep(poll_s)


def cancel(ctl: Connection, job_id: str) -> Job:
    """scancel a job Slurm knows and has not finished; return its state before."""
    j = job(ctl, job_id)
    if j is None:
        raise SlurmError(f"no job {job_id} on this cluster (Slurm does not know it, or has forgotten it "
                         "after it ended); `fab status` lists the queue")
    if j.finished:
        raise SlurmError(f"job {job_id} already ended ({j.state}, exit {j.exit_code}): nothing to cancel")
    res = sudo(ctl, f"scancel {shlex.quote(job_id)}", warn=True)  # root: the job is the job user's
    if not res.ok:
        raise SlurmError(f"scancel {job_id} failed: {(res.stderr or res.stdout).strip()}")
    return j
