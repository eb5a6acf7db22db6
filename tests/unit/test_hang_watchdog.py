"""The hang watchdog (training/watchdog.py, training/hangs.py): its deadline, its pauses, the watcher process on a
real stuck process, and real 2-rank gloo runs where one rank blocks (every rank's stack written, naming the
blocking frame) or takes long over its first step (left alone)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ops.finetune.joblog import JobLog
from tests.unit.test_training_run import ABORT, tiny, torchrun  # noqa: F401 (tiny: the module's fixture)
from training import hangs, watchdog
from training.watchdog import deadline_s

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the deadline

def test_no_step_measured_yet_gets_the_first_step_allowance():
    assert deadline_s([], k=10, floor_s=600, first_step_s=1800) == 1800
    # An allowance below what the floor gives is raised to it: the first step is never held to less.
    assert deadline_s([], k=10, floor_s=600, first_step_s=60) == 600


def test_the_deadline_is_k_times_the_measured_step_or_the_floor():
    assert deadline_s([2.0] * 5, k=10, floor_s=5, first_step_s=1800) == 20.0
    assert deadline_s([0.3] * 5, k=10, floor_s=600, first_step_s=1800) == 600  # fast steps: the floor
    # The median: one slow step (a checkpoint's stall, a GC pause) does not move it.
    assert deadline_s([1.0, 1.0, 90.0, 1.0, 1.0], k=10, floor_s=5, first_step_s=1800) == 10.0
    # Only the last WINDOW steps: a run that slowed down (longer rows, a throttled GPU) gets a longer deadline.
    assert deadline_s([1.0] * 50 + [4.0] * watchdog.WINDOW, k=10, floor_s=5, first_step_s=1800) == 40.0


def test_a_pause_for_a_save_or_an_evaluation_gets_the_first_step_allowance():
    assert deadline_s([2.0] * 5, k=10, floor_s=5, first_step_s=1800, paused=True) == 1800
    assert deadline_s([300.0] * 5, k=10, floor_s=5, first_step_s=1800, paused=True) == 3000


class Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


def test_the_clock_runs_between_steps_and_pauses_for_saves_and_evaluations(monkeypatch):
    """The callback's own bookkeeping, event by event: the first step is not measured, a step that saves
    pauses the clock (the first step's allowance) until the next step begins, a save or an evaluation step
    is progress, and the step after a pause is measured from its own start."""
    clock = Clock()
    monkeypatch.setattr(watchdog.time, "time", clock.time)
    dog = watchdog.HangWatchdog("/nowhere", k=10, floor_s=5, first_step_s=1800)
    state = SimpleNamespace(global_step=0)
    go, save = SimpleNamespace(should_save=False, should_evaluate=False), SimpleNamespace(should_save=True,
                                                                                       should_evaluate=False)
    clock.now += 400  # the first step: compilation
    dog.on_step_end(None, state, go)
    assert dog.step_times == [] and dog.deadline() == 1800
    for _ in range(3):
        clock.now += 2
        dog.on_step_end(None, state, go)
    assert dog.step_times == [2, 2, 2] and dog.deadline() == 20
    clock.now += 2
    dog.on_step_end(None, state, save)  # this step saves: the clock pauses
    assert dog.paused and dog.deadline() == 1800
    clock.now += 500  # a long save
    dog.on_save(None, state, go)
    assert dog._since == clock.now  # the save counted as progress
    clock.now += 30  # the next batch is read
    dog.on_step_begin(None, state, go)
    assert not dog.paused and dog.deadline() == 20
    clock.now += 2
    dog.on_step_end(None, state, go)
    assert dog.step_times == [2, 2, 2, 2, 2]  # neither the save nor the read counted as a step
    evaluate = SimpleNamespace(should_save=False, should_evaluate=True)
    dog.on_step_end(None, state, evaluate)
    clock.now += 100
    dog.on_prediction_step(None, state, go)  # each evaluation batch is progress
    assert dog.paused and dog._since == clock.now
    dog.on_step_begin(None, state, go)
    # An evaluation from a callback inside the step (EvalEveryCallback): paused, and not part of the step's time.
    clock.now += 1
    with dog.pause(state):
        assert dog.paused and dog.deadline() == 1800
        clock.now += 700
    assert not dog.paused and dog._since == clock.now
    clock.now += 1
    dog.on_step_end(None, state, go)
    assert dog.step_times[-1] == 2 and dog.deadline() == 20


def test_off_with_factor_0():
    dog = watchdog.HangWatchdog("/nowhere", k=0, floor_s=600, first_step_s=1800)
    assert not dog.enabled
    dog.on_train_begin(None, SimpleNamespace(global_step=0), None)
    assert dog._watcher is None and dog._heartbeat is None


# ---------------------------------------------------------------- the watcher, on a real stuck process

_STUCK = """
import faulthandler, signal, sys, time
f = open(sys.argv[1], "w")
faulthandler.register(signal.SIGURG, file=f, all_threads=True, chain=False)
def stuck_reading_nfs():
    print("ready", flush=True)
    time.sleep(600)
stuck_reading_nfs()
"""


def test_the_watcher_dumps_the_stuck_process_stack_claims_the_marker_and_ends_it(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _STUCK, str(local / "stacks.txt")], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        beat = {"rank": 3, "pid": child.pid, "host": "gpu-node-02", "step": 7, "since": time.time() - 100,
                "deadline_s": 20.0, "step_s": 2.0, "phase": "running"}
        (local / "heartbeat.json").write_text(json.dumps(beat))
        marker, stacks = tmp_path / "run" / hangs.MARKER, tmp_path / "run" / "hangs" / "stacks-attempt0-rank3.txt"
        assert hangs.watch(child.pid, local, marker, stacks, poll_s=0.1, grace_s=0.1) == "fired"
        assert child.wait(timeout=30) == -9  # ended, so the job step ends and requeues
    finally:
        child.kill()
    claim = json.loads(marker.read_text())
    assert claim["rank"] == 3 and claim["step"] == 7 and claim["deadline_s"] == 20.0 and claim["idle_s"] >= 100
    text = stacks.read_text()
    assert json.loads(text.splitlines()[0][2:])["host"] == "gpu-node-02"
    frames = hangs.main_thread_frames(text)
    assert frames[0][2] == "stuck_reading_nfs", text
    assert (local / "dump-now").exists()  # the rank's flight recorder thread is asked too


def test_a_rank_that_moves_again_within_the_grace_is_not_ended(tmp_path):
    """Slow, not hung: past its deadline the watcher dumps the rank, but the rank's next heartbeat comes within
    the grace: the marker is withdrawn, the rank lives, the watch goes on until the rank is done."""
    import threading

    local = tmp_path / "local"
    local.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _STUCK, str(local / "stacks.txt")], stdout=subprocess.PIPE,
                             text=True)
    marker = tmp_path / hangs.MARKER
    beat = {"rank": 1, "pid": child.pid, "step": 0, "since": time.time() - 100, "deadline_s": 20.0,
            "phase": "running"}
    (local / "heartbeat.json").write_text(json.dumps(beat))

    def move_on():
        while not (tmp_path / "s.txt").exists():  # the watcher fired and dumped
            time.sleep(0.05)
        (local / "heartbeat.json").write_text(json.dumps({**beat, "step": 1, "since": time.time()}))
        while marker.exists():
            time.sleep(0.05)
        (local / "heartbeat.json").write_text(json.dumps({**beat, "step": 1, "since": time.time(), "phase": "done"}))

    mover = threading.Thread(target=move_on, daemon=True)
    try:
        assert child.stdout.readline() == "ready\n"
        mover.start()
        assert hangs.watch(child.pid, local, marker, tmp_path / "s.txt", poll_s=0.1, grace_s=30) == "done"
        assert child.poll() is None and not marker.exists()
    finally:
        child.kill()
        child.wait()


def _idle_rank(tmp_path, phase: str):
    """A live process standing in for a rank, its heartbeat 100 s old (deadline 20 s) in phase `phase`."""
    local = tmp_path / "local"
    local.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    beat = {"rank": 0, "pid": child.pid, "since": time.time() - 100, "deadline_s": 20.0, "phase": phase}
    (local / "heartbeat.json").write_text(json.dumps(beat))
    return local, child


def test_the_watcher_leaves_a_moving_or_finished_rank_alone(tmp_path):
    local, child = _idle_rank(tmp_path, "done")
    try:
        assert hangs.watch(child.pid, local, tmp_path / hangs.MARKER, tmp_path / "s.txt", poll_s=0.1) == "done"
        assert child.poll() is None and not (tmp_path / hangs.MARKER).exists()
    finally:
        child.kill()
        child.wait()
    assert hangs.watch(child.pid, local, tmp_path / hangs.MARKER, tmp_path / "s.txt", poll_s=0.1) == "gone"


def test_files_of_dead_ranks_are_swept_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{watchdog.LOCAL_PREFIX}{dead.pid}-rank0-x"
    live = tmp_path / f"{watchdog.LOCAL_PREFIX}{os.getpid()}-rank1-y"
    for d in (gone, live):
        d.mkdir()
        (d / "heartbeat.json").write_text("{}")
    watchdog.sweep_dead(tmp_path)
    assert not gone.exists() and live.exists()


# ---------------------------------------------------------------- fab train's line

def test_fab_train_names_the_hung_rank_and_where():
    report = {"attempt": 0, "step": 4, "idle_s": 31.2, "deadline_s": 30.0, "fired_by": 3, "hung": [3],
              "ranks": {"0": {"host": "gpu-node-01", "where": "torch/distributed/distributed_c10d.py:2950 in "
                              "all_reduce", "waiting": True},
                        "3": {"host": "gpu-node-02", "where": "training/data.py:88 in read_rows", "waiting": False}},
              "stacks_dir": "/scratch/j/output/hangs"}
    log = JobLog()
    # The job script's own line: at the start of a line, no srun label.
    (event,) = log.feed("slurm-gpu: something else\nSLURM_GPU_HANG " + json.dumps(report) + "\n")
    line = log.describe(event)
    assert line.startswith("hang: no training progress for 31 s (deadline 30 s) after step 4; rank 3 on "
                           "gpu-node-02 hung at training/data.py:88 in read_rows; rank 0 waiting for it "
                           "(torch/distributed/distributed_c10d.py:2950 in all_reduce)"), line
    assert "/scratch/j/output/hangs" in line and log.hangs == [report]


# ---------------------------------------------------------------- real runs: 2 gloo ranks on CPU

WATCHDOG = ("--hang_timeout_floor_s", "5", "--hang_first_step_s", "60")


@pytest.mark.slow
def test_a_blocked_rank_is_caught_and_every_ranks_stack_names_where(tiny, tmp_path):  # noqa: F811
    """Rank 1 blocks for ever when step 4 begins (the test-only SLURM_GPU_STALL); rank 0 waits for it in a
    collective. The watchdog fires within its deadline (not the 30 min of the collective's timeout), every
    rank's stack and flight recorder is in output_dir/hangs/, the report names rank 1 and the blocking frame."""
    out = tmp_path / "out"
    proc = torchrun(tiny, out, "--max_steps", "40", *WATCHDOG, timeout=400,
                    env={watchdog.STALL_ENV: "1:3:inf", "TORCH_FR_BUFFER_SIZE": "200"})
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (out / "metrics.json").exists()
    claim = json.loads((out / hangs.MARKER).read_text())
    assert claim["step"] == 3 and claim["deadline_s"] < 60, claim  # measured steps: not the first-step allowance
    assert "slurm-gpu: hang watchdog: rank" in proc.stderr
    report = hangs.report(out, 0)
    assert report["hung"] == [1], report
    assert report["ranks"]["1"]["where"].startswith("training/watchdog.py:") and \
        report["ranks"]["1"]["where"].endswith(" in _stall"), report
    assert report["ranks"]["0"]["waiting"] and "torch/" in report["ranks"]["0"]["where"], report
    for rank in (0, 1):
        stacks, recorder = hangs.hang_files(out, rank, 0)
        assert "Current thread" in stacks.read_text() or "Thread 0x" in stacks.read_text()
        entries = json.loads(recorder.read_text())["entries"]
        assert any(e["profiling_name"].startswith("gloo:") for e in entries), entries[-3:]
    # The job script's command prints the line fab train reads.
    printed = subprocess.run([sys.executable, "-m", "training.hangs", "report", str(out), "0"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    assert printed.startswith(hangs.PREFIX) and json.loads(printed[len(hangs.PREFIX):])["hung"] == [1]


@pytest.mark.slow
def test_a_long_first_step_and_checkpoints_are_left_alone(tiny, tmp_path):  # noqa: F811
    """Rank 1 takes 12 s over its first step (compilation's stand-in), past the 5 s floor but inside the first
    step's allowance, and the run checkpoints every 5 steps: the watchdog leaves it alone, the run completes,
    its watcher processes end with it."""
    out = tmp_path / "out"
    proc = torchrun(tiny, out, "--max_steps", "8", *WATCHDOG, timeout=400, env={watchdog.STALL_ENV: "1:0:12"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["train_steps"] == 8
    assert not (out / hangs.MARKER).exists() and not (out / hangs.HANGS_DIR).exists()
    assert "hang watchdog" not in proc.stderr and ABORT not in proc.stderr
    left = subprocess.run(["pgrep", "-f", f"training.hangs watch .* {out}/HUNG"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


# ---------------------------------------------------------------- the watcher never outlives its rank's training


def _watchers_of(pid: int) -> list[int]:
    """Watcher processes (`python -m training.hangs watch PID ...`) watching process `pid`."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.hangs" in argv and b"watch" in argv and str(pid).encode() in argv:
            found.append(int(p.name))
    return found


def test_training_that_raises_in_process_leaves_no_watcher(tiny, tmp_path, monkeypatch):  # noqa: F811
    """A training loop that raises never reaches on_train_end: train.py's `finally` still ends the watcher.
    Left behind, it would watch this process (in-process training: a test runner, a notebook) and, past its
    deadline, end it."""
    from tests.unit.test_training_run import argv_for
    from training import train

    begin = watchdog.HangWatchdog.on_step_begin

    def boom(self, *a, **k):
        begin(self, *a, **k)
        assert _watchers_of(os.getpid()), "the watcher runs while training"
        raise RuntimeError("boom in a training step")

    monkeypatch.setattr(watchdog.HangWatchdog, "on_step_begin", boom)
    with pytest.raises(RuntimeError, match="boom in a training step"):
        train.main(argv_for(tiny, tmp_path / "out"))
    deadline = time.time() + 15
    while _watchers_of(os.getpid()) and time.time() < deadline:
        time.sleep(0.2)
    assert not _watchers_of(os.getpid())


@pytest.mark.parametrize("births", [["100", "555"], ["100", "100", "555"]], ids=["while watching", "before ending"])
def test_a_pid_that_names_another_process_now_is_never_ended(tmp_path, monkeypatch, births):
    """Pids are reused (kernel.pid_max 32768 here): once the rank's pid names a process that started at another
    time, the watcher stops, past its deadline or not, and signals nothing."""
    local, child = _idle_rank(tmp_path, "running")
    try:
        (local / "stacks.txt").write_text("")  # where the rank's faulthandler would write
        told = iter(births)  # the rank's start time, then another process's
        monkeypatch.setattr(hangs, "start_time", lambda pid: next(told, "555"))
        assert hangs.watch(child.pid, local, tmp_path / hangs.MARKER, tmp_path / "s.txt", poll_s=0.1,
                           grace_s=0.1) == "gone"
        assert child.poll() is None  # not signalled
    finally:
        child.kill()
        child.wait()
    assert hangs.start_time(os.getpid()) == hangs.start_time(os.getpid()) is not None
