"""`fab down` and `fab train --down`: destroy the stack once nothing on it is left to lose.

The stack is settled once, before anything is read: --stack, else the selected one (`pulumi stack
--show-name`); the inventory (`pulumi stack output --stack=NAME`), the checks and the destroy all name that
stack, and `pulumi stack export --stack=NAME` must hold the inventory whose controller was checked (a
`pulumi stack select` elsewhere meanwhile changes nothing). The way down refuses, naming why, while
- the cluster is not a Pulumi stack (options.check_down: the local cluster has `fab local.down`);
- a job is queued or running (squeue on the controller), or squeue answers a line fab cannot read;
- a finished run (its output/COMPLETED marker, written after the adapters) is not home: no runs/<job>/
  folder of this machine names its job directory, its adapter_config.json or adapter_model.* is missing on
  either side, a sha256 differs or cannot be computed, or its directory name is not one fab makes;
- an unfinished run (no COMPLETED: failed, cancelled, out of restarts) keeps a checkpoint-N on /scratch that
  the destroy would lose, unless the user passed --drop-unfinished.
Then it runs the Pulumi CLI: `pulumi destroy --yes --skip-preview --non-interactive --stack=NAME`
(https://www.pulumi.com/docs/iac/cli/commands/pulumi_destroy/: --yes skips the confirmation,
--skip-preview the preview, --non-interactive the prompts), its output streamed, after `pulumi stack export`
read the stack's resources so it can say what it removed. `pulumi destroy` runs none of the program's code
(it deletes what the state records), so these checks live here and not in the program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
import subprocess
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from fabric import Connection

from cluster.errors import UserError
from cluster.inventory import Inventory, InventoryError
from ops.actions import slurm
from ops.actions.options import ClusterOptions
from ops.cost import estimate as est
from ops.cost import still_bills
from ops.finetune import sbatch as jobs
from ops.say import Say
from ops.ssh import remote
from ops.ssh.remote import Cluster
from training.protocol import COMPLETED as COMPLETED_MARKER  # written after the adapters

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # a job directory's name as new_job_dir makes it
_HASH = re.compile(r"^(?P<sha>[0-9a-f]{64})  (?P<file>adapter_[\w.-]+)$")
_UNREADABLE = re.compile(r"^unreadable (?P<file>adapter_[\w.-]+)$")
_LOG_ID = re.compile(rf"/{jobs.FINETUNE_NAME}-(\d+)\.out$")
# squeue's %i: a job id, an array task (123_4, 123_[5-9]) or a heterogeneous component (123+0); %T: a state.
_JOB_ID = re.compile(r"^[0-9]+(?:[_+][0-9A-Za-z\[\]\-,%]+)?$")
_JOB_STATE = re.compile(r"^[A-Z_]+$")
SQUEUE_FORMAT = "%i|%T|%j"  # the name last: it may hold the separator (split at most twice)
# What a finished run must have brought home (training/train.py saves the PEFT adapters).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MODEL_PREFIX = "adapter_model."
DROP_FLAG = "--drop-unfinished"


class DownRefused(UserError, RuntimeError):
    pass


def _lead(how: str) -> str:
    """`how` names the flag that asked (--down); `fab down` gets its task name from cluster_task already."""
    return f"{how}: " if how else ""


def _stack_flag(stack: str | None) -> str:
    """--stack=NAME for the commands a message suggests (the `=` form: a name is never taken for a flag)."""
    return f" --stack={shlex.quote(stack)}" if stack else ""


def jobs_in_flight(ctl: Connection, done_job: str | None = None) -> list[str]:
    """'JOB (NAME, STATE)' of every job Slurm still holds (queued, running, completing). `done_job`: the job
    `fab train --down` has just brought home, left out while it is only COMPLETING (its epilog). A line that
    does not parse refuses: a job fab cannot read may be running."""
    res = ctl.run(f"squeue -h -o {shlex.quote(SQUEUE_FORMAT)}", hide=True, warn=True, in_stream=False)
    if not res.ok:
        raise DownRefused(f"squeue failed on the controller ({(res.stderr or res.stdout).strip()}): cannot tell "
                          "whether a job runs, so the stack stays up; `fab status` shows why")
    out = []
    for line in res.stdout.splitlines():
        if not line.strip():
            continue
        parts = line.strip().split("|", 2)
        if len(parts) != 3 or not _JOB_ID.match(parts[0]) or not _JOB_STATE.match(parts[1]):
            raise DownRefused(f"squeue answered a line fab cannot read ({line.strip()[:120]!r}): cannot tell "
                              "whether a job runs, so the stack stays up; `fab status` shows the queue")
        job, state, name = parts
        if not (job == done_job and state == "COMPLETING"):
            out.append(f"{job} ({name}, {state})")
    return out


def refuse_busy(ctl: Connection, how: str, stack_flag: str = "", done_job: str | None = None) -> None:
    busy = jobs_in_flight(ctl, done_job)
    if busy:
        raise DownRefused(f"{_lead(how)}a run is in flight: job(s) {', '.join(busy)} on the cluster; let them "
                          f"finish and come home (`fab logs{stack_flag} --job N`) or cancel them "
                          f"(`fab cancel{stack_flag} --job N`) first")


@dataclass
class RemoteRun:
    name: str  # the job directory's name under <scratch>/slurm-gpu/jobs
    job_id: str | None  # from its log's file name, when the log is still there
    finished: bool  # output/COMPLETED is there
    adapters: dict[str, str] = field(default_factory=dict)  # adapter file -> sha256
    unreadable: list[str] = field(default_factory=list)  # adapter files sha256sum could not read
    checkpoint: int | None = None  # an unfinished run's newest checkpoint-N

    def label(self) -> str:
        return f"job {self.job_id} ({self.name})" if self.job_id else self.name


def _listing_script(scratch: str) -> str:
    """The controller's side: one `run NAME` or `unfinished NAME` line per job directory, then its `log PATH`,
    and a finished run's adapters' sha256 (`unreadable FILE` when sha256sum fails) or an unfinished one's
    newest `checkpoint N`. The job's log names its directory in its first line (jobs/finetune.sbatch.j2:
    SLURM_GPU_JOB {"job_dir": ...})."""
    q = shlex.quote
    root, logs = f"{scratch}/slurm-gpu/jobs", f"{scratch}/logs"
    return (f"root={q(root)}; cd \"$root\" 2>/dev/null || exit 0; for d in *; do "
            '[ -d "$d" ] || continue; '
            'log=$(grep -l -F "\\"job_dir\\": \\"$root/$d\\"" '
            f'{q(logs)}/{jobs.FINETUNE_NAME}-*.out 2>/dev/null | head -n 1); '
            f'if [ -e "$d/output/{COMPLETED_MARKER}" ]; then printf "run %s\\nlog %s\\n" "$d" "$log"; '
            'for a in "$d"/output/adapter_*; do [ -f "$a" ] || continue; a=${a##*/}; '
            '(cd "$d/output" && sha256sum -- "$a") || printf "unreadable %s\\n" "$a"; done; '
            'else printf "unfinished %s\\nlog %s\\n" "$d" "$log"; '
            'n=$(for c in "$d"/output/checkpoint-*; do [ -d "$c" ] && echo "${c##*-}"; done | '
            "grep -E '^[0-9]+$' | sort -n | tail -n 1); "
            '[ -z "$n" ] || printf "checkpoint %s\\n" "$n"; fi; done')


def _unreadable_line(line: str) -> DownRefused:
    return DownRefused(f"the controller's list of runs has a line fab cannot read ({line[:120]!r}): a job "
                       "directory fab did not make, or one with an odd name; the stack stays up (move it out "
                       "of <scratch>/slurm-gpu/jobs, or `fab ssh controller` to see it)")


def remote_runs(ctl: Connection, scratch: str) -> list[RemoteRun]:
    """Every job directory on the controller: finished (output/COMPLETED) with its adapters' sha256, or
    unfinished with its newest checkpoint. Names the controller gives back are checked against a strict
    pattern and never used as a path here; any line that does not parse refuses."""
    res = ctl.run(f"bash -c {shlex.quote(_listing_script(scratch))}", hide=True, warn=True, in_stream=False)
    if not res.ok:
        raise DownRefused(f"listing the runs on the controller failed ({(res.stderr or '').strip()}): "
                          "the stack stays up")
    runs: list[RemoteRun] = []
    for line in res.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("run", "unfinished"):
            if not _NAME.match(rest):
                raise _unreadable_line(line)
            runs.append(RemoteRun(rest, None, finished=kind == "run"))
        elif not runs:
            raise _unreadable_line(line)
        elif kind == "log":
            m = _LOG_ID.search(rest)
            runs[-1].job_id = m[1] if m else None
        elif kind == "checkpoint" and rest.isdigit() and not runs[-1].finished:
            runs[-1].checkpoint = int(rest)
        elif runs[-1].finished and (m := _HASH.match(line)):
            runs[-1].adapters[m["file"]] = m["sha"]
        elif runs[-1].finished and (m := _UNREADABLE.match(line)):
            runs[-1].unreadable.append(m["file"])
        else:
            raise _unreadable_line(line)
    return runs


def finished_runs(ctl: Connection, scratch: str) -> list[RemoteRun]:
    """The controller's finished runs (remote_runs with output/COMPLETED)."""
    return [r for r in remote_runs(ctl, scratch) if r.finished]


