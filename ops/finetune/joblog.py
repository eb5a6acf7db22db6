"""Reading a fine-tune job's log as it grows: steps, loss, restarts, metrics, NCCL lines.

The log holds every rank's output with srun's "N: " labels. The lines that matter:

    SLURM_GPU_JOB {...}        the batch script starting (again, after a requeue: restart > 0)
    SLURM_GPU_LOG {...}        rank 0, one per logged optimizer step (step, max_steps, loss, ...)
    SLURM_GPU_RESUMED {...}    rank 0 resumed from a checkpoint
    SLURM_GPU_SPOT {...}       rank 0: a checkpoint now, on the spot watcher's signal (training/interrupts.py)
    SLURM_GPU_HANG {...}       the batch script: the hang watchdog's report, which rank hung, where (training/hangs.py)
    SLURM_GPU_METRICS {...}    rank 0, the final metrics
    {'loss': '2.1', ...}       the HF Trainer's own per-step dict (used when the above is absent)
    ... NCCL INFO ...          NCCL's connection lines (ops/actions/nccl.py)

A tag counts only at the start of a line, after srun's label and torchrun's "[rankN]:" prefix:
a tag in the middle of some other output (a library echoing text, a data row) is just text.
Any process that can write to the shared log can still forge a whole tagged line, so what a tag
carries is checked before it is used: `nodes` must be a Slurm hostlist (it reaches `sinfo` on the
controller, ops/finetune/spot_notice.py) and `job_dir` a job directory path (what `fab logs`
downloads from); anything else is dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field

from ops.actions import slurm
from training import protocol

_LABEL = re.compile(r"^\s*\d+: ")
# The tags read here (training/protocol.py); END is the timeline's (ops/finetune/timeline.py).
_TAGS = (protocol.JOB, protocol.LOG, protocol.RESUMED, protocol.METRICS, protocol.SPOT, protocol.HANG)
_TAGGED = re.compile(r"^(?P<tag>" + "|".join(_TAGS) + r") (?P<body>\{.*\})\s*$")
_HF_DICT = re.compile(r"^\{'(?:loss|train_runtime)'.*\}$")
_BAR = re.compile(r"(?P<step>\d+)/(?P<total>\d+) \[")
_RANK = re.compile(r"^\[(?:rank|default)\d+\]:\s*")
# `fab train`'s job directories (ops/finetune/launch.py new_job_dir): absolute, plain characters, no "..".
_JOB_DIR = re.compile(r"(?:/[A-Za-z0-9_.-]+)+/slurm-gpu/jobs/[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")
# A log line that states a cause: an exception's last line, srun/slurm errors, our own messages.
_ERROR = re.compile(r"^(?:[\w.]*(?:Error|Exception|Interrupt)\b:?|.*\berror: |slurm-gpu: |training data error)")
MAX_ERRORS = 12


@dataclass
class Event:
    kind: str  # "start", "step", "resumed", "metrics", "spot", "hang"
    data: dict


def job_dir(text: object) -> str | None:
    """`text` when it has the shape of a job directory of `fab train` (no ".." part), else None."""
    if not isinstance(text, str) or not _JOB_DIR.fullmatch(text) or ".." in text.split("/"):
        return None
    return text


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return _number(value) and math.isfinite(value)


def _floats(d: dict) -> dict:
    """HF's ProgressCallback prints floats as strings ('2.134'): make them numbers again."""
    out = {}
    for k, v in d.items():
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        out[k] = v
    return out


