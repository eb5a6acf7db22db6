"""What `fab local.up` and `fab local.down` check before they touch anything: the option
values, root, the packages the hosts run, and that no other `fab local.*` is at work."""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager

from localcluster import topology as layout

REQUIRED_TOOLS = {
    "ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux", "runuser": "util-linux",
    "munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
}


class ClusterError(RuntimeError):
    """A refusal or failure of `fab local.*`, naming the fix."""


def validate(nodes, gpus) -> tuple[int, int]:
    """Checked option values, or a ClusterError naming the option and the fix."""

    def as_int(value, flag: str, lo: int, hi: int) -> int:
        try:
            number = int(str(value).strip())
        except (TypeError, ValueError):
            number = None
        if number is None or str(number) != str(value).strip().lstrip("+") or not lo <= number <= hi:
            raise ClusterError(f"{flag} must be a whole number from {lo} to {hi} (got {value!r}); "
                               f"e.g. `fab local.up {flag} {lo + 1 if hi > lo else lo}`")
        return number

    return (as_int(nodes, "--nodes", layout.MIN_NODES, layout.MAX_NODES),
            as_int(gpus, "--gpus", layout.MIN_GPUS, layout.MAX_GPUS))


def preflight() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the local cluster needs root (network namespaces): run `sudo fab local.up`")
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if not shutil.which(tool)})
    if missing:
        raise ClusterError(f"missing packages: {', '.join(missing)}; run `bash scripts/setup.sh`")


@contextmanager
def op_lock():
    """One `up`/`down` at a time on this machine."""
    layout.OP_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(layout.OP_LOCK, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError("another `fab local.*` is running; wait for it to finish") from None
        yield
