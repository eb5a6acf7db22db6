"""One local cluster per machine: the lock every cluster test holds, and a fresh cluster
that is always taken down (and this test's job directories removed) afterwards."""

from __future__ import annotations

import fcntl
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

LOCK = "/tmp/slurm-gpu-cluster.lock"


def _quiet(_msg: str) -> None:
    pass


@contextmanager
def cluster_lock():
    """Hold the machine's local-cluster lock (nobody makes or removes a cluster meanwhile)."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def fresh_cluster(nodes: int = 2, gpus: int = 2, fresh_keys: bool = False, idle_stop_s: int = 0,
                  cred_expire: int | None = None):
    """Yield (inventory, job_dirs) of a new cluster; job_dirs collects /scratch paths to remove.
    cred_expire: see localcluster.lifecycle.up (a shorter requeue wait where no node is lost)."""
    from localcluster import lifecycle as cluster
    from localcluster import topology as layout

    job_dirs: list[str] = []
    with cluster_lock():
        try:
            cluster.down(out=_quiet)  # start clean (also after an earlier crash)
            yield cluster.up(nodes=nodes, gpus=gpus, fresh_keys=fresh_keys, out=_quiet,
                             idle_stop_s=idle_stop_s, cred_expire=cred_expire), job_dirs
        finally:
            try:
                cluster.down(out=_quiet)
            finally:
                for d in job_dirs:
                    shutil.rmtree(layout.SCRATCH / Path(d).relative_to("/scratch"), ignore_errors=True)


def run(c, cmd: str, **kwargs):
    """c.run on a cluster host, quiet, with no stdin forwarded (pytest captures it)."""
    kwargs.setdefault("in_stream", False)
    return c.run(cmd, hide=True, **kwargs)


def wait_for(probe, timeout: float = 60, interval: float = 0.3):
    """probe()'s first truthy value, or its last value once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
