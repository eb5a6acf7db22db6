"""Reaching the hosts of a cluster with Fabric, and acting on a group of them.

The controller is reached directly (public IP on AWS, bridge IP locally); GPU nodes
only through the controller as a jump host, as on AWS where they have no public IP.
Per-host helpers take a `Connection`; `each` runs one on a group and reports every
host that failed in one error instead of stopping at the first.
"""

from __future__ import annotations

import base64
import io
import shlex
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from fabric import Config, Connection
from fabric.runners import Remote
from paramiko import PKey, RejectPolicy
from paramiko.ssh_exception import BadHostKeyException, SSHException

from cluster import targets
from cluster.errors import UserError
from cluster.inventory import Inventory
from ops.say import shown
from ops.ssh import hostkeys

if TYPE_CHECKING:
    from ops.actions.options import ClusterOptions

T = TypeVar("T")
CONNECT_TIMEOUT_S = 20


class HostError(UserError, RuntimeError):
    """One or more hosts failed a step; `failures` maps host name -> reason."""

    def __init__(self, step: str, failures: dict[str, str]):
        self.step, self.failures = step, failures
        lines = "\n".join(f"  {host}: {why}" for host, why in sorted(failures.items()))
        super().__init__(f"{step} failed on {', '.join(sorted(failures))}:\n{lines}")


@dataclass
class Cluster:
    """Open-on-demand connections to every host of an inventory."""

    inventory: Inventory
    controller: Connection
    nodes: dict[str, Connection]  # GPU node name -> connection through the controller

    def close(self) -> None:
        for c in (*self.nodes.values(), self.controller):
            c.close()


class PinnedConnection(Connection):
    """A Fabric connection that accepts only its host's pinned SSH key (ops/ssh/hostkeys.py),
    never an unknown one (Fabric's own default is paramiko's AutoAddPolicy), and never forwards
    the user's SSH agent.

    Agent forwarding would let root on a node (or anyone who became it) sign with the admin's keys
    while fab is connected. Fabric 3 turns it on from ~/.ssh/config's `ForwardAgent yes` whenever
    the connection is given no `forward_agent` ("if ssh_config is present, it wins",
    fabric/connection.py, Connection.__init__), and create_session() then attaches paramiko's
    AgentRequestHandler: so it is passed as False here, and create_session never attaches one."""

    def __init__(self, *args, node_name: str, pins: hostkeys.Pins, **kwargs):
        kwargs["forward_agent"] = False
        super().__init__(*args, **kwargs)
        self.node_name, self.pins = node_name, pins
        self.client.set_missing_host_key_policy(RejectPolicy())

    @property
    def forward_agent(self) -> bool:
        return False

    @forward_agent.setter
    def forward_agent(self, value) -> None:
        if value:
            raise ValueError("fab's connections never forward the SSH agent")

    def create_session(self):
        self.open()
        return self.transport.open_session()  # no AgentRequestHandler, whatever the config says

    def open(self):
        if self.is_connected:
            return None
        expected = self.pins.keys(self.node_name)
        # Under the address used now, so paramiko asks for the pinned key type and compares.
        lookup = self.host if self.port == 22 else f"[{self.host}]:{self.port}"
        store = self.client.get_host_keys()
        for keytype, blob in expected:
            store.add(lookup, keytype, PKey.from_type_string(keytype, base64.b64decode(blob)))
        try:
            return super().open()
        except BadHostKeyException as exc:
            presented = (exc.key.get_name(), exc.key.get_base64())
            raise hostkeys.HostKeyError(hostkeys.mismatch_message(
                self.node_name, self.host, self.pins.path, expected, presented)) from None
        except SSHException as exc:
            if "known_hosts" not in str(exc):
                raise
            # It offered none of the pinned key types: as bad as a wrong key.
            raise hostkeys.HostKeyError(
                f"{self.node_name} ({self.host}) offered no host key of a pinned type "
                f"({', '.join(t for t, _ in expected)}, from {self.pins.path}): do not connect; if the "
                "host was rebuilt, delete its lines from that file and run the command again") from None


