"""Make every GPU node share the controller's munge key, and prove it.

`fab train` and `fab local.up` both call `distribute_key`. The key is read from
the controller into memory only and written to each node through the ssh
channel's stdin: it never touches the local disk, a log, or a command line.
Before any node is touched, the controller's key file is proved to be the key its
running munged uses (`check_controller_key`): a file that is not would be copied
over every node's working key.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fabric import Connection

from bootstrap.node_layout import NODE_LOCAL_KEY_MARKER
from cluster.errors import UserError
from ops.ssh.remote import WholeInput, sudo

KEY_PATH = "/etc/munge/munge.key"
CONTROLLER = "controller"  # how every message names it (not by its address)
MUNGE_USER = "munge"  # the packages' munge.service runs munged as this user
# unmunge pads the field: "STATUS:          Success (0)".
SUCCESS = re.compile(r"^STATUS:\s+Success \(0\)", re.M)


class MungeKeyError(UserError, RuntimeError):
    def __init__(self, node: str, message: str):
        super().__init__(f"{node}: {message}")
        self.node = node


@dataclass
class KeySync:
    installed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def read_key(c: Connection) -> bytes:
    """The controller's key, in memory."""
    import base64

    # warn=True: a failure is reported without the command's output (which would be the key).
    r = sudo(c, f"base64 -w0 {KEY_PATH}", warn=True)
    if not r.ok:
        raise MungeKeyError(CONTROLLER, f"cannot read {KEY_PATH} (exit {r.exited}): {r.stderr.strip()}; "
                                        f"no node was changed. {RESTORE}")
    key = base64.b64decode(r.stdout.strip())
    if len(key) < 32:  # munged's own minimum (MUNGE_KEY_LEN_MIN_BYTES, dun/munge src/libcommon/munge_defs.h)
        raise MungeKeyError(CONTROLLER, f"{KEY_PATH} is too short ({len(key)} bytes; munge needs 32 or more); "
                                        f"no node was changed. {RESTORE}")
    return key


RESTORE = (f"Put the key the controller's munged runs with back at {KEY_PATH} "
           "(a file, munge:munge, mode 0400), then run this again")

# Whether the key FILE is the key the RUNNING munged uses. `munge -n | unmunge` on the controller
# cannot tell: both ends are the running daemon, whatever the file now holds, and restarting munged
# to load the file would make a wrong file the cluster's key. So a throwaway munged is started on a
# private socket with the key file (nothing else on the host changes) and decodes a credential of
# the running one: decoding checks the credential's MAC, keyed from the key file
# (dun/munge src/munged/dec.c, dec_validate_mac), so it succeeds only when both hold the same key.
# The throwaway runs as munged's user (munged refuses a key file another user owns) in a directory
# others may enter (munged insists its socket's directory is), and is stopped before the directory
# goes. Prints unmunge's STATUS line, or "NO-PROBE: why" when the throwaway cannot start.
PROBE = f"""d=$(mktemp -d /tmp/slurm-gpu-munge-probe.XXXXXX) || exit 3
stop() {{
  p=$(cat "$d/pid" 2>/dev/null) && kill "$p" 2>/dev/null &&
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  rm -rf "$d"
}}
trap stop EXIT
chown {MUNGE_USER}:{MUNGE_USER} "$d" && chmod 0711 "$d" || exit 3
if ! setpriv --reuid={MUNGE_USER} --regid={MUNGE_USER} --init-groups munged --socket="$d/socket" \
    --key-file={KEY_PATH} --pid-file="$d/pid" --seed-file="$d/seed" --log-file="$d/log" 2>"$d/err"; then
  echo "NO-PROBE: $(tail -n 1 "$d/err")"; exit 0
fi
cred=$(munge -n 2>&1) || {{ echo "NO-RUNNING: $cred"; exit 0; }}
printf '%s\n' "$cred" | unmunge --socket="$d/socket" 2>&1 | grep -m 1 -E 'STATUS|unmunge:'
exit 0
"""