@dataclass
class JobLog:
    """Feed it log text as it arrives; it yields events and remembers what the summary needs."""

    steps: list[dict] = field(default_factory=list)
    nccl_lines: list[str] = field(default_factory=list)
    tail: deque = field(default_factory=lambda: deque(maxlen=40))
    errors: list[str] = field(default_factory=list)  # distinct error lines (all ranks), first seen first
    metrics: dict | None = None
    job_dir: str | None = None
    restarts: int = 0
    resumed_from: int | None = None
    nodes: str | None = None  # the current attempt's node list (Slurm's hostlist)
    max_steps: int | None = None
    started: bool = False  # a SLURM_GPU_JOB line was seen
    hangs: list[dict] = field(default_factory=list)  # the hang watchdog's reports, one per hung attempt
    _partial: str = ""
    _tokens_t0: tuple[float, float] | None = None  # (arrival time, num_tokens) of the first step

    def feed(self, text: str, now: float | None = None) -> list[Event]:
        now = time.monotonic() if now is None else now
        data = self._partial + text
        *lines, self._partial = re.split(r"\r\n|\n|\r", data)
        events = []
        for line in lines:
            ev = self.line(line, now)
            if ev:
                events.append(ev)
        return events

    def line(self, raw: str, now: float) -> Event | None:
        line = _LABEL.sub("", raw, count=1).rstrip()
        if not line:
            return None
        if "NCCL INFO" in line:
            self.nccl_lines.append(raw)
            return None
        self.tail.append(raw)
        self._error(line)
        # A line that does not parse, or holds values of the wrong type, is text: it never stops `fab train`.
        if m := _TAGGED.match(_RANK.sub("", line, count=1)):
            try:
                body = json.loads(m["body"])
                return self._tagged(m["tag"], body, now) if isinstance(body, dict) else None
            except (ValueError, TypeError, OverflowError, RecursionError):
                return None
        if _HF_DICT.match(line) and not self._has_tagged_steps():
            try:
                body = _floats(ast.literal_eval(line))
                if isinstance(body, dict) and _number(body.get("loss")):
                    body.setdefault("step", len(self.steps) + 1)
                    return self._step(body, now)
            except (ValueError, TypeError, OverflowError, SyntaxError, RecursionError, MemoryError):
                return None
        if (m := _BAR.search(line)) and self.max_steps is None:
            self.max_steps = int(m["total"])
        return None

    def _error(self, line: str) -> None:
        text = _RANK.sub("", line).strip()
        if _ERROR.match(text) and "warning" not in text.lower()[:20] and text not in self.errors \
                and len(self.errors) < MAX_ERRORS:
            self.errors.append(text)

    def _has_tagged_steps(self) -> bool:
        # Our training prints a tagged line per logged step; its job script announces itself with
        # SLURM_GPU_JOB first. HF's own dict for the same step comes before the tagged line, so
        # it is only used for logs without our tags (else the first step would be shown twice).
        return self.started or any(s.get("_tagged") for s in self.steps)

    def _tagged(self, tag: str, body: dict, now: float) -> Event | None:
        if tag == protocol.JOB:
            restarts = int(body.get("restart", 0))
            self.started = True
            self.job_dir = job_dir(body.get("job_dir")) or self.job_dir
            self.restarts = restarts
            self.nodes = slurm.hostlist(body.get("nodes")) or self.nodes
            return Event("start", body)
        if tag == protocol.SPOT:
            return Event("spot", body)
        if tag == protocol.HANG:
            self.hangs.append(body)
            return Event("hang", body)
        if tag == protocol.RESUMED:
            self.resumed_from = int(body.get("step", 0))
            return Event("resumed", body)
        if tag == protocol.METRICS:
            self.metrics = body
            return Event("metrics", body)
        body = {**_floats(body), "_tagged": True}
        if not _number(body.get("loss")):  # e.g. the final train_runtime dict
            return None
        return self._step(body, now)

    def _step(self, body: dict, now: float) -> Event:
        if not all(_finite(body.get(k, 0)) for k in ("step", "max_steps")):
            raise ValueError(f"not a step: {body!r}")  # line() drops the line
        if body.get("max_steps"):
            self.max_steps = int(body["max_steps"])
        tokens = body.get("num_tokens")
        if isinstance(tokens, (int, float)):
            if self._tokens_t0 is None:
                self._tokens_t0 = (now, tokens)
            elif now > self._tokens_t0[0]:
                body["tokens_per_s"] = (tokens - self._tokens_t0[1]) / (now - self._tokens_t0[0])
        self.steps.append(body)
        return Event("step", body)

    # ---- what the user sees

    def progress(self, step: dict) -> str:
        total = f"/{self.max_steps}" if self.max_steps else ""
        parts = [f"step {int(step.get('step', len(self.steps)))}{total}", f"loss {step['loss']:.4f}"]
        if isinstance(step.get("mean_token_accuracy"), float):
            parts.append(f"acc {step['mean_token_accuracy']:.3f}")
        if step.get("tokens_per_s"):
            parts.append(f"{step['tokens_per_s']:,.0f} tok/s")
        if isinstance(step.get("epoch"), float):
            parts.append(f"epoch {step['epoch']:.2f}")
        return "  ".join(parts)

    def describe(self, ev: Event) -> str | None:
        if ev.kind == "step":
            return self.progress(ev.data)
        if ev.kind == "start":
            if self.restarts:
                return f"job restarted after a requeue (restart {self.restarts}) on {self.nodes or '?'}"
            return f"job started on {self.nodes or '?'}"  # the checked node list, not the line's text
        if ev.kind == "resumed":
            return f"resumed from checkpoint step {ev.data.get('step')} ({ev.data.get('checkpoint')})"
        if ev.kind == "metrics":
            return "training finished; final metrics written"
        if ev.kind == "spot":
            return spot_line(ev.data)
        if ev.kind == "hang":
            return hang_line(ev.data)
        return None


