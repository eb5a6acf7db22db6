"""Each rank's own phases of a run, with start and end, for metrics.json's `phases` (docs/ARCHITECTURE.md).

A rank records its phases as they happen (imports, data, model_load, trainer, first_step, steps, each
checkpoint, save); at the end every rank's list is gathered to rank 0, which writes them all. Times are the
host's wall clock (Unix seconds), so phases of ranks on different nodes line up as far as their clocks agree
(NTP on AWS).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time


def process_start() -> float:
    """When this process started (Unix seconds): from /proc on Linux, else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class RankPhases:
    """This rank's phases: [{"name", "start", "end", ...}] in the order they ended."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.host = socket.gethostname()
        self.items: list[dict] = []

    def add(self, name: str, start: float, end: float, **extra) -> None:
        self.items.append({"name": name, "start": round(start, 3), "end": round(end, 3), **extra})

    @contextlib.contextmanager
    def phase(self, name: str, **extra):
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time(), **extra)

    def record(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "host": self.host, "phases": self.items}

    def gather(self) -> list[dict] | None:
        """Every rank's record, on rank 0 (None on the others); a collective: every rank calls it."""
        import torch.distributed as dist

        mine = self.record()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [mine]
        everyone: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return sorted(everyone, key=lambda r: r["rank"]) if dist.get_rank() == 0 else None
