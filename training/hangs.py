"""The hang watchdog's watcher process and report (stdlib only: it starts in a moment beside every rank,
and the job script runs the report): see training/watchdog.py for the design.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from training import protocol

MARKER = protocol.HUNG  # in output_dir: the job script reports the hang and requeues when it finds it
HANGS_DIR = "hangs"  # in output_dir: every rank's stack and flight recorder dump, brought home with the run
PREFIX = protocol.prefix(protocol.HANG)  # the job script's line for `fab train` (ops/finetune/joblog.py)
SIGNAL = signal.SIGURG  # faulthandler's "dump your stacks": ignored by default, used by nothing else here
POLL_S = 1.0
GRACE_S = 10.0  # after the marker: time for the other ranks' watchers to see it and dump theirs


def attempt() -> int:
    """This attempt of the job: Slurm's restart count (0 before any requeue)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def hang_files(output_dir: str | Path, rank: int, attempt: int) -> tuple[Path, Path]:
    """(stacks, flight recorder) file of one rank's dump in one attempt of the job."""
    d = Path(output_dir) / HANGS_DIR
    return d / f"stacks-attempt{attempt}-rank{rank}.txt", d / f"flight-recorder-attempt{attempt}-rank{rank}.json"


# ---------------------------------------------------------------- the watcher process (stdlib only)

