"""Where a `fab train` run's wall time goes: every phase with its start and end.

fab times its own phases (waiting for the nodes, key sync, ..., download) on this machine's
clock. The job's phases come from the job itself: the batch script stamps its start and end
in the log (SLURM_GPU_JOB / SLURM_GPU_END lines, "t"), rank 0 writes epoch timestamps into
metrics.json (`timing`, and per-rank `phases` where the training side reports them). Those
clocks are the cluster's: they are shifted by the controller's clock offset that fab measures
(the local cluster shares this machine's clock; AWS hosts run Amazon Time Sync).

The job's phases fill the span fab spent following the job, so the rows are contiguous:
they add up to the wall time, and what no phase explains is shown as a gap.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training import protocol

# Canonical phases, in run order: key -> label. The estimate (ops/cost/estimate.py) predicts the same keys.
LABELS: dict[str, str] = {
    "setup": "flag checks, inventory",
    "estimate": "estimate",
    "wake": "waiting for the nodes",
    "inputs": "input checks",
    "upload": "data file upload",
    "prefetch": "model and data fetch",
    "keys": "munge key sync",
    "reconfigure": "reconfigure",
    "service": "nodes to service",
    "sanity": "sanity job",
    "network": "network check (all-reduce)",
    "staging": "staging (code, config, submit)",
    "queue": "queue wait",
    "startup": "start-up (srun, rendezvous, imports)",
    "data": "data preparation",
    "model": "model load",
    "build": "trainer build",
    "first_step": "first step (compile, if any)",
    "steps": "training steps",
    "save": "saving adapters and state",
    "exit": "job exit, seen by fab",
    "seen": "job end seen by fab",
    "download": "download and summary",
}

# metrics.json `timing` marks (rank 0, epoch seconds) -> the phase that ends at that mark.
_MARKS = (("args_parsed", "startup"), ("data_ready", "data"), ("model_loaded", "model"),
          ("trainer_built", "build"), ("first_step_done", "first_step"), ("trained", "steps"),
          ("adapters_written", "save"))
_STAMP = re.compile(r"\b(?P<tag>" + protocol.JOB + "|" + protocol.END + r") (?P<body>\{.*\})\s*$")
GAP = "gap"  # a span no phase covers


def process_started() -> float:
    """When this process began (epoch seconds): the interpreter's start and fab's imports belong
    to the run's wall time. Linux tells it (/proc/self/stat: clock ticks since boot, as
    CLOCK_BOOTTIME counts); elsewhere, the first import of this module stands in."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
    return min(time.time() - max(age, 0.0), _IMPORTED)


_IMPORTED = time.time()


@dataclass
class Phase:
    key: str
    start: float  # epoch seconds on this machine's clock
    end: float
    source: str  # "fab", "job log", "metrics.json"
    label: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or LABELS.get(self.key, self.key)

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class Timeline:
    started: float = field(default_factory=time.time)
    phases: list[Phase] = field(default_factory=list)
    clock_offset_s: float = 0.0  # cluster clock minus this machine's
    job_id: str | None = None
    cluster: str | None = None  # the inventory's cluster_name (ops/cost/estimate.py's scenario_for reads it)

    @contextmanager
    def phase(self, key: str, note: str = "", start: float | None = None) -> Iterator[Phase]:
        """Time a fab-side phase (it is recorded even when it raises); `start`: it began earlier."""
        ph = Phase(key, time.time() if start is None else start, 0.0, "fab", note=note)
        try:
            yield ph
        finally:
            ph.end = time.time()
            self.phases.append(ph)

    def timed(self, key: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), timed as phase `key`."""
        with self.phase(key):
            return fn(*args, **kwargs)

    @property
    def ended(self) -> float:
        return max((p.end for p in self.phases), default=self.started)

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    def seconds(self, key: str) -> float:
        return sum(p.seconds for p in self.phases if p.key == key)

    def rows(self) -> list[Phase]:
        """The phases in order with the gaps between them made explicit (gaps under 50 ms dropped)."""
        out: list[Phase] = []
        at = self.started
        for p in sorted(self.phases, key=lambda p: p.start):
            if p.start - at > 0.05:
                out.append(Phase(GAP, at, p.start, "fab", label="(between phases)"))
            out.append(p)
            at = max(at, p.end)
        return out

    def to_dict(self, predicted: dict[str, float] | None = None) -> dict:
        return {
            "job_id": self.job_id, "cluster": self.cluster, "started": self.started, "ended": self.ended,
            "wall_s": round(self.wall_s, 3), "clock_offset_s": round(self.clock_offset_s, 3),
            "phases": [{**asdict(p), "seconds": round(p.seconds, 3),
                        "offset_s": round(p.start - self.started, 3)} for p in self.rows()],
            "predicted_s": predicted or {},
        }

    def save(self, path: Path, predicted: dict[str, float] | None = None) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(predicted), indent=2) + "\n")
        tmp.replace(path)
        return path

    def table(self, predicted: dict[str, float] | None = None) -> list[str]:
        """The timeline as text rows: offset, phase, seconds, share, and the prediction beside it."""
        wall = self.wall_s or 1.0
        pred = predicted or {}
        head = f"  {'at':>7}  {'phase':<38} {'took':>8} {'share':>6}" + (f" {'predicted':>10}" if pred else "")
        out = ["timeline", head]
        for p in self.rows():
            line = (f"  {p.start - self.started:>6.1f}s  {p.label[:38]:<38} {p.seconds:>7.1f}s "
                    f"{100 * p.seconds / wall:>5.0f}%")
            if pred:
                line += f" {pred[p.key]:>9.1f}s" if p.key in pred else f" {'':>10}"
            out.append(line + (f"  {p.note}" if p.note else ""))
        total = f"  {'':>7}  {'wall time':<38} {self.wall_s:>7.1f}s {100:>5}%"
        if pred:
            total += f" {sum(pred.values()):>9.1f}s"
        out.append(total)
        return out


# ---------------------------------------------------------------- the job's side


def clock_offset(ctl) -> float:
    """The controller's clock minus this machine's, in seconds (half a round trip of error)."""
    before = time.time()
    res = ctl.run("date +%s.%N", hide=True, warn=True, in_stream=False)
    after = time.time()
    try:
        return float(res.stdout.strip()) - (before + after) / 2
    except ValueError:
        return 0.0


def log_stamps(log_text: str) -> tuple[float | None, float | None]:
    """(start, end) epoch stamps of the batch script's last attempt from the job log, if any."""
    start = end = None
    for line in log_text.splitlines():
        if m := _STAMP.search(line):
            try:
                t = float(json.loads(m["body"]).get("t"))
            except (ValueError, TypeError, json.JSONDecodeError):
                continue
            if m["tag"] == protocol.JOB:
                start, end = t, None  # a requeued attempt starts the count again
            else:
                end = t
    return start, end


