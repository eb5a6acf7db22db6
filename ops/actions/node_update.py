"""Bootstrap changes to running GPU nodes: which are behind (`fab status`), and `fab update-nodes`.

`pulumi up` never stops or replaces a running node for a code change (infra/nodes.py ignores
user-data), and cloud-init runs user-data once per instance. So each node records the version of
the bootstrap it last ran to the end (node_layout.VERSION_PATH, user_data.bootstrap_version); a node whose
record differs from what this checkout renders for it is behind. Nodes added by raising
gpuNodeCount boot the current version; a node replaced by `pulumi up` (new image, key pair or EBS
key) boots the user-data recorded in the stack's state, as ignoreChanges keeps old inputs even on
replacement, so it is behind until updated. `update` brings those up to date one at a time, idle
ones only: exclude it from power saving, drain it, make sure no job holds it, install the newly
rendered files, run the bootstrap steps that changed (bootstrap/steps.py; the script then records
the new version), resume it unless something else (the health check that slurmd runs at start)
drained it meanwhile. A node with a job, or stopped by power saving, is skipped and named; one
still drained by an interrupted update is taken up again.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field

from fabric import Connection
from invoke.exceptions import UnexpectedExit
from paramiko.ssh_exception import SSHException

from bootstrap import node_layout, steps, user_data
from cluster import hostpaths, targets
from cluster.errors import UserError
from cluster.facts import ClusterFacts
from ops.actions import slurm
from ops.actions.reconfigure import facts_of, install_text, read_text
from ops.say import Say, shown
from ops.ssh.remote import Cluster, each, sudo

REASON = "slurm-gpu bootstrap update"
# A node just drained may still be finishing a job's epilogue (COMPLETING): wait this long.
COMPLETING_WAIT_S = 60
# Prints the recorded version, "none" (a bootstrap older than version records), or "booting"
# (no marker: the first boot has not finished; the boot checks report that).
_READ = (f"if [ -e {node_layout.MARKER_PATH} ]; then cat {node_layout.VERSION_PATH} 2>/dev/null || echo none; "
         "else echo booting; fi")


class UpdateError(UserError, RuntimeError):
    """An update step failed on a node; the node stays drained (the message says how to resume it)."""


@dataclass(frozen=True)
class NodeVersion:
    name: str
    recorded: str  # the version, "none" or "booting" (see _READ)
    current: str  # what this checkout renders for the node

    @property
    def behind(self) -> bool:
        return self.recorded not in ("booting", self.current)

    def describe(self) -> str:
        ran = "a bootstrap older than version records" if self.recorded == "none" else f"bootstrap {self.recorded}"
        return f"{self.name} ran {ran}; this checkout renders {self.current} for it"


@dataclass
class Result:
    updated: dict[str, list[str]] = field(default_factory=dict)  # node -> the steps it ran
    skipped: dict[str, str] = field(default_factory=dict)  # node -> why
    drained: dict[str, str] = field(default_factory=dict)  # updated, but left drained: node -> why
    current: list[str] = field(default_factory=list)


def current_version(facts: ClusterFacts, name: str) -> str:
    return user_data.bootstrap_version(facts, "gpu", name)


def _read(_name: str, c: Connection) -> str | None:
    try:
        res = c.run(_READ, hide=True, warn=True, in_stream=False)
    except (OSError, SSHException):  # unreachable: `fab status` reports it
        return None
    return res.stdout.strip() if res.ok else None


def versions(facts: ClusterFacts, conns: dict[str, Connection]) -> dict[str, NodeVersion]:
    """The GPU nodes behind `conns` that answer -> their recorded and current versions."""
    found = each("bootstrap version", conns, _read)
    return {n: NodeVersion(n, out or "none", current_version(facts, n))
            for n, out in sorted(found.items()) if out is not None}


def behind_notes(cl: Cluster, names: list[str]) -> list[str]:
    """`fab status`'s note for each of these GPU nodes that is behind."""
    facts = facts_of(cl.inventory)
    nodes = {n: cl.nodes[n] for n in names if n in cl.nodes}
    late = [v for v in versions(facts, nodes).values() if v.behind]
    return [f"note: {v.describe()}: behind; `fab update-nodes` brings idle nodes up to date" for v in late]


def behind_warning(cl: Cluster) -> str | None:
    """`fab train`'s one line naming the GPU nodes that are behind (None: none)."""
    facts = facts_of(cl.inventory)
    late = [v.name for v in versions(facts, cl.nodes).values() if v.behind]
    if not late:
        return None
    return (f"warning: {', '.join(late)} ran an older bootstrap than this checkout renders (`fab status`); "
            "`fab update-nodes` brings idle nodes up to date")