def start_time(pid: int) -> str | None:
    """When process `pid` started (proc(5): /proc/PID/stat field 22, clock ticks since boot), None where
    there is no /proc. With the pid it names one process: pids are reused (kernel.pid_max can be 32768)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dump(pid: int, local: Path, beat: dict, idle_s: float, stacks: Path) -> None:
    """Have the rank write its stacks (and flight recorder), then copy them, with a header, to `stacks`."""
    (local / "dump-now").touch()
    written = local / "stacks.txt"
    start = written.stat().st_size if written.exists() else 0  # an earlier dump's text stays before it
    try:
        os.kill(pid, SIGNAL)
    except ProcessLookupError:
        return
    before = -1
    for _ in range(20):  # the handler writes synchronously; wait until the file stops growing
        time.sleep(0.25)
        size = written.stat().st_size
        if size == before and size > start:
            break
        before = size
    with open(written, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    header = {key: beat.get(key) for key in ("rank", "host", "pid", "step", "deadline_s", "step_s")}
    header["idle_s"] = round(idle_s, 1)
    stacks.parent.mkdir(parents=True, exist_ok=True)
    stacks.write_text("# " + json.dumps(header) + "\n" + text)


def _moved(local: Path, since: float) -> bool:
    """Whether the rank made progress after `since` (or finished)."""
    beat = _read_json(local / "heartbeat.json") or {}
    return beat.get("phase") == "done" or beat.get("since", since) > since


def watch(pid: int, local: Path, marker: Path, stacks: Path, poll_s: float = POLL_S, grace_s: float = GRACE_S,
          own_process: bool = False) -> str:
    """Watch rank `pid`'s heartbeat until it is done or gone ("done", "gone") or this watcher fires ("fired"):
    past the deadline it claims the marker, dumps the rank, and kills it unless it moves again within `grace_s`
    (then the marker is withdrawn and the watch goes on). Another rank's marker: dump this rank once for it.
    `own_process`: this is the watcher process (it takes SIGTERM, SIGUSR1 and SIGUSR2 for itself)."""
    born = start_time(pid)  # the rank's identity: a pid the kernel hands to another process is not the rank
    dumped_for = [None]  # the marker's text this rank was dumped for
    claimed: list[float] = []  # the heartbeat's `since` when this watcher claimed the marker

    def claim_text() -> str | None:
        try:
            return marker.read_text()
        except OSError:
            return None

    def on_term(_signum, _frame):  # the step ends (srun -K1, scancel): dump too if a hang is being handled
        beat = _read_json(local / "heartbeat.json") or {}
        text = claim_text()
        if text and text != dumped_for[0] and alive(pid):
            _dump(pid, local, beat, time.time() - beat.get("since", time.time()), stacks)
        if claimed and _moved(local, claimed[0]):  # ended in its grace by the rank finishing: no hang
            marker.unlink(missing_ok=True)
        sys.exit(0)

    if own_process:
        signal.signal(signal.SIGTERM, on_term)
        # The spot watcher's signals are for the ranks; should they reach every process of the step
        # (`scancel --signal`), they must not end this one (their default action).
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
    while True:
        if not alive(pid) or start_time(pid) != born:
            return "gone"
        beat = _read_json(local / "heartbeat.json")
        if beat is None:
            time.sleep(poll_s)
            continue
        if beat.get("phase") == "done":
            return "done"
        idle = time.time() - beat["since"]
        text = claim_text()
        if text and text != dumped_for[0]:  # another rank's watcher fired: this rank's stack too
            _dump(pid, local, beat, idle, stacks)
            dumped_for[0] = text
        elif not text and idle > beat["deadline_s"]:
            claim = {key: beat.get(key) for key in ("rank", "host", "step", "deadline_s", "step_s")}
            claim.update(idle_s=round(idle, 1), attempt=attempt(), t=time.time())
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                with open(marker, "x") as f:  # the first rank's watcher to fire writes it
                    f.write(json.dumps(claim) + "\n")
            except FileExistsError:
                continue  # another rank's watcher was first: dump for its marker
            dumped_for[0] = claim_text()
            claimed.append(beat["since"])
            _dump(pid, local, beat, idle, stacks)
            print(f"slurm-gpu: hang watchdog: rank {beat.get('rank')} made no progress for {idle:.0f} s "
                  f"(deadline {beat['deadline_s']:.0f} s) after step {beat.get('step')}; stacks in "
                  f"{stacks.parent}; ending the rank in {grace_s:.0f} s unless it moves", file=sys.stderr, flush=True)
            end = time.monotonic() + grace_s
            while time.monotonic() < end and not _moved(local, beat["since"]):
                time.sleep(poll_s)
            if _moved(local, beat["since"]):  # slow, not hung: never end a moving run
                marker.unlink(missing_ok=True)
                claimed.clear()
                print(f"slurm-gpu: hang watchdog: rank {beat.get('rank')} moved again after "
                      f"{time.time() - beat['since']:.0f} s; not ended", file=sys.stderr, flush=True)
                continue
            if start_time(pid) != born:
                return "gone"
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return "fired"
        time.sleep(poll_s)


# ---------------------------------------------------------------- the report (job script, after the step)

_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+(?: \[[^\]]*\])? \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# Frames of a rank that waits for the others: a collective, or DDP's gradient all-reduce in backward.
_WAITING = re.compile(r"torch/distributed/|torch/autograd/|torch/nn/parallel/distributed\.py")


def main_thread_frames(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (innermost first) in a faulthandler dump: the thread whose outermost frame is
    the program's entry (`<module>`, runpy), else the first thread listed."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if _THREAD.match(line.strip()):
            threads.append([])
        elif (m := _FRAME.match(line)) and threads:
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    for frames in threads:
        if frames and (frames[-1][2] in ("<module>", "_run_module_as_main") or "runpy" in frames[-1][0]):
            return frames
    return threads[0] if threads else []


def _short(path: str) -> str:
    for anchor in ("site-packages/", "/training/"):
        if anchor in path:
            return ("training/" if anchor == "/training/" else "") + path.split(anchor, 1)[1]
    return path


def where(frames: list[tuple[str, int, str]]) -> str:
    """`FILE:LINE in FUNC` of the innermost frame, plus the innermost of our own (training/) when that differs."""
    if not frames:
        return "no Python stack written"
    file, line, func = frames[0]
    text = f"{_short(file)}:{line} in {func}"
    ours = next((f for f in frames if "/training/" in f[0]), None)
    if ours and ours != frames[0]:
        text += f" (from {_short(ours[0])}:{ours[1]} in {ours[2]})"
    return text


def report(output_dir: str | Path, attempt: int) -> dict:
    """Which rank hung and where, from the marker and every rank's stacks of this attempt."""
    out = Path(output_dir)
    marker = _read_json(out / MARKER) or {}
    ranks: dict[int, dict] = {}
    for path in sorted((out / HANGS_DIR).glob(f"stacks-attempt{attempt}-rank*.txt")):
        text = path.read_text(errors="replace")
        first, _, body = text.partition("\n")
        header = json.loads(first[2:]) if first.startswith("# {") else {}
        rank = int(re.search(r"rank(\d+)\.txt$", path.name)[1])
        frames = main_thread_frames(body)
        ranks[rank] = {"host": header.get("host"), "step": header.get("step"), "where": where(frames),
                       "waiting": any(_WAITING.search(f[0]) for f in frames), "stacks": str(path)}
    hung = [r for r, info in sorted(ranks.items()) if not info["waiting"]]
    return {"attempt": attempt, "step": marker.get("step"), "idle_s": marker.get("idle_s"),
            "deadline_s": marker.get("deadline_s"), "fired_by": marker.get("rank"), "hung": hung,
            "ranks": {str(r): info for r, info in sorted(ranks.items())},
            "stacks_dir": str(out / HANGS_DIR)}


def cli(argv: list[str]) -> int:
    if argv[:1] == ["watch"] and len(argv) == 5:
        if watch(int(argv[1]), Path(argv[2]), Path(argv[3]), Path(argv[4]), own_process=True) in ("fired", "gone"):
            shutil.rmtree(argv[2], ignore_errors=True)  # the dead rank's heartbeat and stacks (/dev/shm)
        return 0
    if argv[:1] == ["report"] and len(argv) == 3:
        print(PREFIX + json.dumps(report(argv[1], int(argv[2]))), flush=True)
        return 0
    print("usage: python -m training.watchdog watch PID LOCAL_DIR MARKER STACKS | report OUTPUT_DIR ATTEMPT",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
