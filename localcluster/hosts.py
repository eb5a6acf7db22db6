"""Hosts: one persistent holder process per host, in its own net, UTS and mount
namespaces; everything else in a host is started with `nsenter -t <holder>`.

The holder names the host and makes its private mounts (a tmpfs on /run, per-host
/etc/munge, spool and log dirs, the cluster's /etc/slurm and /scratch), then
sleeps. The mounts live only in the holder's mount namespace, so they disappear
with the host's last process and never show in the root namespace.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NS_KINDS = ("net", "mnt", "uts")
# Holders started by this process, reaped by `reap` once killed.
_children: list[subprocess.Popen] = []


class HostSetupError(RuntimeError):
    pass


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str


def holder_script(hostname: str, mounts: list[Mount]) -> str:
    q = shlex.quote
    lines = [
        "set -e",
        f"hostname {q(hostname)}",
        # A private /run: munged's socket and pid files, sshd's privsep dir, the
        # slurm pid files - one set per host.
        "mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run",
        "install -d -m 0755 -o munge -g munge /run/munge",
        "install -d -m 0755 /run/sshd",
        "install -d -m 1777 /run/lock /run/shm",
    ]
    lines += [f"mount --bind {q(str(m.source))} {q(m.target)}" for m in mounts]
    lines += ["echo ready", "exec sleep infinity >/dev/null 2>&1 </dev/null"]
    return "\n".join(lines)


def start_holder(hostname: str, netns: Path, mounts: list[Mount], log: Path) -> subprocess.Popen:
    """Start the holder; `wait_ready` returns its PID once the mounts are made."""
    cmd = [
        "nsenter", f"--net={netns}",
        "unshare", "--uts", "--mount", "--propagation", "private",
        "sh", "-c", holder_script(hostname, mounts),
    ]
    with open(log, "ab") as err:
        # Own session: the host outlives the `fab` process that made it.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
            start_new_session=True,
        )
    _children.append(proc)
    return proc


def wait_ready(proc: subprocess.Popen, hostname: str, log: Path) -> int:
    line = proc.stdout.readline().decode().strip()
    proc.stdout.close()
    if line != "ready":
        proc.wait(timeout=5)
        detail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
        raise HostSetupError(f"host {hostname}: holder failed to set up its mounts: {' | '.join(detail)}")
    return proc.pid


def ns_ids(pid: int) -> dict[str, str]:
    """{"net": "net:[4026...]", ...} of a process (empty if it is gone)."""
    ids = {}
    for kind in NS_KINDS:
        try:
            ids[kind] = os.readlink(f"/proc/{pid}/ns/{kind}")
        except OSError:
            return {}
    return ids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def nsenter_argv(pid: int, argv: list[str]) -> list[str]:
    return ["nsenter", "-t", str(pid), "--net", "--uts", "--mount", "--", *argv]


def run(pid: int, argv: list[str], *, check: bool = True, timeout: float = 60,
        input: str | None = None, host: str = "") -> subprocess.CompletedProcess:
    """Run argv inside the host whose holder is `pid`; output captured."""
    proc = subprocess.run(
        nsenter_argv(pid, argv), capture_output=True, text=True, timeout=timeout,
        input=input, stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-5:]
        raise HostSetupError(
            f"host {host or pid}: `{' '.join(argv)}` exited {proc.returncode}: {' | '.join(out)}"
        )
    return proc


def processes_in(ns: set[str]) -> list[int]:
    """PIDs of every process in any of the given namespaces (by "net:[ino]" ids)."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        for kind in NS_KINDS:
            try:
                if os.readlink(f"/proc/{entry}/ns/{kind}") in ns:
                    found.append(int(entry))
                    break
            except OSError:
                break
    return found


def kill_all(ns: set[str], grace: float = 2.0) -> list[int]:
    """TERM every process in `ns`, KILL what is left after `grace` s; returns survivors."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
        pids = [p for p in processes_in(ns) if alive(p)]
        if not pids:
            return []
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(alive(p) for p in processes_in(ns)):
                return []
            time.sleep(0.05)
    return [p for p in processes_in(ns) if alive(p)]


def reap() -> None:
    """Collect holders of this process that have exited (no zombies left behind)."""
    for proc in list(_children):
        if proc.poll() is not None:
            _children.remove(proc)
