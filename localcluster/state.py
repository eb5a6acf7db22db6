"""What `fab local.up` made, kept in layout.STATE_FILE so `status` and `down` (a later
`fab` process) know the hosts, their holder processes and namespaces.

`up` saves the state after every step that makes something, so a failed or interrupted
`up` leaves a file from which `down` removes what was made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from localcluster import topology as layout

ROLES = ("controller", "gpu")


class StateFileError(ValueError):
    """The state file exists but cannot be read as one: corrupt, or from an older layout."""


@dataclass(frozen=True)
class HostSpec:
    """A host as planned: the controller (index 0) or gpu-node-i (index i)."""

    name: str
    ip: str
    role: str  # one of ROLES
    index: int

    @property
    def netns(self) -> str:
        return layout.netns_name(self.name)


@dataclass(frozen=True)
class HostEntry(HostSpec):
    """A host once made: its holder process (None until it is ready) and that process's
    namespace ids, which tell the holder from a later process that reused its PID."""

    pid: int | None = None
    ns: tuple[str, ...] = ()

    @classmethod
    def of(cls, spec: HostSpec) -> HostEntry:
        return cls(spec.name, spec.ip, spec.role, spec.index)


@dataclass(frozen=True)
class ClusterState:
    nodes: int  # GPU hosts
    gpus: int  # stand-in GPUs per GPU host
    fresh_keys: bool = False
    idle_stop_s: int = 0  # power saving (0: off); files from before it existed have none
    cred_expire: int | None = None  # AuthInfo=cred_expire; None: plan.CRED_EXPIRE_S
    hosts: tuple[HostEntry, ...] = ()  # made so far, controller first
    made_mount_points: tuple[str, ...] = ()  # made by `up` on the root filesystem; `down` removes them
    started: float = 0.0  # time.time() when `up` began

    @property
    def complete(self) -> bool:
        return len(self.hosts) == self.nodes + 1

    def host(self, name: str) -> HostEntry:
        for entry in self.hosts:
            if entry.name == name:
                return entry
        raise KeyError(f"no host {name!r} in the local cluster (hosts: {', '.join(h.name for h in self.hosts)})")

    def to_json(self) -> str:
        data = asdict(self)
        for host, entry in zip(data["hosts"], self.hosts, strict=True):
            host["netns"] = entry.netns  # for a reader of the file; derived from the name on load
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        """The state in `text`, or StateFileError naming what is wrong with it."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise StateFileError(f"not JSON ({exc})") from None
        _need(isinstance(data, dict), "not a JSON object")
        hosts = _get(data, "hosts", list)
        return cls(
            nodes=_get(data, "nodes", int), gpus=_get(data, "gpus", int),
            fresh_keys=_get(data, "fresh_keys", bool, False), idle_stop_s=_get(data, "idle_stop_s", int, 0),
            cred_expire=_get(data, "cred_expire", (int, type(None)), None),
            hosts=tuple(_host(h, i) for i, h in enumerate(hosts)),
            made_mount_points=tuple(_strings(_get(data, "made_mount_points", list, []), "made_mount_points")),
            started=float(_get(data, "started", (int, float), 0.0)),
        )


_REQUIRED = object()


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise StateFileError(what)


def _get(data: dict, key: str, kind, default=_REQUIRED):
    if key not in data:
        _need(default is not _REQUIRED, f"no {key!r}")
        return default
    value = data[key]
    # bool is an int to isinstance; a count that is true/false is a corrupt file all the same
    _need(isinstance(value, kind) and (kind is bool or not isinstance(value, bool)),
          f"{key!r} is {value!r}")
    return value


def _strings(values: list, key: str) -> list[str]:
    _need(all(isinstance(v, str) for v in values), f"{key!r} holds a non-string")
    return values


def _host(data, i: int) -> HostEntry:
    try:
        _need(isinstance(data, dict), "not an object")
        role = _get(data, "role", str)
        _need(role in ROLES, f"role {role!r} is not one of {', '.join(ROLES)}")
        pid = data.get("pid")
        _need(pid is None or (isinstance(pid, int) and not isinstance(pid, bool)), f"pid {pid!r}")
        return HostEntry(name=_get(data, "name", str), ip=_get(data, "ip", str), role=role,
                         index=_get(data, "index", int), pid=pid, ns=tuple(_strings(_get(data, "ns", list, []), "ns")))
    except StateFileError as exc:
        raise StateFileError(f"hosts[{i}]: {exc}") from None


def load() -> ClusterState | None:
    """The saved state; None when there is no file (no cluster was made, or `down` removed
    it). StateFileError when there is one that cannot be read (corrupt, or written by an
    older version): `fab local.down` removes the cluster all the same, finding it by name."""
    try:
        text = layout.STATE_FILE.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateFileError(f"cannot read {layout.STATE_FILE}: {exc.strerror}") from None
    try:
        return ClusterState.from_json(text)
    except StateFileError as exc:
        raise StateFileError(f"{layout.STATE_FILE} is not a local cluster state this version reads "
                             f"({exc})") from None


def save(state: ClusterState) -> None:
    tmp = layout.STATE_FILE.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(layout.STATE_FILE)
