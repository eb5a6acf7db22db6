"""Waiting for cloud-init to finish the first boot of every AWS host, and reading the
bootstrap script's per-step record (node_layout.STEPS_DIR) on every host.

`cloud-init status --format json` says "running" while the bootstrap runs, "done" when
it finished and "error" (with the failing module's message) when it did not. A host
still booting may refuse SSH for a while, which counts as "not yet", not as failure.
"""

from __future__ import annotations

import json
import shlex
import time

from fabric import Connection

from bootstrap.node_layout import STEPS_DIR
from bootstrap.render import BOOTSTRAP_PATH
from cluster.errors import UserError
from ops.say import shown
from ops.ssh.remote import HostError, each

STATUS_CMD = "cloud-init status --format json"
POLL_S = 10.0
TAIL_LINES = 15  # of a failed step's log
# "<step> <status line>" for every step the bootstrap recorded (nothing before it ran).
STEPS_CMD = (f"for f in {shlex.quote(STEPS_DIR)}/*.status; do [ -e \"$f\" ] || continue; "
             "printf '%s %s\\n' \"$(basename \"$f\" .status)\" \"$(head -n 1 \"$f\")\"; done")


class CloudInitFailed(UserError, RuntimeError):
    pass


class BootstrapFailed(CloudInitFailed):
    """A bootstrap step failed on a host: the message names the step and ends with its log."""

    plain_reason = True  # remote.reason shows the message as it is


def parse_steps(text: str) -> dict[str, str]:
    """step -> its status line ("ok 2026-...", "failed exit 1 at line 40 2026-...", ...)."""
    steps = {}
    for line in text.splitlines():
        step, _, status = line.strip().partition(" ")
        if step:
            steps[step] = status
    return steps


def bootstrap_failure(c: Connection) -> str | None:
    """None unless a bootstrap step failed on the host behind `c`; then which step, how, and
    the last lines of its log."""
    steps = parse_steps(c.run(STEPS_CMD, hide=True, warn=True).stdout)
    failed = [(s, st) for s, st in steps.items() if st.startswith("failed")]
    if not failed:
        return None
    step, status = failed[0]
    log = f"{STEPS_DIR}/{step}.log"
    tail = c.run(f"tail -n {TAIL_LINES} {shlex.quote(log)}", hide=True, warn=True).stdout.rstrip()
    lines = "\n".join(f"      | {shown(ln)}" for ln in tail.splitlines()) or "      | (the log is empty)"
    when = status.removeprefix("failed").strip()
    return (f"bootstrap step {step!r} failed ({when}); last lines of {log}:\n{lines}\n"
            f"    fix the cause, then re-run it on the host: sudo {BOOTSTRAP_PATH}")


def bootstrap_failures(conns: dict[str, Connection]) -> dict[str, str]:
    """host -> its failed bootstrap step and the end of that step's log, for the hosts that answer (one
    that cannot be read is not a failed boot: its caller reports it as unreachable)."""
    try:
        found = each("bootstrap status", conns, lambda n, conn: bootstrap_failure(conn))
    except HostError as exc:
        found = {n: None for n in conns if n not in exc.failures}
    return {n: why for n, why in sorted(found.items()) if why}


def check_bootstrap(c: Connection) -> None:
    """Raise BootstrapFailed when a bootstrap step failed on the host behind `c`."""
    failure = bootstrap_failure(c)
    if failure:
        raise BootstrapFailed(failure)


# Any real wall-clock time is after this (2001-09-09); smaller "times" are seconds since boot.
EPOCH_FLOOR = 1_000_000_000


def without_uptime_times(status: dict) -> dict:
    """`cloud-init status --format json` without the times that are not times: newer cloud-init
    records each stage's start/finished as seconds since the kernel booted (cloudinit/cmd/main.py,
    status_wrapper: `float(util.uptime())`) and prints their latest as if it were a unix time
    (cloudinit/cmd/status.py, `last_update`), so Debian 13's 25.1 says 1970 (and in a container
    counts from the machine's boot, not the container's). Those are left out; a real time stays."""
    def real(t) -> bool:
        return isinstance(t, (int, float)) and t >= EPOCH_FLOOR
    stages = {k: v for k, v in status.items() if isinstance(v, dict) and ("start" in v or "finished" in v)}
    bogus = any(t is not None and not real(t) for v in stages.values() for t in (v.get("start"), v.get("finished")))
    if not bogus:
        return status
    out = {k: v for k, v in status.items() if k != "last_update"}
    for k, v in stages.items():
        out[k] = {f: x for f, x in v.items() if f not in ("start", "finished")}
    return out


def interpret(status_json: str) -> str | None:
    """None while cloud-init still runs, "" when it is done, else the error to report."""
    try:
        status = json.loads(status_json)
    except json.JSONDecodeError:
        return None  # half-written output of a host that is still coming up
    state = status.get("status", "")
    errors = [str(e) for e in status.get("errors") or []]
    if state == "done" and not errors:
        return ""
    if state in ("error", "degraded done") or (state == "done" and errors):
        detail = "; ".join(errors) or status.get("detail") or state
        return f"cloud-init {state}: {detail} (see /var/log/cloud-init-output.log on the host)"
    if state == "disabled":
        return "cloud-init is disabled on this host: it was not bootstrapped"
    return None  # "not run", "running"


def wait_done(c: Connection, timeout_s: float = 1800, poll_s: float = POLL_S) -> None:
    """Block until cloud-init is done on the host behind `c`; raise CloudInitFailed on error/timeout."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            # `status` exits non-zero on error; the JSON still says why.
            out = c.run(STATUS_CMD, hide=True, warn=True).stdout
        except Exception as exc:  # noqa: BLE001 - SSH not up yet on a booting host
            last = f"no SSH yet ({type(exc).__name__})"
            c.close()
        else:
            check_bootstrap(c)  # a failed step is reported at once, not waited on
            verdict = interpret(out)
            if verdict == "":
                return
            if verdict:
                raise CloudInitFailed(verdict)
            last = "still running"
        time.sleep(poll_s)
    raise CloudInitFailed(f"cloud-init not done after {timeout_s:.0f} s ({last})")