def local_runs(runs_dir: Path) -> dict[str, Path]:
    """job directory name -> runs/<job>/ that brought it home (its `job_dir` marker: ops/finetune/runs.py run_dir)."""
    out = {}
    for marker in sorted(runs_dir.glob("*/job_dir")):
        name = marker.read_text().strip().rsplit("/", 1)[-1]
        if name:
            out[name] = marker.parent
    return out


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def _missing_adapters(files) -> list[str]:
    """Which of the adapters a finished run must have (the PEFT config and weights) are not in `files`."""
    files = list(files)
    missing = [] if ADAPTER_CONFIG in files else [ADAPTER_CONFIG]
    if not any(f.startswith(ADAPTER_MODEL_PREFIX) for f in files):
        missing.append(f"{ADAPTER_MODEL_PREFIX}*")
    return missing


def not_home(remote_list: list[RemoteRun], runs_dir: Path) -> list[str]:
    """Why each finished run is not safely home: no adapters on the controller, a sha256 the controller
    could not compute, no local folder, or an adapter missing or different here."""
    home = local_runs(runs_dir)
    problems = []
    for run in (r for r in remote_list if r.finished):
        if run.unreadable:
            problems.append(f"{run.label()}: sha256sum could not read {', '.join(run.unreadable)} on the controller")
            continue
        lacking = _missing_adapters(run.adapters)
        if lacking:
            problems.append(f"{run.label()}: COMPLETED but no {' or '.join(lacking)} on the controller")
            continue
        dest = home.get(run.name)
        if dest is None:
            problems.append(f"{run.label()} is not in {runs_dir}")
            continue
        bad = [f for f, sha in sorted(run.adapters.items()) if _sha256(dest / f) != sha]
        if bad:
            problems.append(f"{run.label()}: {', '.join(bad)} in {dest} missing or not the controller's")
    return problems