def _ranks(numbers: list[int]) -> str:
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(map(str, numbers))


def hang_line(data: dict) -> str:
    """What `fab train` says of a SLURM_GPU_HANG line: which rank hung and where, what the others were doing."""
    ranks = data.get("ranks") or {}

    def on(rank) -> str:
        host = ranks.get(str(rank), {}).get("host")
        return f" on {host}" if host else ""

    idle, deadline, step = data.get("idle_s"), data.get("deadline_s"), data.get("step")
    timed = isinstance(idle, (int, float)) and isinstance(deadline, (int, float))
    head = (f"hang: no training progress for {idle:.0f} s (deadline {deadline:.0f} s) after step {step}"
            if timed else "hang: training stopped moving")
    hung = data.get("hung") or []
    if len(hung) == 1:
        head += f"; rank {hung[0]}{on(hung[0])} hung at {ranks[str(hung[0])]['where']}"
    elif hung:
        head += "; no single rank stands out: " + "; ".join(f"rank {r}{on(r)} at {ranks[str(r)]['where']}"
                                                            for r in hung)
    elif ranks:
        head += "; every rank waits in a collective (a peer or the network stopped answering)"
    waiting = [int(r) for r, info in ranks.items() if info.get("waiting")]
    if waiting:
        first = ranks[str(waiting[0])]["where"]
        head += f"; {_ranks(waiting)} waiting for it ({first})" if len(hung) == 1 else f"; {_ranks(waiting)} at {first}"
    missing = "" if ranks else " (no rank's stack was written)"
    return head + (f"; every rank's stack in {data.get('stacks_dir', 'output_dir/hangs')}{missing} (brought home "
                   "with the run)")


def spot_line(data: dict, node: str | None = None, reason: str | None = None) -> str:
    """What `fab train` says of a SLURM_GPU_SPOT line; `node` and `reason`: the drained node, when known."""
    step = data.get("step")
    if data.get("stop"):
        where = f" on {node} ({reason})" if node else ""
        return (f"spot interruption{where}: checkpoint at step {step}, requeued; the job resumes from it "
                "when enough nodes are back")
    return (f"spot rebalance recommendation: checkpoint at step {step}; training goes on "
            "(no drain: the node is not interrupted yet)")
