"""Make every GPU node share the controller's munge key, and prove it.

`fab train` and `fab local.up` both call `distribute_key`. The key is read from
the controller into memory only and written to each node through the ssh
channel's stdin: it never touches the local disk, a log, or a command line.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fabric import Connection

from bootstrap.render import NODE_LOCAL_KEY_MARKER
from ops.remote import WholeInput, sudo

KEY_PATH = "/etc/munge/munge.key"
# unmunge pads the field: "STATUS:          Success (0)".
SUCCESS = re.compile(r"^STATUS:\s+Success \(0\)", re.M)


class MungeKeyError(RuntimeError):
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
        raise MungeKeyError(c.host, f"cannot read {KEY_PATH} (exit {r.exited}): {r.stderr.strip()}")
    key = base64.b64decode(r.stdout.strip())
    if len(key) < 32:
        raise MungeKeyError(c.host, f"{KEY_PATH} is too short ({len(key)} bytes)")
    return key


def key_digest(c: Connection) -> str | None:
    """sha256 of a host's key, or None when it has none."""
    r = sudo(c, f"sha256sum {KEY_PATH}", warn=True)
    return r.stdout.split()[0] if r.ok and r.stdout.strip() else None


def install_key(c: Connection, key: bytes, service_cmd: str) -> None:
    """Write the key munge:munge 0400 (atomically, from stdin), drop the node-local key's marker
    (render.NODE_LOCAL_KEY_MARKER) and restart munged.

    One command: every ssh session costs a round trip (and on a namespace host a
    noticeable fraction of a second).
    """
    import base64

    tmp = f"{KEY_PATH}.new"
    restart = service_cmd.format(action="restart", service="munge")
    # The node-local key's marker goes with it: slurmd's drop-in may start slurmd from now on.
    sudo(
        c,
        f"sh -c 'base64 -d | install -o munge -g munge -m 0400 /dev/stdin {tmp}"
        f" && mv -f {tmp} {KEY_PATH} && rm -f {NODE_LOCAL_KEY_MARKER} && {restart}'",
        in_stream=WholeInput(base64.b64encode(key).decode()),
    )


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