@dataclass(frozen=True)
class Ready:
    finished: int  # finished runs checked: all home and verified
    dropped: list[str]  # unfinished runs whose checkpoints go with the stack (--drop-unfinished)


def check_ready(cl: Cluster, runs_dir: Path, how: str, stack: str | None, done_job: str | None = None,
                drop_unfinished: bool = False) -> Ready:
    """Refuse (DownRefused) while a job runs, a finished run is not home and verified, or (without
    `drop_unfinished`) an unfinished run keeps a checkpoint. `done_job`: see jobs_in_flight."""
    flag = _stack_flag(stack)
    refuse_busy(cl.controller, how, flag, done_job)
    # Adapters a job saved 0600 (safetensors) and fab never brought home: readable, so their sums can be taken.
    slurm.let_admin_read(cl.controller, cl.inventory, f"{cl.inventory.scratch}/slurm-gpu/jobs")
    found = remote_runs(cl.controller, cl.inventory.scratch)
    missing = not_home(found, runs_dir)
    pulumi_cmd = f"`pulumi destroy{flag}` (it checks nothing)"
    if missing:
        first = next((r for r in found if r.job_id and any(r.label() in m for m in missing)), None)
        fetch = (f"`fab logs{flag} --job {first.job_id}` brings it home" if first
                 else f"`fab logs{flag} --job N` brings one home")
        raise DownRefused(f"{_lead(how)}finished run(s) not home: {'; '.join(missing)}. {fetch}; `fab runs` lists "
                          f"what is here. To drop them anyway, {pulumi_cmd}")
    unfinished = [f"{r.label()}, checkpoint-{r.checkpoint}" for r in found
                  if not r.finished and r.checkpoint is not None and r.job_id != done_job]
    if unfinished and not drop_unfinished:
        raise DownRefused(f"{_lead(how)}unfinished run(s) would lose their checkpoints on /scratch: "
                          f"{'; '.join(unfinished)}. `fab logs{flag} --job N` shows why one stopped; pass "
                          f"{DROP_FLAG} to destroy the stack with them")
    return Ready(sum(1 for r in found if r.finished), unfinished)


