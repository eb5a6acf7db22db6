"""`fab runs`: the fine-tunes brought home under runs/, newest first, one line each; one run's summary again.

Read from what `fab train` left in runs/<job>/: metrics.json (losses, eval, tokens/s), timeline.json (wall
time), run.json (model, cluster shape, cost from the stack's prices) and the GPU samples. A run missing a file
shows "-" there.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
from pathlib import Path

from ops.actions.options import REPO
from ops.finetune import summary
from ops.finetune.joblog import JobLog
from ops.say import shown

# Where runs come home; SLURM_GPU_RUNS moves it (the tests keep the repo clean with it).
RUNS = Path(os.environ.get("SLURM_GPU_RUNS", REPO / "runs"))

COLUMNS = ("job", "date", "model", "rows", "nodes x GPUs", "train loss", "eval loss base -> tuned", "tokens/s",
           "wall", "cost")


# A run's directory under runs/: the job id, or `<job id>-<job dir name>` when that id was taken before
# (run_dir). Nothing else: `--job ../x` would read outside runs/.
RUN_NAME = re.compile(r"[0-9]+(?:-[A-Za-z0-9_.-]+)?")


class RunsError(ValueError):
    pass


def run_dir(job_id: str, job_dir: str | None) -> Path:
    """runs/<job-id>/, unless it holds another job's run (a new local cluster numbers its jobs
    from 1 again): then runs/<job-id>-<job dir name>/, so no earlier run is overwritten."""
    dest = RUNS / job_id
    marker = dest / "job_dir"
    if job_dir and dest.exists() and (not marker.exists() or marker.read_text().strip() != job_dir):
        dest = RUNS / f"{job_id}-{posixpath.basename(job_dir)}"
    if job_dir:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "job_dir").write_text(job_dir + "\n")
    return dest


def _read(path: Path) -> dict:
    """A run's JSON record ({} when it is missing); a record that is not a JSON object is an error naming
    the file, not a traceback further on."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RunsError(f"{path} cannot be read as JSON ({exc}): fix or delete that file") from None
    if not isinstance(data, dict):
        raise RunsError(f"{path} is not a JSON object (it holds a {type(data).__name__}): fix or delete that file")
    return data


def _typed(rec: dict, key: str, kinds: tuple[type, ...], path: Path):
    """rec[key] when it is one of `kinds` (or missing: None), else an error naming the file and key."""
    value = rec.get(key)
    if value is None or (isinstance(value, kinds) and not isinstance(value, bool)):
        return value
    names = " or ".join(k.__name__ for k in kinds)
    raise RunsError(f"{path}: {key} must be a {names}, not {value!r}: fix or delete that file")


def run_dirs(runs: Path) -> list[Path]:
    """runs/<job>/ that hold a run's metrics, newest first (by when metrics.json arrived)."""
    if not runs.is_dir():
        return []
    found = [d for d in runs.iterdir() if (d / "metrics.json").is_file()]
    return sorted(found, key=lambda d: (d / "metrics.json").stat().st_mtime, reverse=True)


def with_adapters(root: Path, name: str | None, error: type[Exception], task: str) -> Path:
    """runs/<name>/ holding a run's adapters (default: the newest such run), for `fab chat` and `fab merge`. `name`
    is checked against RUN_NAME before it is joined to `root`; `error` is the task's own kind, and each message
    names the fix. `task` is the command the message suggests (e.g. "fab merge --run N")."""
    if name is None:
        found = [d for d in run_dirs(root) if (d / "adapter_config.json").is_file()]
        if not found:
            raise error(f"no run with adapters under {root} yet: `fab train` brings each run home there, then "
                        f"`{task}` takes one")
        return found[0]
    name = str(name).strip()
    if not RUN_NAME.fullmatch(name):
        shown_name = repr(name) if len(name) <= 40 else f"a value of {len(name)} characters"
        raise error(f"--run {shown_name} is not a run's name: give one as `fab runs` lists it (e.g. --run 12)")
    run = root / name
    if not run.is_dir():
        known = ", ".join(p.name for p in run_dirs(root)[:10]) or "none"
        raise error(f"--run {name}: no such run under {root} (runs there: {known}); `fab runs` lists them")
    if not (run / "adapter_config.json").is_file():
        raise error(f"run {run.name} has no adapters in {run} (adapter_config.json): it did not finish, or its "
                    f"download did not; `fab logs --job {run.name.split('-')[0]}` brings a finished run home")
    return run


