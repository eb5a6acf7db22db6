"""The batch script's requeue and restart policy (jobs/finetune.sbatch.j2 runs it on the job's first node,
with the job's Python, before and after the training step). Standard library only.

Why Python and not the batch script's bash: every branch below is a decision on a few facts (markers in
output_dir, the restart count, the step's exit status, which nodes answer), and here each is unit-tested
(tests/unit/test_requeue.py) instead of only by the clusters that reach it. What stays in bash is what must:
srun itself, and turning this module's answer into the script's exit.

Limits: a node that keeps failing would requeue the job forever: give up after `max_restarts` restarts.
Spot interruptions (a line each in SPOT_REQUEUES) lose at most a step and are no failure: they do not
count toward that limit, only toward their own (`max_spot_requeues`).

Node loss. Two paths lead to a requeue (same job id, SLURM_RESTART_COUNT + 1, the script from the top,
training resumes from its newest complete checkpoint):
 - Slurm's own: once slurmctld marks a silent node DOWN (SlurmdTimeout), it requeues the --requeue job
   (JobRequeue=1) and kills the script. That is what happens when a host hangs or vanishes and the
   surviving ranks block in a collective.
 - Ours: usually the surviving ranks fail first (their peer's sockets close), srun -K1 ends the step and
   the script would exit non-zero long before the node is marked DOWN - a FAILED job that Slurm never
   requeues. So when the step fails and a node of the allocation no longer answers on its slurmd port,
   this requeues the job itself (`scontrol requeue`). A step that fails with every node answering is a
   training error: no requeue, the job fails at once.

Usage (exit status: the batch script's, but for `start`'s CONTINUE):
    python -m training.requeue start OUTPUT_DIR RESTART MAX_RESTARTS
    python -m training.requeue end OUTPUT_DIR RESTART MAX_RESTARTS MAX_SPOT_REQUEUES STATUS
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training import protocol

CONTINUE = 3  # `start`'s exit status for "train": the batch script goes on to the step
SLURMD_PORT = 6818  # Slurm's default SlurmdPort
_NODE_ADDR = re.compile(r" NodeAddr=(\S+)")
_SLURMD_PORT = re.compile(r"^SlurmdPort\s*=\s*(\d+)", re.M)


@dataclass(frozen=True)
class Attempt:
    """This run of the batch script: Slurm's restart count and the limits, and the spot requeues so far."""

    restart: int
    spot: int  # lines in SPOT_REQUEUES
    max_restarts: int
    max_spot_requeues: int = 0

    @property
    def failures(self) -> int:
        return self.restart - self.spot


@dataclass(frozen=True)
class Decision:
    """What the script does: requeue (then exit 0) or exit `code` with `message` (stderr unless `out`)."""

    code: int
    message: str = ""
    requeue: bool = False
    # After a requeue that scontrol refused: this message and code instead.
    refused: tuple[str, int] = ("", 1)
    spot_note: str = ""  # a requeue after a spot notice: the line SPOT_REQUEUES gets once it is done


def at_start(a: Attempt, completed: str | None) -> Decision:
    """Before the step: `completed`, COMPLETED's first line when the marker is there and not empty."""
    if completed is not None:
        return Decision(0, f"{protocol.prefix(protocol.METRICS)}{completed}")
    if a.failures > a.max_restarts:
        return Decision(1, f"slurm-gpu: requeued {a.restart} times, {a.failures} after failures "
                           f"(limit {a.max_restarts}); giving up")
    return Decision(CONTINUE)


def after_step(a: Attempt, status: int, completed: bool, interrupted: str | None, hung: bool,
               lost_nodes: Callable[[], list[str]], output_dir: str = "") -> Decision:
    """After the step: its exit `status`, the markers (`interrupted`: INTERRUPTED's text when there and not
    empty), and `lost_nodes`, asked only when a failed step needs it."""
    if interrupted is not None and not completed:
        if a.spot >= a.max_spot_requeues:
            return Decision(1, f"slurm-gpu: checkpointed after a spot interruption notice; {a.spot} spot requeues "
                               f"already (limit {a.max_spot_requeues}); giving up (its checkpoints stay in the "
                               "job's output directory)")
        return Decision(
            0, f"slurm-gpu: checkpointed after a spot interruption notice ({interrupted[:300]}); requeueing "
               f"(restart {a.restart + 1}, spot requeue {a.spot + 1})",
            requeue=True, spot_note=f"{int(time.time())} {interrupted[:200].replace(chr(10), '')}",
            refused=("slurm-gpu: requeue after the spot interruption failed; the checkpoint stays in the job's "
                     "output directory", 1))
    no_restarts_hung = (f"slurm-gpu: training hung; no restarts left (limit {a.max_restarts}); every rank's "
                        f"stack is in {output_dir}/hangs", 1)
    if hung and not completed:
        if a.failures < a.max_restarts:
            return Decision(0, f"slurm-gpu: training hung (the watchdog ended it: exit {status}); requeueing "
                               f"(restart {a.failures + 1} of {a.max_restarts})",
                            requeue=True, refused=no_restarts_hung)
        return Decision(no_restarts_hung[1], no_restarts_hung[0])
    if status != 0 and completed:
        return Decision(0, f"slurm-gpu: the training step exited {status} after training completed "
                           f"({output_dir}/{protocol.COMPLETED}); the run is kept")
    if status != 0:
        lost = ",".join(lost_nodes())
        gave_up = (f"slurm-gpu: training step failed (exit {status})"
                   + (f"; lost node(s): {lost}, no restarts left" if lost else ""), status)
        if lost and a.failures < a.max_restarts:
            return Decision(0, f"slurm-gpu: training step failed (exit {status}); lost node(s): {lost}; requeueing "
                               f"(restart {a.failures + 1} of {a.max_restarts})", requeue=True, refused=gave_up)
        return Decision(gave_up[1], gave_up[0])
    return Decision(0)


