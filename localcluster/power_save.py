"""Power saving on the local cluster: the same slurm.conf keys as AWS, with programs that
stop and start a GPU host's slurmd instead of an EC2 instance (localcluster/power.sh,
installed by files.py).

slurmctld runs the programs as SlurmUser, which may not touch another host's daemons;
they reach each GPU host over SSH with a key of their own that sshd restricts to one
forced command (stop or start slurmd), checking the host key pinned in known_hosts.
"""

from __future__ import annotations

import re
from pathlib import Path

from cluster.facts import PowerSave
from localcluster import topology as layout

SOURCE = Path(__file__).resolve().parent / "power.sh"
SUSPEND = layout.BIN_DIR / "slurm-gpu-suspend"
RESUME = layout.BIN_DIR / "slurm-gpu-resume"
NODE_COMMAND = layout.BIN_DIR / "slurm-gpu-power"  # the key's forced command on GPU hosts
# The AWS controller's power program (bootstrap/render.py): power.sh runs its `start-failed`.
SHARED = layout.BIN_DIR / "slurm-gpu-power.py"
KEY_DIR = layout.STATE / "power"  # SlurmUser's own key (SSH_DIR is root's only)
KEY = KEY_DIR / "id_ed25519"
# A slurmd stops in well under a second and starts (and registers) in about one, so
# the local timeouts are short; slurmctld looks for idle nodes every second.
SUSPEND_TIMEOUT_S = 2
RESUME_TIMEOUT_S = 60
INTERVAL_S = 1
SLURM_USER = "slurm"


# Slurm looks every second locally, so a node stops at most a second late; below 5 s a
# node could stop between the steps of one test.
MIN_IDLE_STOP_S, MAX_IDLE_STOP_S = 5, 86400


class PowerOptionError(ValueError):
    pass


def validate_idle_stop(value) -> int:
    """--idle-stop as a number of seconds (0: off), or an error naming the option and the fix."""
    text = str(value).strip()
    # ASCII digits: isdigit() and int() also take '٣'.
    if not re.fullmatch(r"[0-9]+", text) or (int(text) != 0 and not MIN_IDLE_STOP_S <= int(text) <= MAX_IDLE_STOP_S):
        raise PowerOptionError(
            f"--idle-stop must be 0 (GPU hosts never stop) or {MIN_IDLE_STOP_S}-{MAX_IDLE_STOP_S} seconds "
            f"of idle time (got {value!r}); e.g. `fab local.up --idle-stop 10`")
    return int(text)


def power_save(idle_stop_s: int) -> PowerSave | None:
    """slurm.conf's power saving for `fab local.up --idle-stop SECONDS` (0: none)."""
    if idle_stop_s <= 0:
        return None
    return PowerSave(suspend_time=idle_stop_s, suspend_program=str(SUSPEND), resume_program=str(RESUME),
                     suspend_timeout=SUSPEND_TIMEOUT_S, resume_timeout=RESUME_TIMEOUT_S,
                     provider="local", interval=INTERVAL_S)