def _resume_cmd(name: str) -> str:
    return f"`scontrol update nodename={name} state=resume` on the controller"


def _ours(state: slurm.NodeState | None) -> bool:
    """Drained by update-nodes itself: an update that was interrupted (taken up again)."""
    return state is not None and "drain" in state.state and state.reason == REASON


def _resume(ctl: Connection, name: str) -> str | None:
    """Resume the node; None, or why it failed."""
    res = sudo(ctl, f"scontrol update nodename={shlex.quote(name)} state=resume", warn=True)
    return None if res.ok else ((res.stderr or res.stdout).strip() or f"exit {res.exited}")


def _exclude(ctl: Connection, name: str, say: Say) -> bool:
    """Keep power saving off the node while it is updated: drained and idle, it would be stopped once
    idle for SuspendTime (a drain does not reset last_busy; slurmctld power_save.c). `scontrol update
    SuspendExcNodes+=` exists from Slurm 23.02 (NEWS; scontrol(1) of 23.11 and 24.11); 22.05 has no
    run-time way, so the node may be stopped mid-update there: then it stays drained and is named."""
    res = sudo(ctl, f"scontrol update SuspendExcNodes+={shlex.quote(name)}", warn=True)
    if res.ok:
        return True
    said = (res.stderr or res.stdout).strip().splitlines()
    say(f"update-nodes: note: this Slurm cannot keep power saving off {name} during its update "
        f"(`scontrol update SuspendExcNodes` needs Slurm 23.02 or later: {said[0] if said else res.exited}); "
        "an update that outlasts the idle-stop time can be cut short")
    return False


def _include(ctl: Connection, name: str, say: Say) -> None:
    res = sudo(ctl, f"scontrol update SuspendExcNodes-={shlex.quote(name)}", warn=True)
    if not res.ok:
        say(f"update-nodes: note: {name} is still excluded from power saving: "
            f"`scontrol update SuspendExcNodes-={name}` on the controller returns it")


def _skip_reason(ctl: Connection, name: str, state: slurm.NodeState | None) -> str | None:
    """Why this node cannot be updated now (None: it is idle and in service)."""
    if state is None:
        return "Slurm does not know it (`fab reconfigure` adds it)"
    if state.idle:
        return None
    busy = slurm.jobs_on(ctl, [name])
    if busy:
        jobs = ", ".join(j.describe() for j in busy)
        return f"runs {jobs}: never updated under a job; run this again when it is idle"
    if "~" in state.state or "#" in state.state or "%" in state.state:
        return (f"is {state.state} (power saving): run this again while it is up and idle "
                "(it stays up for the idle-stop time after a job)")
    why = f" ({shown(state.reason)})" if state.reason else ""
    return f"is {state.state}{why}: bring it back into service first"


def _drain(ctl: Connection, name: str) -> str | None:
    """Drain the node and wait out a completing job; a job that started meanwhile undoes the drain
    and is returned as the reason to skip."""
    sudo(ctl, f"scontrol update nodename={shlex.quote(name)} state=drain reason={shlex.quote(REASON)}")
    deadline = time.monotonic() + COMPLETING_WAIT_S
    while True:
        jobs = slurm.jobs_on(ctl, [name])
        running = [j for j in jobs if j.state != "COMPLETING"]
        if running:
            why = f"{', '.join(j.describe() for j in running)} started on it as it was drained: skipped"
        elif not jobs:
            return None
        elif time.monotonic() > deadline:
            why = f"job {', '.join(j.id for j in jobs)} still completing after {COMPLETING_WAIT_S} s: skipped"
        else:
            time.sleep(1)
            continue
        failed = _resume(ctl, name)
        return f"{why}, resumed" if failed is None else \
            f"{why}; resuming it failed ({failed}): it stays drained ({_resume_cmd(name)})"


def _apply(node: Connection, facts: ClusterFacts, name: str, target: targets.Target) -> list[str]:
    """Install the node's changed files and run the steps they touch; the steps run."""
    files = user_data.bootstrap_files(facts, "gpu", name)
    allowed = target.update_paths
    if allowed is not None:
        files = {p: t for p, t in files.items() if p in allowed}
    old_script = read_text(node, hostpaths.BOOTSTRAP_PATH)
    changed = {p for p, text in files.items() if read_text(node, p) != text}
    todo = steps.changed_steps(old_script, files[hostpaths.BOOTSTRAP_PATH], changed, node_layout.STEPS["gpu"])
    todo = [s for s in todo if s not in target.skip_steps.get("gpu", ())]
    for path in sorted(changed):
        install_text(node, files[path], path, node_layout.FILE_MODES.get(path, 0o644))
    skip = " ".join(s for s in node_layout.STEPS["gpu"] if s not in todo)
    res = sudo(node, f"env SLURM_GPU_SKIP_STEPS={shlex.quote(skip)} {hostpaths.BOOTSTRAP_PATH}", warn=True)
    if not res.ok:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise UpdateError(
            f"{name}: the bootstrap failed ({' / '.join(tail)}); its step logs are under {node_layout.STEPS_DIR}. "
            f"The node stays drained: fix it, run `fab update-nodes` again, or return it as it is with "
            f"{_resume_cmd(name)}")
    return todo