# ---------------------------------------------------------------- the job's side: files, scontrol, sockets

def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def node_addr(node: str) -> str:
    """A node's NodeAddr (slurm.conf): GPU nodes do not resolve each other's names. The name if none."""
    m = _NODE_ADDR.search(_scontrol("show", "node", "-o", node))
    return m.group(1) if m else node


def lost_nodes(nodelist: str, connect_s: float = 5.0) -> list[str]:
    """The allocation's nodes whose slurmd port does not accept a connection within `connect_s`."""
    m = _SLURMD_PORT.search(_scontrol("show", "config"))
    port = int(m.group(1)) if m else SLURMD_PORT
    lost = []
    for node in _scontrol("show", "hostnames", nodelist).split():
        try:
            socket.create_connection((node_addr(node), port), timeout=connect_s).close()
        except OSError:
            lost.append(node)
    return lost


def _text(path: Path) -> str | None:
    """The file's text when it is there and not empty (bash's `[ -s ]`), else None."""
    try:
        return path.read_text(errors="replace") if path.stat().st_size > 0 else None
    except OSError:
        return None


def attempt(out: Path, restart: int, max_restarts: int, max_spot_requeues: int = 0) -> Attempt:
    spot_text = _text(out / protocol.SPOT_REQUEUES) or ""
    return Attempt(restart, spot_text.count("\n"), max_restarts, max_spot_requeues)


def start(out: Path, restart: int, max_restarts: int) -> int:
    completed = _text(out / protocol.COMPLETED)
    if completed is not None:
        print(f"slurm-gpu: training already completed ({out / protocol.COMPLETED}); not training again", flush=True)
        print(at_start(attempt(out, restart, max_restarts), completed.split("\n")[0]).message, flush=True)
        return 0
    # A spot notice's marker from an attempt that Slurm requeued before the script saw it: stale. Likewise
    # the hang watchdog's (its report was printed by the attempt that found it).
    for stale in (protocol.INTERRUPTED, protocol.HUNG):
        (out / stale).unlink(missing_ok=True)
    return _carry_out(at_start(attempt(out, restart, max_restarts), None))


def end(out: Path, restart: int, max_restarts: int, max_spot_requeues: int, status: int) -> int:
    completed = _text(out / protocol.COMPLETED) is not None
    hung = _text(out / protocol.HUNG) is not None and not completed
    interrupted = _text(out / protocol.INTERRUPTED)
    if hung and interrupted is None:
        try:  # which rank hung and where: the SLURM_GPU_HANG line, for `fab train`
            from training import hangs
            hangs.cli(["report", str(out), str(restart)])
        except Exception as e:  # noqa: BLE001 - the report is a courtesy; the requeue must still happen
            print(f"slurm-gpu: the hang report failed: {e}", file=sys.stderr, flush=True)
        (out / protocol.HUNG).unlink(missing_ok=True)
    decision = after_step(attempt(out, restart, max_restarts, max_spot_requeues), status, completed, interrupted,
                          hung, lambda: lost_nodes(os.environ["SLURM_JOB_NODELIST"]), str(out))
    if decision.spot_note:
        (out / protocol.INTERRUPTED).unlink(missing_ok=True)
    code = _carry_out(decision, out)
    if code == 0 and not decision.requeue:
        print(f"{protocol.prefix(protocol.END)}{json.dumps({'t': time.time()})}", flush=True)
        print("slurm-gpu: training finished", flush=True)
    return code


def _carry_out(d: Decision, out: Path | None = None) -> int:
    if d.message:
        print(d.message, file=sys.stdout if d.code == CONTINUE else sys.stderr, flush=True)
    if not d.requeue:
        return d.code
    if subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]]).returncode == 0:
        if d.spot_note and out is not None:
            with open(out / protocol.SPOT_REQUEUES, "a") as f:
                f.write(d.spot_note + "\n")
        return 0
    print(d.refused[0], file=sys.stderr, flush=True)
    return d.refused[1]


def cli(argv: list[str]) -> int:
    if argv[:1] == ["start"] and len(argv) == 4:
        return start(Path(argv[1]), int(argv[2]), int(argv[3]))
    if argv[:1] == ["end"] and len(argv) == 6:
        return end(Path(argv[1]), *(int(x) for x in argv[2:]))
    print(__doc__.rsplit("Usage", 1)[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
