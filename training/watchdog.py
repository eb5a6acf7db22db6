"""Hang watchdog: a rank that completes no optimizer step in time gets every rank's stack written and the job requeued.

A job can hang while every GPU stays busy: a rank stuck in a collective, a dead NFS read, a GPU that stopped
answering. Neither torch nor Slurm ends it soon. torch.distributed's collectives time out after the process
group's timeout (torch/distributed/constants.py: default_pg_timeout 30 min for gloo, default_pg_nccl_timeout
10 min for NCCL; the HF Trainer passes its `ddp_timeout`, 1800 s, to init_process_group, so 30 min for both),
and only where the backend checks it (a rank stuck outside a collective, in a read or a CUDA sync, never
times out). Slurm sees live processes: it ends a job only at its --time limit (unset by `fab train`) or when
a node stops answering (SlurmdTimeout); then it sends SIGTERM and SIGKILL after KillWait (default 30 s).

So each rank (HangWatchdog, a TrainerCallback) keeps a heartbeat: a small JSON file in the node's /dev/shm
(else its temp directory), rewritten as training moves. Moving is an optimizer step ending, a checkpoint
saved, an evaluation or prediction step. The clock runs only between steps of training: after a step that
saves or evaluates it is paused (the pause gets the first step's allowance, progressing on every save/eval
callback) until the next step begins, and so is an evaluation a callback runs (`paused`: EvalEveryCallback).
The deadline (deadline_s) is max(k x the run's own measured step time, a floor);
the first step after the start or a resume (compilation, CUDA warm-up) gets `hang_first_step_s`.

A watcher process per rank (`python -m training.hangs watch`, stdlib only, started by the rank) reads the
heartbeat every second. When the deadline passes it claims the run's HUNG marker, has its rank dump every
thread's Python stack (faulthandler registered on SIGNAL: a C-level handler that writes even while the main
thread is stuck in C code, GIL held or not) and the flight recorder's record of its collectives (torch's
TORCH_FR_BUFFER_SIZE, on gloo and NCCL; a thread in the rank writes it, so only where the stuck thread left
the GIL free), copies them into output_dir/hangs/, waits GRACE_S for the other ranks' watchers (which see the
marker, or get SIGTERM when the step ends, and dump theirs) and kills its rank, unless the rank moved
again meanwhile (then it withdraws the marker and watches on: a slow run is never ended). torchrun then stops the
node's other ranks, srun -K1 ends the step on every node, and the job script (jobs/finetune.sbatch.j2) finds
the marker, prints `python -m training.hangs report`'s SLURM_GPU_HANG line (which rank hung and where,
for `fab train`) and requeues the job like a lost node, within the same restart limit; training resumes from
its last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

from training.hangs import MARKER, POLL_S, SIGNAL, alive, attempt, hang_files

WINDOW = 20  # the measured step time: the median of the last WINDOW steps
# Test-only: "RANK:STEP:SECONDS" makes rank RANK sleep SECONDS ("inf": for ever) when optimizer step
# STEP+1 begins (0: inside the first step), in a job's first attempt only (a requeued job runs clean).
# Inert unless set; no config or flag sets it.
STALL_ENV = "SLURM_GPU_STALL"
LOCAL_PREFIX = "slurm-gpu-watchdog-pid"  # + PID-rankR-: a rank's heartbeat and stacks on its node


def deadline_s(step_times: list[float], k: float, floor_s: float, first_step_s: float, paused: bool = False) -> float:
    """Seconds without progress after which a rank counts as hung.

    `step_times`: the run's measured optimizer steps (the first step after a start or resume excluded);
    none yet, or `paused` (a save or evaluation in progress), gets the first step's allowance.
    """
    measured = statistics.median(step_times[-WINDOW:]) if step_times else 0.0
    moving = max(k * measured, floor_s)
    if paused or not step_times:
        return max(first_step_s, moving)
    return moving


# ---------------------------------------------------------------- in the rank

_HOST = socket.gethostname()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _stall(seconds: float) -> None:
    """Test-only (STALL_ENV): the hang's own frame, which the stacks must name."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(60.0, max(0.0, end - time.monotonic())))