def check_controller_key(c: Connection, service_cmd: str) -> None:
    """Raise MungeKeyError naming the controller unless its key file is the key its running
    munged uses (see PROBE); nothing on any host changes either way."""
    r = sudo(c, f"sh -c {shlex.quote(PROBE)}", warn=True)
    line = " ".join(r.stdout.strip().split())
    if r.ok and SUCCESS.search(r.stdout):
        return
    restart = service_cmd.format(action="restart", service="munge")
    if line.startswith("NO-RUNNING:"):
        why = (f"its munged does not answer ({line.removeprefix('NO-RUNNING:').strip()}); no node was changed. "
               f"Start munge there (`{restart}`) and run this again")
    elif line.startswith("NO-PROBE:"):
        why = (f"munged cannot use {KEY_PATH} ({line.removeprefix('NO-PROBE:').strip()}), so restarting munge "
               f"there would fail; no node was changed. {RESTORE}")
    elif "Invalid credential" in line:
        why = (f"{KEY_PATH} is not the key its running munged uses (a credential of the running munged "
               f"does not decode with the file: {line}); no node was changed, they would all have lost "
               f"their working key. If the file is the key you mean the cluster to use, restart munge "
               f"there (`{restart}`) and run this again. If it is not: {RESTORE}")
    else:
        why = (f"cannot check that {KEY_PATH} is the key its munged uses (exit {r.exited}: "
               f"{line or r.stderr.strip() or 'no output'}); no node was changed")
    raise MungeKeyError(CONTROLLER, why)


def key_digest(c: Connection) -> str | None:
    """sha256 of a host's key, or None when it has none."""
    r = sudo(c, f"sha256sum {KEY_PATH}", warn=True)
    return r.stdout.split()[0] if r.ok and r.stdout.strip() else None


def install_key(c: Connection, key: bytes, service_cmd: str) -> None:
    """Write the key munge:munge 0400 (atomically, from stdin), drop the node-local key's marker
    (node_layout.NODE_LOCAL_KEY_MARKER) and restart munged.

    One command: every ssh session costs a round trip (and on a namespace host a
    noticeable fraction of a second).
    """
    import base64

    tmp = f"{KEY_PATH}.new"
    restart = service_cmd.format(action="restart", service="munge")
    # The node-local key's marker goes with it: slurmd's drop-in may start slurmd from now on.
    inner = (f"base64 -d | install -o munge -g munge -m 0400 /dev/stdin {shlex.quote(tmp)}"
             f" && mv -f {shlex.quote(tmp)} {shlex.quote(KEY_PATH)} && rm -f {shlex.quote(NODE_LOCAL_KEY_MARKER)}"
             f" && {restart}")  # restart: the inventory's service_cmd, a command by design
    sudo(c, f"sh -c {shlex.quote(inner)}", in_stream=WholeInput(base64.b64encode(key).decode()))


def make_credential(c: Connection) -> str:
    return sudo(c, "munge -n").stdout.strip()


def decodes(c: Connection, credential: str) -> tuple[bool, str]:
    """Whether this host's munged decodes `credential`; with unmunge's STATUS line."""
    r = sudo(c, "unmunge", in_stream=WholeInput(credential + "\n"), warn=True)
    status = next((ln for ln in (r.stdout + r.stderr).splitlines() if "STATUS" in ln or "unmunge:" in ln), "")
    return bool(r.ok and SUCCESS.search(r.stdout)), " ".join(status.split())


def _named(nodes: Mapping[str, Connection] | Sequence[Connection]) -> dict[str, Connection]:
    return dict(nodes) if isinstance(nodes, Mapping) else {c.host: c for c in nodes}


def distribute_key(
    controller: Connection,
    nodes: Mapping[str, Connection] | Sequence[Connection],
    service_cmd: str,
    *,
    settle_s: float = 10.0,
) -> KeySync:
    """Give every node the controller's key; returns which were installed/skipped.

    Raises MungeKeyError naming the first node that failed (install or proof).
    """
    named = _named(nodes)
    key = read_key(controller)
    check_controller_key(controller, service_cmd)  # before any node is touched
    want = hashlib.sha256(key).hexdigest()
    credential = make_credential(controller)
    result = KeySync()

    def sync(item):
        name, c = item
        try:
            installed = key_digest(c) != want
            if installed:
                install_key(c, key, service_cmd)
        except Exception as exc:  # report the node, not a bare ssh traceback
            raise MungeKeyError(name, f"installing the munge key failed: {exc}") from exc
        prove(name, c, credential, settle_s=settle_s)
        return name, installed

    # Parallel over nodes: each has its own (gateway) connection.
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(named)))) as pool:
        for name, installed in pool.map(sync, named.items()):
            (result.installed if installed else result.skipped).append(name)
    key = b""  # drop our reference to the secret
    return result


def prove(name: str, c: Connection, credential: str, *, settle_s: float = 10.0) -> None:
    """`credential` (made on the controller) must decode on node `c`.

    A just-restarted munged may need a moment before it answers, so the node is
    retried for up to `settle_s` seconds before it is reported.
    """
    deadline = time.monotonic() + settle_s
    while True:
        ok, status = decodes(c, credential)
        if ok:
            return
        if time.monotonic() > deadline or "Replayed" in status:
            raise MungeKeyError(
                name,
                f"cannot decode the controller's munge credential ({status or 'no status'}); "
                f"its key differs from the controller's or munged is not running",
            )
        time.sleep(0.2)
