"""Another apt at first boot: the boot test holds one container's dpkg frontend lock from before it
boots until its bootstrap's `packages` step has waited on it, as unattended upgrades can on a
fresh EC2 instance.

The lock is apt's own: a POSIX record lock (fcntl) on /var/lib/dpkg/lock-frontend, which apt and
dpkg take and which cloud-init polls before it runs apt-get (`_apt_lock_available`, fcntl.lockf, in
cloud-init's cloudinit/distros/package_management/apt.py; it gives up after APT_LOCK_WAIT_TIMEOUT =
30 s). It is taken here from the host through the container's overlay root: the same file system
the container's apt sees, so no change inside the image or the user-data is needed, and it is held
before systemd starts (no race with cloud-init)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bootstrap.node_layout import STEPS_DIR

LOCK = "var/lib/dpkg/lock-frontend"
# Held at least this long after the container starts: longer than cloud-init's 30 s wait. (Its
# package module, where it runs, starts waiting while the lock is held and ends before the
# bootstrap's packages step starts, which the release also waits for: it always sees 30 s held.)
MIN_HOLD_S = 40
# ... and until the node's `packages` step has been waiting this long, so the bootstrap's own wait
# is exercised; never longer than MAX_HOLD_S (a boot that never gets there fails its own tests).
WAIT_IN_STEP_S = 5
MAX_HOLD_S = 300


@dataclass
class AptLockHolder:
    root: Path  # the container's root file system (its overlay mount)
    started: float = 0.0
    released: float = 0.0
    saw_step_waiting: bool = False  # the packages step was running while the lock was held
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def hold(self) -> None:
        """Take the lock now (before the container boots); a thread lets it go later."""
        path = self.root / LOCK
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._keep, args=(fd,), daemon=True, name="apt-lock-holder")
        self._thread.start()

    def _step_running(self) -> bool:
        status = self.root / STEPS_DIR.lstrip("/") / "packages.status"
        try:
            return status.read_text().startswith("running")
        except OSError:
            return False

    def _keep(self, fd: int) -> None:
        waiting_since = None
        try:
            while not self._stop.is_set():
                held = time.monotonic() - self.started
                if self._step_running():
                    self.saw_step_waiting = True
                    waiting_since = waiting_since or time.monotonic()
                waited = time.monotonic() - waiting_since if waiting_since else 0.0
                if held >= MAX_HOLD_S or (held >= MIN_HOLD_S and waited >= WAIT_IN_STEP_S):
                    break
                self._stop.wait(0.5)
        finally:
            os.close(fd)  # closing the descriptor drops the lock
            self.released = time.monotonic()

    @property
    def held_s(self) -> float:
        return round((self.released or time.monotonic()) - self.started, 1)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