def _update_one(cl: Cluster, facts: ClusterFacts, name: str, target: targets.Target) -> list[str]:
    """_apply, then check the node answers with the new version; UpdateError (node drained) if not."""
    try:
        ran = _apply(cl.nodes[name], facts, name, target)
    except (OSError, SSHException, UnexpectedExit) as exc:
        raise UpdateError(f"{name}: the update broke off ({_first_line(exc)}); the node stays drained: check it "
                          f"(`fab status`), run `fab update-nodes` again, or return it with {_resume_cmd(name)}") \
            from None
    now = versions(facts, {name: cl.nodes[name]}).get(name)
    if now is None:
        raise UpdateError(f"{name}: no longer answers over SSH after its update (stopped by power saving? "
                          f"`fab status`); it stays drained: run `fab update-nodes` again once it is up, or "
                          f"return it with {_resume_cmd(name)}")
    if now.behind:
        raise UpdateError(f"{name}: the bootstrap ran but recorded {now.recorded}, not {now.current}; the node "
                          f"stays drained ({_resume_cmd(name)} returns it)")
    return ran


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def _return(ctl: Connection, name: str) -> str | None:
    """Resume the updated node if it is still drained by us; else (the health check, run by slurmd at
    start -- Slurm 23.11 slurmd.c `if (original) run_script_health_check();` -- drained it with its own
    reason) leave it drained. None: resumed; else why it is still drained."""
    state = slurm.node_states(ctl).get(name)
    if state is not None and "drain" in state.state and state.reason != REASON:
        why = shown(state.reason or state.state)
        return f"drained meanwhile ({why}), left drained: fix it, then {_resume_cmd(name)}"
    failed = _resume(ctl, name)
    return None if failed is None else f"resuming it failed ({failed}): {_resume_cmd(name)}"


def update(cl: Cluster, say: Say = print) -> Result:
    """Bring every GPU node that is behind up to date, one idle node at a time."""
    inv, ctl = cl.inventory, cl.controller
    facts = facts_of(inv)
    target = targets.of(inv)
    slurm.require_controller(cl, "drain nodes for an update")
    result = Result()
    states = slurm.node_states(ctl)
    stopped = {n for n, s in states.items() if "~" in s.state}
    up = {n: c for n, c in cl.nodes.items() if n not in stopped}
    found = versions(facts, up)
    for name in sorted(cl.nodes):
        v = found.get(name)
        if name in stopped:
            why = _skip_reason(ctl, name, states[name])
        elif v is None:
            why = "unreachable over SSH (`fab status`)"
        elif v.recorded == "booting":
            why = "its first boot has not finished (`fab status`)"
        elif not v.behind and not _ours(states.get(name)):
            result.current.append(name)
            continue
        else:  # the state again: a job may have started while earlier nodes were updated
            state = slurm.node_states(ctl).get(name)
            why = None if _ours(state) else _skip_reason(ctl, name, state)
        if why:
            result.skipped[name] = why
            say(f"update-nodes: {name} skipped: {why}")
            continue
        excluded = _exclude(ctl, name, say)
        try:
            why = _drain(ctl, name)
            if why:
                result.skipped[name] = why
                say(f"update-nodes: {name} skipped: {why}")
                continue
            say(f"update-nodes: {v.describe()}: drained, updating" if v.behind else
                f"update-nodes: {name} is still drained by an interrupted update: updating, then resuming it")
            ran = _update_one(cl, facts, name, target)
            result.updated[name] = ran
            done = f"update-nodes: {name} up to date (ran {' '.join(ran) or 'no step: only its record'})"
            left = _return(ctl, name)
            if left:
                result.drained[name] = left
                say(f"{done}, but {left}")
            else:
                say(f"{done}, resumed")
        finally:
            if excluded:
                _include(ctl, name, say)
    left = ", ".join(result.skipped) or "none"
    drained = f"; left drained: {', '.join(result.drained)}" if result.drained else ""
    say(f"update-nodes: {len(result.updated)} updated, {len(result.current)} already current, "
        f"skipped: {left}{drained}")
    return result