def _f(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def row(d: Path) -> list[str]:
    m, tl, rec = _read(d / "metrics.json"), _read(d / "timeline.json"), _read(d / "run.json")
    ev = _typed(m, "eval", (dict,), d / "metrics.json") or {}
    base = (_typed(ev, "base", (dict,), d / "metrics.json") or {}).get("loss")
    tuned = (_typed(ev, "tuned", (dict,), d / "metrics.json") or {}).get("loss")
    evaluated = f"{_f(base, '.3f')} -> {_f(tuned, '.3f')}" if tuned is not None else "-"
    when = _typed(tl, "started", (int, float), d / "timeline.json") or (d / "metrics.json").stat().st_mtime
    model = _typed(rec, "model", (str,), d / "run.json") or "-"
    if model.startswith("/"):  # a path on the cluster: its last part names it
        model = Path(model).name if Path(model).name != "model" else "/".join(Path(model).parts[-2:])
    shape = (f"{rec['nodes']} x {rec.get('gpus_per_node', '-')}" if rec.get("nodes")
             else f"{m.get('world_size', '-')} ranks")
    rows = m.get("train_rows")
    rows_text = "-" if rows is None else f"{rows}" + (f" +{ev['rows']} eval" if ev.get("rows") else "")
    wall = tl.get("wall_s") or rec.get("wall_s")
    cost = rec.get("cost_usd")
    return [d.name, time.strftime("%Y-%m-%d %H:%M", time.localtime(when)), model, rows_text, shape,
            _f(m.get("last_loss"), ".3f"), evaluated, _f(m.get("tokens_per_s"), ",.0f"),
            f"{wall:.0f} s" if isinstance(wall, (int, float)) else "-",
            f"${cost:.2f}" if isinstance(cost, (int, float)) else "-"]


def table(runs: Path) -> list[str]:
    dirs = run_dirs(runs)
    if not dirs:
        return [f"no runs under {runs} yet: `fab train` brings each run home there"]
    rows = [list(COLUMNS)] + [row(d) for d in dirs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return [shown("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()) for r in rows]


def show(runs: Path, job: str) -> list[str]:
    """One run's summary again (as `fab train` printed it), from runs/<job>/."""
    if not RUN_NAME.fullmatch(job):
        raise RunsError(f"--job {job!r} is not a run's name: give a job id as `fab runs` lists it (e.g. --job 12)")
    d = runs / job
    if not (d / "metrics.json").is_file():
        known = ", ".join(p.name for p in run_dirs(runs)) or "none"
        raise RunsError(f"no run {job!r} under {runs} (runs there: {known}); `fab runs` lists them")
    row(d)  # its records read as `fab runs` lists them: a malformed one is named here, not a traceback later
    log = JobLog()
    if (d / "job.log").exists():
        log.feed((d / "job.log").read_text(errors="replace"))
    try:
        run = summary.build(job, "", log, d)
    except summary.SummaryError as exc:
        raise RunsError(str(exc)) from None
    rec = _read(d / "run.json")
    run.real_gpus = rec.get("target", "aws") != "local"
    lines = run.lines()
    if (d / "samples.md").exists():
        lines.append(f"  samples       {d / 'samples.md'}")
    if (d / "tensorboard").is_dir():
        lines.append(f"  TensorBoard   tensorboard --logdir {runs}")
    return [shown(line) for line in lines]  # values the job wrote (metrics.json, its log)