class InterruptibleRemote(Remote):
    """Ctrl-C stops a running remote command now: its channel is closed, then the interrupt goes on.

    Fabric (no pty) re-raises the interrupt but first waits for the command's output to end, so
    Ctrl-C during a slow `sinfo` (slurmctld busy) or a long `tail` waited for the command to finish.
    Closing the channel ends that output at once; the remote command ends with its session.
    """

    def send_interrupt(self, interrupt):
        if not self.using_pty and hasattr(self, "channel"):
            self.channel.close()
        super().send_interrupt(interrupt)


def _config() -> Config:
    # Remote commands never read the user's terminal: nothing we run is interactive, and a
    # forwarded stdin breaks under pytest or cron. (The munge key goes in by explicit in_stream.)
    return Config(overrides={"run": {"in_stream": False}, "runners": {"remote": InterruptibleRemote}})


def connect(inv: Inventory, identity: str | None = None) -> Cluster:
    """Connections for `inv` (nothing is opened until the first command)."""
    key = identity or inv.ssh_key_file
    # With a key given, use only it (an agent's keys could lock us out after too many tries).
    kwargs = {"key_filename": [key], "look_for_keys": False, "allow_agent": False} if key else {}
    ctl_ip = inv.controller.public_ip or inv.controller.private_ip
    pins = hostkeys.Pins(inv)
    ctl = PinnedConnection(ctl_ip, user=inv.ssh_user, connect_kwargs=dict(kwargs),
                           connect_timeout=CONNECT_TIMEOUT_S, config=_config(),
                           node_name=inv.controller.name, pins=pins)
    nodes = {
        n.name: PinnedConnection(n.private_ip, user=inv.ssh_user, gateway=ctl, config=_config(),
                                 connect_kwargs=dict(kwargs), connect_timeout=CONNECT_TIMEOUT_S,
                                 node_name=n.name, pins=pins)
        for n in inv.gpu_nodes
    }
    return Cluster(inv, ctl, nodes)


def connect_file(path: str, identity: str | None = None, port: int | None = None) -> Cluster:
    """Connections for the inventory in the JSON file `path` (Inventory.to_json's form), the controller on `port`
    when given: for a host no target names (benchmarks/bench_upload.py against an sshd on loopback)."""
    import json
    from pathlib import Path

    cl = connect(Inventory.from_dict(json.loads(Path(path).read_text())), identity)
    if port:
        cl.controller.port = port
    return cl


@contextmanager
def open_cluster(where: ClusterOptions) -> Iterator[Cluster]:
    """The cluster `where` names, its controller's connection opened (a wrong key or a down host fails
    here, by its own cause, before a task does anything); every connection closed afterwards."""
    cl = connect(targets.load(where.target, where.stack), where.identity)
    try:
        cl.controller.open()
        yield cl
    finally:
        cl.close()


class WholeInput(io.StringIO):
    """Text for a remote command's stdin (`in_stream=`), handed over in one piece. Invoke reads a
    stream that is not a terminal one byte at a time with a 10 ms nap after each: a munge
    credential took 1.5 s to send, a key ~2 s."""

    def read(self, size: int | None = -1) -> str:
        return super().read()


def user_command(c: Connection, cmd: str, user: str) -> str:
    """`cmd` (one program and its arguments) as a command line that runs it as `user` from the login user of
    `c`: as it is for that user, through runuser for root, else `sudo -n` (for a raw channel, where Fabric's
    own sudo, with its password prompt, cannot be used)."""
    if c.user == user:
        return cmd
    if c.user == "root":
        return f"runuser -u {shlex.quote(user)} -- {cmd}"
    return f"sudo -n -u {shlex.quote(user)} -- {cmd}"


def sudo(c: Connection, cmd: str, user: str = "root", **kwargs):
    """Run `cmd` (one program and its arguments) as `user` (root by default): directly when we log in
    as that user (root on the local cluster), through runuser when we are root, else with sudo."""
    kwargs.setdefault("hide", True)
    kwargs.setdefault("echo_stdin", False)
    kwargs.setdefault("in_stream", False)  # never forward the user's terminal
    if c.user == user:
        return c.run(cmd, **kwargs)
    if c.user == "root":
        return c.run(f"runuser -u {shlex.quote(user)} -- {cmd}", **kwargs)
    return c.sudo(cmd, user=user, **kwargs)


def service(c: Connection, inv: Inventory, action: str, name: str, **kwargs):
    """start/stop/restart a daemon (munge, slurmd, slurmctld) on the host behind `c`."""
    cmd = inv.service_cmd.format(action=shlex.quote(action), service=shlex.quote(name))
    return sudo(c, cmd, **kwargs)


