"""The Target base class and the registry of targets (cluster/targets/__init__.py registers aws and local)."""


from __future__ import annotations

from typing import ClassVar

from cluster.inventory import Inventory
from cluster.platform import Platform


class TargetError(ValueError):
    pass


class Target:
    name: ClassVar[str]
    # What --target NAME means, for help and error messages.
    describe: ClassVar[str]
    # The OS and Slurm its hosts run (cluster/platform.py); the inventory's facts say which one a cluster has.
    platforms: ClassVar[tuple[Platform, ...]]
    # The cluster cannot reach the Hugging Face Hub: model and data must be paths on it.
    hub_offline: ClassVar[bool]
    # Hosts finish booting through cloud-init (fab waits for it).
    cloud_init: ClassVar[bool]
    # --stack (a Pulumi stack name) selects among clusters of this target.
    takes_stack: ClassVar[bool]
    # Bootstrap steps its hosts never run (SLURM_GPU_SKIP_STEPS), per role; `fab update-nodes` skips them too.
    skip_steps: ClassVar[dict[str, tuple[str, ...]]] = {}
    # The rendered files `fab update-nodes` may install on a node (None: all of them).
    update_paths: ClassVar[tuple[str, ...] | None] = None
    # The interface gloo's traffic must use on every node (GLOO_SOCKET_IFNAME; None: gloo's own
    # choice, the host name's address). The network check names a node that lacks it.
    gloo_ifname: ClassVar[str | None] = None
    # CPU targets: the network check has a measured figure of this cluster's own network to expect
    # (ops/data/local.json); without one it reports figures and judges transports only.
    measured_network: ClassVar[bool] = False
    # What `fab train` says while it starts GPU nodes that power saving stopped (None: no figure of
    # its own, ops/actions/node_power.py's default).
    power_up_time: ClassVar[str | None] = None

    def load(self, stack: str | None) -> Inventory:
        raise NotImplementedError

    @property
    def real_gpus(self) -> bool:
        """The GPUs are real (nvidia-smi lists them) rather than stand-in files: its platforms ship a driver."""
        return self._platforms_say("real_gpus", lambda p: p.real_gpus)

    @property
    def nccl_efa(self) -> bool:
        """Ranks talk NCCL through the aws-ofi-nccl EFA plugin (else gloo on CPU): its platforms ship it."""
        return self._platforms_say("nccl_efa", lambda p: p.ofi_nccl_dir is not None)

    def _platforms_say(self, what: str, fact) -> bool:
        """One fact of the platforms (cluster/platform.py), stated there once; its platforms must agree."""
        seen = {fact(p) for p in self.platforms}
        if len(seen) != 1:
            raise TypeError(f"target {self.name}: its platforms disagree on {what}")
        return seen.pop()

    def flag(self) -> str:
        """The `--target` flag that selects this target again (empty for the default)."""
        return "" if self.name == DEFAULT else f" --target {self.name}"

    def expects_efa(self, inv: Inventory) -> bool:
        return self.nccl_efa and inv.efa


DEFAULT = "aws"
_REGISTRY: dict[str, Target] = {}
_ALIASES = {"stack": "aws"}


def register(target: Target) -> Target:
    _REGISTRY[target.name] = target
    return target


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str | None) -> Target:
    """The target called `name` (None: the default), or TargetError naming the choices."""
    key = (name or DEFAULT).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        choices = [f"'{t.name}' ({t.describe})" for t in _REGISTRY.values()]
        raise TargetError(f"--target must be {', '.join(choices[:-1])} or {choices[-1]}, not {name!r}")
    return _REGISTRY[key]


def with_stacks() -> tuple[str, ...]:
    return tuple(t.name for t in _REGISTRY.values() if t.takes_stack)


def of(inv: Inventory) -> Target:
    """The target an inventory was written for."""
    return get(inv.target)

