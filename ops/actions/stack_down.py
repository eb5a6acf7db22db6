"""`fab down` and `fab train --down`: destroy the stack once nothing on it is left to lose.

The way down refuses, naming why, while
- the cluster is not a Pulumi stack (options.check_down: the local cluster has `fab local.down`);
- a job is queued or running (squeue on the controller);
- a finished run (its output/COMPLETED marker, written after the adapters) is not home: no runs/<job>/
  folder of this machine names its job directory, or an adapter file there differs from the controller's
  (sha256 of each adapter_* file on both sides).
Then it runs the Pulumi CLI: `pulumi destroy --yes --skip-preview --non-interactive --stack NAME`
(https://www.pulumi.com/docs/iac/cli/commands/pulumi_destroy/: --yes skips the confirmation,
--skip-preview the preview, --non-interactive the prompts), after `pulumi stack export` read the stack's
resources so it can say what it removed. `pulumi destroy` runs none of the program's code (it deletes what
the state records), so these checks live here and not in the program.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fabric import Connection

from cluster.errors import UserError
from ops.finetune import sbatch as jobs
from ops.say import Say
from ops.ssh.remote import Cluster
from training.outputs import COMPLETED_MARKER  # written after the adapters

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # a job directory's name as new_job_dir makes it
_HASH = re.compile(r"^(?P<sha>[0-9a-f]{64})  (?P<file>adapter_[\w.-]+)$")
_LOG_ID = re.compile(rf"/{jobs.FINETUNE_NAME}-(\d+)\.out$")


class DownRefused(UserError, RuntimeError):
    pass


def _lead(how: str) -> str:
    """`how` names the flag that asked (--down); `fab down` gets its task name from cluster_task already."""
    return f"{how}: " if how else ""


def jobs_in_flight(ctl: Connection, done_job: str | None = None) -> list[str]:
    """'JOB (NAME, STATE)' of every job Slurm still holds (queued, running, completing). `done_job`: the job
    `fab train --down` has just brought home, left out while it is only COMPLETING (its epilog)."""
    res = ctl.run("squeue -h -o '%i|%j|%T'", hide=True, warn=True, in_stream=False)
    if not res.ok:
        raise DownRefused(f"squeue failed on the controller ({(res.stderr or res.stdout).strip()}): cannot tell "
                          "whether a job runs, so the stack stays up; `fab status` shows why")
    out = []
    for line in res.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0] and not (parts[0] == done_job and parts[2] == "COMPLETING"):
            out.append(f"{parts[0]} ({parts[1]}, {parts[2]})")
    return out


def refuse_busy(ctl: Connection, how: str, stack_flag: str = "", done_job: str | None = None) -> None:
    busy = jobs_in_flight(ctl, done_job)
    if busy:
        raise DownRefused(f"{_lead(how)}a run is in flight: job(s) {', '.join(busy)} on the cluster; let them "
                          f"finish and come home (`fab logs{stack_flag} --job N`) or cancel them "
                          f"(`fab cancel{stack_flag} --job N`) first")


@dataclass(frozen=True)
class RemoteRun:
    name: str  # the job directory's name under <scratch>/slurm-gpu/jobs
    job_id: str | None  # from its log's file name, when the log is still there
    adapters: dict[str, str]  # adapter file -> sha256

    def label(self) -> str:
        return f"job {self.job_id} ({self.name})" if self.job_id else self.name


def finished_runs(ctl: Connection, scratch: str) -> list[RemoteRun]:
    """The controller's finished runs: job directories with output/COMPLETED, their adapters' sha256 and the
    job id of the log that names the directory. Names the controller gives back are checked against a
    strict pattern and never used as a path here."""
    q = shlex.quote
    root, logs = f"{scratch}/slurm-gpu/jobs", f"{scratch}/logs"
    # The job's log names its directory in its first line (jobs/finetune.sbatch.j2: SLURM_GPU_JOB {"job_dir": ...}).
    script = (f"root={q(root)}; cd \"$root\" 2>/dev/null || exit 0; for f in */output/{COMPLETED_MARKER}; do "
              '[ -e "$f" ] || continue; d=${f%%/*}; '
              'log=$(grep -l -F "\\"job_dir\\": \\"$root/$d\\"" '
              f'{q(logs)}/{jobs.FINETUNE_NAME}-*.out 2>/dev/null | head -n 1); '
              'echo "run $d $log"; (cd "$d/output" && sha256sum -- adapter_* 2>/dev/null); done')
    res = ctl.run(f"bash -c {q(script)}", hide=True, warn=True, in_stream=False)
    if not res.ok:
        raise DownRefused(f"listing the finished runs on the controller failed ({(res.stderr or '').strip()}): "
                          "the stack stays up")
    runs: list[RemoteRun] = []
    for line in res.stdout.splitlines():
        if line.startswith("run "):
            parts = line.split(maxsplit=2)
            name = parts[1] if len(parts) > 1 else ""
            if not _NAME.match(name):
                continue
            m = _LOG_ID.search(parts[2]) if len(parts) > 2 else None
            runs.append(RemoteRun(name, m[1] if m else None, {}))
        elif runs and (m := _HASH.match(line.strip())):
            runs[-1].adapters[m["file"]] = m["sha"]
    return runs


def local_runs(runs_dir: Path) -> dict[str, Path]:
    """job directory name -> runs/<job>/ that brought it home (its `job_dir` marker: pipeline.run_dir)."""
    out = {}
    for marker in sorted(runs_dir.glob("*/job_dir")):
        name = marker.read_text().strip().rsplit("/", 1)[-1]
        if name:
            out[name] = marker.parent
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def not_home(remote: list[RemoteRun], runs_dir: Path) -> list[str]:
    """Why each finished run is not safely home: no local folder, or an adapter missing or different."""
    home = local_runs(runs_dir)
    problems = []
    for run in remote:
        dest = home.get(run.name)
        if dest is None:
            problems.append(f"{run.label()} is not in {runs_dir}")
            continue
        bad = [f for f, sha in sorted(run.adapters.items())
               if not (dest / f).is_file() or _sha256(dest / f) != sha]
        if bad:
            problems.append(f"{run.label()}: {', '.join(bad)} in {dest} missing or not the controller's")
    return problems


def check_ready(cl: Cluster, runs_dir: Path, how: str, stack: str | None, done_job: str | None = None) -> int:
    """Refuse (DownRefused) while a job runs or a finished run is not home and verified; else the number of
    finished runs checked. `done_job`: see jobs_in_flight."""
    flag = f" --stack {stack}" if stack else ""
    refuse_busy(cl.controller, how, flag, done_job)
    remote = finished_runs(cl.controller, cl.inventory.scratch)
    missing = not_home(remote, runs_dir)
    if missing:
        first = next((r for r in remote if r.job_id and any(r.label() in m for m in missing)), None)
        fetch = (f"`fab logs{flag} --job {first.job_id}` brings it home" if first
                 else f"`fab logs{flag} --job N` brings one home")
        raise DownRefused(f"{_lead(how)}finished run(s) not home: {'; '.join(missing)}. {fetch}; `fab runs` lists "
                          "what is here. To drop them anyway, `pulumi destroy` (it checks nothing)")
    return len(remote)


# ---------------------------------------------------------------- the Pulumi CLI


def _pulumi(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["pulumi", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise DownRefused("the pulumi CLI is not installed: install it "
                          "(https://www.pulumi.com/docs/install/)") from None


def stack_name(stack: str | None) -> str:
    """--stack, else the selected stack (`pulumi stack --show-name`: "Display only the stack name",
    https://www.pulumi.com/docs/iac/cli/commands/pulumi_stack/)."""
    if stack:
        return stack
    res = _pulumi("stack", "--show-name")
    name = res.stdout.strip()
    if res.returncode or not name:
        raise DownRefused(f"no Pulumi stack selected ({res.stderr.strip()}): pass --stack NAME")
    return name


def stack_resources(stack: str) -> list[tuple[str, str]]:
    """(type, id) of the stack's cloud resources (not Pulumi's own: the stack, providers, components)."""
    res = _pulumi("stack", "export", "--stack", stack)
    if res.returncode:
        raise DownRefused(f"`pulumi stack export --stack {stack}` failed: {res.stderr.strip()}")
    state = json.loads(res.stdout or "{}")
    found = []
    for r in (state.get("deployment") or {}).get("resources") or []:
        typ = r.get("type", "")
        if typ.startswith(("pulumi:", "slurm-gpu:")) or not r.get("id"):
            continue
        found.append((typ, str(r["id"])))
    return found


def describe_removed(found: list[tuple[str, str]]) -> str:
    counts = Counter(t.rsplit(":", 1)[-1] for t, _ in found)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def destroy(stack: str | None, say: Say = print) -> list[tuple[str, str]]:
    """`pulumi destroy` of the stack; says what it removed. Returns the (type, id) removed."""
    name = stack_name(stack)
    found = stack_resources(name)
    say(f"destroying stack {name}: {len(found)} resource(s) ({describe_removed(found) or 'none'})")
    res = _pulumi("destroy", "--yes", "--skip-preview", "--non-interactive", "--stack", name)
    if res.returncode:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
        raise DownRefused(f"`pulumi destroy --stack {name}` failed (exit {res.returncode}); the stack may be "
                          f"partly up: run it again, or `fab status`:\n{tail}")
    say(f"removed from stack {name}: {describe_removed(found) or 'nothing (it was empty)'}")
    for typ, rid in found:
        say(f"  {typ.rsplit(':', 1)[-1]:<28} {rid}")
    say("nothing of this stack bills any more (its Pulumi.<stack>.yaml and empty state remain: "
        "`pulumi stack rm` removes them)")
    return found


def down(cl: Cluster, runs_dir: Path, stack: str | None, say: Say = print) -> None:
    """`fab down`: the checks on an open cluster, the connections closed, then the destroy."""
    checked = check_ready(cl, runs_dir, "", stack)
    say(f"no job on the cluster; {checked} finished run(s), all home in {runs_dir} with their adapters verified")
    cl.close()
    destroy(stack, say)