def ready_line(ready: Ready, runs_dir: Path) -> str:
    line = (f"no job on the cluster; {ready.finished} finished run(s), all home in {runs_dir} with their "
            "adapters verified")
    if ready.dropped:
        line += f"; dropped with the stack ({DROP_FLAG}): {'; '.join(ready.dropped)}"
    return line


# ---------------------------------------------------------------- the Pulumi CLI


def _pulumi(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["pulumi", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise DownRefused("the pulumi CLI is not installed: install it "
                          "(https://www.pulumi.com/docs/install/)") from None


def stack_name(stack: str | None) -> str:
    """--stack, else the selected stack (`pulumi stack --show-name`: "Display only the stack name",
    https://www.pulumi.com/docs/iac/cli/commands/pulumi_stack/). Asked once per way down: every later
    command names this stack (module doc)."""
    if stack:
        return stack
    res = _pulumi("stack", "--show-name")
    name = res.stdout.strip()
    if res.returncode or not name:
        raise DownRefused(f"no Pulumi stack selected ({res.stderr.strip()}): pass --stack=NAME")
    return name


@dataclass(frozen=True)
class StackState:
    resources: list[tuple[str, str]]  # (type, id) of the cloud's resources
    inventory: dict | None  # the stack's `inventory` output as the state holds it


def stack_state(stack: str) -> StackState:
    """The stack's cloud resources (not Pulumi's own: the stack, providers, components) and its `inventory`
    output, from `pulumi stack export` (the root pulumi:pulumi:Stack resource's `outputs`)."""
    res = _pulumi("stack", "export", f"--stack={stack}")
    if res.returncode:
        raise DownRefused(f"`pulumi stack export --stack={stack}` failed: {res.stderr.strip()}")
    state = json.loads(res.stdout or "{}")
    found, inventory = [], None
    for r in (state.get("deployment") or {}).get("resources") or []:
        typ = r.get("type", "")
        if typ == "pulumi:pulumi:Stack":
            inventory = (r.get("outputs") or {}).get("inventory")
        if typ.startswith(("pulumi:", "slurm-gpu:")) or not r.get("id"):
            continue
        found.append((typ, str(r["id"])))
    return StackState(found, inventory if isinstance(inventory, dict) else None)


def stack_resources(stack: str) -> list[tuple[str, str]]:
    return stack_state(stack).resources


def check_same_cluster(stack: str, state: StackState, checked: Inventory) -> None:
    """The stack about to be destroyed holds the cluster whose runs were checked: same name, same
    controller (its addresses), else refused."""
    try:
        held = Inventory.from_dict(state.inventory) if state.inventory else None
    except InventoryError:
        held = None
    if held is None or held.cluster_name != checked.cluster_name or held.controller != checked.controller:
        where = (f"cluster {held.cluster_name!r}, controller {held.controller.public_ip or held.controller.private_ip}"
                 if held else "no readable inventory")
        raise DownRefused(f"stack {stack} holds {where}, not the cluster whose runs were checked (cluster "
                          f"{checked.cluster_name!r}, controller {checked.controller.public_ip}): nothing "
                          f"destroyed; run `fab down --stack=NAME` naming the stack you mean")


def describe_removed(found: list[tuple[str, str]]) -> str:
    counts = Counter(t.rsplit(":", 1)[-1] for t, _ in found)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def _stream_destroy(stack: str, say: Say) -> tuple[int, list[str]]:
    """Run `pulumi destroy` with its progress shown as it comes; (exit status, its last lines)."""
    cmd = ["pulumi", "destroy", "--yes", "--skip-preview", "--non-interactive", f"--stack={stack}"]
    tail: deque[str] = deque(maxlen=15)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
        raise DownRefused("the pulumi CLI is not installed: install it "
                          "(https://www.pulumi.com/docs/install/)") from None
    with proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            say(f"    {line}")
    return proc.returncode, list(tail)


def _market(stack: str) -> tuple[str, str]:
    """(slurm-gpu:gpuMarket, slurm-gpu:capacityReservationId) of the stack's Pulumi.<stack>.yaml; unknown:
    ("", "")."""
    try:
        settings = est.stack_settings(stack.rsplit("/", 1)[-1]).settings
    except (est.EstimateError, OSError, ValueError):
        return "", ""
    return settings.gpu_market, settings.capacity_reservation_id or ""


def destroy(stack: str, checked: Inventory | None, say: Say = print) -> list[tuple[str, str]]:
    """`pulumi destroy` of `stack` (already settled: stack_name); refused unless its state holds the
    `checked` inventory's cluster. Says what it removed and what may still bill. Returns the (type, id)."""
    state = stack_state(stack)
    if checked is not None:
        check_same_cluster(stack, state, checked)
    found = state.resources
    say(f"destroying stack {stack}: {len(found)} resource(s) ({describe_removed(found) or 'none'})")
    code, tail = _stream_destroy(stack, say)
    if code:
        raise DownRefused(f"`pulumi destroy --stack={stack}` failed (exit {code}); the stack may be partly up: "
                          "run it again, or `fab status`:\n" + "\n".join(tail))
    say(f"removed from stack {stack}: {describe_removed(found) or 'nothing (it was empty)'}")
    for typ, rid in found:
        say(f"  {typ.rsplit(':', 1)[-1]:<28} {rid}")
    for line in still_bills.after_destroy(*_market(stack)):
        say(line)
    return found


def down(where: ClusterOptions, runs_dir: Path, drop_unfinished: bool = False, say: Say = print) -> None:
    """`fab down`: the stack settled, its cluster opened by that name, the checks, the connections closed,
    then the destroy of that same stack."""
    name = stack_name(where.stack)
    with remote.open_cluster(dataclasses.replace(where, stack=name)) as cl:
        ready = check_ready(cl, runs_dir, "", name, drop_unfinished=drop_unfinished)
        checked = cl.inventory
    say(ready_line(ready, runs_dir))
    destroy(name, checked, say)
