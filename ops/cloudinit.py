"""Waiting for cloud-init to finish the first boot of every AWS host.

`cloud-init status --format json` says "running" while the bootstrap runs, "done" when
it finished and "error" (with the failing module's message) when it did not. A host
still booting may refuse SSH for a while, which counts as "not yet", not as failure.
"""

from __future__ import annotations

import json
import time

from fabric import Connection

STATUS_CMD = "cloud-init status --format json"
POLL_S = 10.0


class CloudInitFailed(RuntimeError):
    pass


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
            verdict = interpret(out)
            if verdict == "":
                return
            if verdict:
                raise CloudInitFailed(verdict)
            last = "still running"
        time.sleep(poll_s)
    raise CloudInitFailed(f"cloud-init not done after {timeout_s:.0f} s ({last})")