def _rank_phases(metrics: dict) -> list[tuple[str, float, float]]:
    """(name, start, end) from metrics.json's per-rank `phases`, where the training side reports
    them: rank 0's list, each entry {name, start, end} (a dict name -> {start, end} works too)."""
    raw = metrics.get("phases")
    if isinstance(raw, dict) and raw and all(isinstance(v, (list, dict)) for v in raw.values()) \
            and not all(isinstance(v, dict) and "start" in v for v in raw.values()):
        raw = raw.get("0", raw.get(0, next(iter(raw.values()))))  # per rank: rank 0's
    if isinstance(raw, dict):
        raw = [{"name": k, **v} for k, v in raw.items() if isinstance(v, dict)]
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append((str(item["name"]), float(item["start"]), float(item["end"])))
        except (KeyError, TypeError, ValueError):
            continue
    return sorted(out, key=lambda x: x[1])


def add_job(tl: Timeline, follow: Phase, metrics: dict, log_text: str) -> None:
    """Replace the fab-side `follow` span by the job's own phases, shifted onto this machine's clock.

    Each job mark ends one phase; the span before the job's start stamp is the queue wait, the
    span after the last mark (metrics written, processes ending, fab's next poll) is the exit.
    Marks outside the follow span (a clock that is off) are clamped into it.
    """
    off = tl.clock_offset_s
    lo, hi = follow.start, follow.end

    def local(t: float) -> float:
        return min(max(t - off, lo), hi)

    start, end = log_stamps(log_text)
    timing = metrics.get("timing") if isinstance(metrics.get("timing"), dict) else {}
    marks: list[tuple[str, float, str]] = []
    if start is not None:
        marks.append(("queue", local(start), "job log"))
    rank = _rank_phases(metrics)
    if rank:  # the training side's own phases: one row each (gaps between them show as gaps)
        body = [Phase(name, local(s), local(e), "metrics.json") for name, s, e in rank]
    else:
        body = []
        for mark, key in _MARKS:
            t = timing.get(mark)
            if isinstance(t, (int, float)):
                marks.append((key, local(float(t)), "metrics.json"))
    tl.phases.remove(follow)
    at = lo
    for key, t, source in sorted(marks, key=lambda m: m[1]):
        ph = Phase(key, at, t, source)
        if key == "steps" and metrics.get("checkpoint_s"):
            ph.note = f"{metrics['checkpoint_s']:.1f} s of it checkpoints ({metrics.get('checkpoints_saved', '?')})"
        if key == "first_step" and metrics.get("compiled_layers") is not None:
            ph.note = f"compiled layers: {metrics.get('compiled_layers')}"
        tl.phases.append(ph)
        at = t
    for ph in body:
        tl.phases.append(ph)
        at = max(at, ph.end)
    if end is not None and local(end) > at:
        tl.phases.append(Phase("exit", at, local(end), "job log", label="job exit (batch script ends)"))
        at = local(end)
    tl.phases.append(Phase("exit" if end is None else "seen", at, hi, "fab",
                           label=LABELS["exit"] if end is None else LABELS["seen"]))