# ---------------------------------------------------------------- files on a host (over SFTP or the shell)


def put_bytes(c: Connection, data: bytes, path: str, mode: int | None = None) -> None:
    """Write `data` to `path` on the host, as the login user, over SFTP; then chmod it to `mode` when given.
    The folder must exist and be the login user's to write (a job directory, /tmp)."""
    c.put(io.BytesIO(data), remote=path)
    if mode is not None:
        c.sftp().chmod(path, mode)


def put_text(c: Connection, text: str, path: str, mode: int = 0o644) -> None:
    """Write `text` (UTF-8) to `path` on the host as the login user, mode `mode` (put_bytes)."""
    put_bytes(c, text.encode(), path, mode)


def read_remote(c: Connection, path: str, missing_ok: bool = False) -> str:
    """The text of `path` on the host, read over SFTP as the login user (bytes that are not UTF-8
    replaced: a log line may hold anything). An unreadable or missing file raises OSError, or gives ""
    with `missing_ok` (a job that died before writing its log)."""
    try:
        with c.sftp().open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        if missing_ok:
            return ""
        raise


def exists(c: Connection, path: str) -> bool:
    """Whether `path` exists on the host (`test -e` as the login user)."""
    return c.run(f"test -e {shlex.quote(path)}", hide=True, warn=True).ok


def read_text(c: Connection, path: str) -> str | None:
    """`path`'s text on the host as `cat` gives it to the login user; None when it cannot be read."""
    r = c.run(f"cat {shlex.quote(path)}", hide=True, warn=True)
    return r.stdout if r.ok else None


def install_text(c: Connection, text: str, path: str, mode: int = 0o644) -> None:
    """Write `path` (root, `mode`) keeping its inode: the local cluster bind-mounts some of them.
    Uploaded to /tmp as the login user first, then copied into place as root (sudo)."""
    tmp = f"/tmp/slurm-gpu-{uuid.uuid4().hex[:8]}"
    c.put(io.BytesIO(text.encode()), remote=tmp)
    q, t = shlex.quote(path), shlex.quote(tmp)
    inner = f'mkdir -p "$(dirname {q})" && cat {t} > {q} && chown root:root {q} && chmod {mode:04o} {q}'
    sudo(c, f"sh -c {shlex.quote(inner)}; rc=$?; rm -f {t}; exit $rc")


def reason(exc: BaseException) -> str:
    """A one-line reason for a failure (stderr of a failed command, not a traceback)."""
    from paramiko.ssh_exception import AuthenticationException

    if getattr(exc, "plain_reason", False):  # already says what failed and how to fix it
        return str(exc)
    if isinstance(exc, AuthenticationException):
        return f"the SSH key was refused ({exc}); pass --identity with the cluster's private key"
    result = getattr(exc, "result", None)
    if result is not None:
        err = (result.stderr or result.stdout or "").strip().splitlines()
        tail = err[-1] if err else ""
        return f"`{result.command}` exited {result.exited}" + (f": {shown(tail)}" if tail else "")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def each(step: str, conns: dict[str, Connection], fn: Callable[[str, Connection], T],
         parallel: bool = True) -> dict[str, T]:
    """fn(name, conn) on every host; raise one HostError naming all hosts that failed."""
    results: dict[str, T] = {}
    failures: dict[str, str] = {}

    def one(item):
        name, c = item
        try:
            results[name] = fn(name, c)
        except Exception as exc:  # noqa: BLE001 - reported per host below
            failures[name] = reason(exc)

    for c in conns.values():  # open a shared jump host once, not from racing threads
        gw = getattr(c, "gateway", None)
        if isinstance(gw, Connection) and not gw.is_connected:
            try:
                gw.open()
            except Exception as exc:  # noqa: BLE001
                why = f"cannot reach the jump host: {reason(exc)}"
                raise HostError(step, {f"controller ({gw.host})": why}) from exc
    if parallel and len(conns) > 1:
        with ThreadPoolExecutor(max_workers=min(8, len(conns))) as pool:
            list(pool.map(one, conns.items()))
    else:
        for item in conns.items():
            one(item)
    if failures:
        raise HostError(step, failures)
    return results