class HangWatchdog(TrainerCallback):
    """Heartbeat of one rank and its watcher process. Put it last among the callbacks: it reads whether the
    step that just ended saves or evaluates from `control`, which the callbacks before it set."""

    def __init__(self, output_dir: str, k: float, floor_s: float, first_step_s: float):
        self.output_dir, self.k, self.floor_s, self.first_step_s = output_dir, k, floor_s, first_step_s
        self.step_times: list[float] = []
        self.paused = False
        self._since = time.time()
        self._first = True
        self._watcher = None
        self._stacks = None
        self._trigger: Path | None = None
        self._fr_thread = None
        self._done = False
        self._last_write = 0.0
        stall = os.environ.get(STALL_ENV, "")
        m = re.fullmatch(r"(\d+):(\d+):(inf|\d+(?:\.\d+)?)", stall)
        self._stall = (int(m[1]), int(m[2]), float(m[3])) if m and attempt() == 0 else None

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def deadline(self) -> float:
        return deadline_s(self.step_times, self.k, self.floor_s, self.first_step_s, self.paused)

    def _beat(self, state, phase: str, force: bool = True) -> None:
        """Rewrite the heartbeat (a local file: a write and a rename, some microseconds); `force` False: at most
        twice a second (evaluation's many prediction steps)."""
        now = time.time()
        if self._heartbeat is None or (not force and now - self._last_write < 0.5):
            return
        self._last_write = now
        body = {"rank": _rank(), "pid": os.getpid(), "host": _HOST, "step": state.global_step,
                "since": self._since, "deadline_s": self.deadline(), "paused": self.paused, "phase": phase,
                "step_s": statistics.median(self.step_times[-WINDOW:]) if self.step_times else None}
        tmp = self._heartbeat.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self._heartbeat)

    _heartbeat: Path | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        import faulthandler
        import subprocess
        import threading

        rank = _rank()
        # Memory-backed where the node has it: the heartbeat is rewritten every step.
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        sweep_dead(Path(shm or tempfile.gettempdir()))
        local = Path(tempfile.mkdtemp(prefix=f"{LOCAL_PREFIX}{os.getpid()}-rank{rank}-", dir=shm))
        self._heartbeat, self._trigger = local / "heartbeat.json", local / "dump-now"
        self._stacks = open(local / "stacks.txt", "w")  # noqa: SIM115 (open while faulthandler may write)
        faulthandler.register(SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._local = local
        self._since = self._step_start = time.time()
        self._first, self.paused, self._paused_s = True, False, 0.0
        self._beat(state, "running")
        stacks, recorder = hang_files(self.output_dir, rank, attempt())
        self._fr_thread = threading.Thread(target=self._dump_flight_recorder_when_asked, args=(recorder,),
                                           name="hang-watchdog-fr", daemon=True)
        self._fr_thread.start()
        self._watcher = subprocess.Popen(
            [sys.executable, "-m", "training.hangs", "watch", str(os.getpid()), str(local),
             str(Path(self.output_dir) / MARKER), str(stacks)],
            cwd=str(Path(__file__).resolve().parents[1]), stdin=subprocess.DEVNULL)

    def _dump_flight_recorder_when_asked(self, path: Path) -> None:
        """The flight recorder's record of this rank's collectives, when the watcher asks (a file appears)."""
        while not self._done:
            if self._trigger is not None and self._trigger.exists():
                write_flight_recorder(path)
                return
            time.sleep(POLL_S)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.enabled and self.paused:
            self.paused, self._since = False, time.time()
            self._step_start, self._paused_s = self._since, 0.0
            self._beat(state, "running")
        if self._stall and _rank() == self._stall[0] and state.global_step == self._stall[1]:
            _stall(self._stall[2])  # test-only (STALL_ENV): inside the step, its clock running

    def on_step_end(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        now = time.time()
        if self._first:  # compilation and warm-up: not the run's step time
            self._first = False
        elif not self.paused:
            self.step_times.append(now - self._step_start - self._paused_s)
            del self.step_times[:-WINDOW]
        self._since = self._step_start = now
        self._paused_s = 0.0
        self.paused = bool(control.should_save or control.should_evaluate)
        self._beat(state, "running")

    @contextlib.contextmanager
    def pause(self, state):
        """Work inside the training loop that is not a step (an evaluation from a callback): the clock gets the
        first step's allowance meanwhile, and the time is not counted in the step's."""
        if not self.enabled:
            yield
            return
        was, start = self.paused, time.time()
        self.paused, self._since = True, start
        self._beat(state, "running")
        try:
            yield
        finally:
            self.paused, self._since = was, time.time()
            self._paused_s += self._since - start
            self._beat(state, "running")

    def _progress(self, state) -> None:
        if self.enabled:
            self._since = time.time()
            self._beat(state, "running", force=False)

    def on_save(self, args, state, control, **kwargs):
        self._progress(state)

    def on_evaluate(self, args, state, control, **kwargs):
        self._progress(state)

    def on_predict(self, args, state, control, **kwargs):
        self._progress(state)

    def on_prediction_step(self, args, state, control, **kwargs):
        self._progress(state)

    def on_train_end(self, args, state, control, **kwargs):
        self.close(state)

    def close(self, state=None) -> None:
        """Stop watching: the heartbeat says done, the watcher process ends, the rank's files go. Idempotent.
        on_train_end calls it; training/train.py calls it again in a `finally`, since a training loop that
        raises never reaches on_train_end, and a watcher left behind would, past its deadline, end the
        process that trained (in-process training: a notebook, a test runner)."""
        if not self.enabled or self._heartbeat is None or self._done:
            return
        import faulthandler

        self._done = True
        if state is not None:
            self._beat(state, "done")
        faulthandler.unregister(SIGNAL)
        if self._watcher is not None:
            self._watcher.terminate()
            try:
                self._watcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._watcher.kill()
                self._watcher.wait()
        self._stacks.close()
        shutil.rmtree(self._local, ignore_errors=True)


def sweep_dead(directory: Path) -> None:
    """Remove the files of ranks that died without cleaning up (killed: a hang, a lost step)."""
    for d in directory.glob(LOCAL_PREFIX + "*"):
        m = re.match(re.escape(LOCAL_PREFIX) + r"(\d+)-", d.name)
        if m and not alive(int(m[1])):
            shutil.rmtree(d, ignore_errors=True)


def paused(trainer, state):
    """`trainer`'s HangWatchdog.pause(state), or nothing to do where it has none."""
    dog = next((c for c in trainer.callback_handler.callbacks if isinstance(c, HangWatchdog)), None)
    return dog.pause(state) if dog is not None else contextlib.nullcontext()


def write_flight_recorder(path: Path) -> bool:
    """torch's flight recorder (its record of this process's recent collectives: which one is pending, on
    which group, since when) as JSON, where TORCH_FR_BUFFER_SIZE (or NCCL's TORCH_NCCL_TRACE_BUFFER_SIZE)
    turned it on. torch 2.13: torch._C._distributed_c10d._dump_fr_trace_json, gloo and NCCL alike."""
    if not (os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")):
        return False
    try:
        from torch._C import _distributed_c10d as c10d

        data = c10d._dump_fr_trace_json(True, False)
    except (ImportError, AttributeError, RuntimeError):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


