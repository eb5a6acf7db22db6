"""The inventory: how `fab` reaches a cluster.

The Pulumi stack exports it as the output `inventory`; the local cluster writes
the same JSON to LOCAL_INVENTORY. Everything `fab` does starts from one of these.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCAL_STATE = Path(os.environ.get("SLURM_GPU_LOCAL_STATE", "/var/lib/slurm-gpu-local"))
LOCAL_INVENTORY = LOCAL_STATE / "inventory.json"


class InventoryError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    name: str
    private_ip: str
    role: str  # "controller" or "gpu"
    public_ip: str | None = None


@dataclass(frozen=True)
class Inventory:
    target: str  # "aws" or "local"
    cluster_name: str
    ssh_user: str
    controller: Node
    gpu_nodes: tuple[Node, ...]
    gpus_per_node: int
    gpu_type: str
    nvlink: bool
    efa: bool
    # Python on the GPU nodes that has the training stack.
    python: str
    # How to act on a daemon on a host: "{action}" and "{service}" are filled
    # in (services: munge, slurmd, slurmctld).
    service_cmd: str
    scratch: str = "/scratch"
    ssh_key_file: str | None = None
    extra: dict = field(default_factory=dict)
    # bootstrap.facts.ClusterFacts as a dict (facts_to_dict): what `fab reconfigure`
    # renders slurm.conf from. Empty in inventories written before it existed.
    facts: dict = field(default_factory=dict)

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.controller, *self.gpu_nodes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Inventory:
        try:
            ctl = Node(**data["controller"])
            nodes = tuple(Node(**n) for n in data["gpu_nodes"])
            rest = {k: v for k, v in data.items() if k not in ("controller", "gpu_nodes")}
            return cls(controller=ctl, gpu_nodes=nodes, **rest)
        except (KeyError, TypeError) as exc:
            raise InventoryError(f"inventory is malformed ({exc}); re-run `pulumi up` or `fab local.up`") from exc


def load_local() -> Inventory:
    if not LOCAL_INVENTORY.exists():
        raise InventoryError(
            f"no local cluster: {LOCAL_INVENTORY} is missing. Start one with `fab local.up`."
        )
    return Inventory.from_dict(json.loads(LOCAL_INVENTORY.read_text()))


def load_pulumi(stack: str | None = None) -> Inventory:
    cmd = ["pulumi", "stack", "output", "--json"]
    if stack:
        cmd += ["--stack", stack]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError as exc:
        raise InventoryError(
            "the pulumi CLI is not installed: install it, or use `--target local`"
        ) from exc
    except subprocess.CalledProcessError as exc:
        raise InventoryError(f"`pulumi stack output` failed: {exc.stderr.strip()}") from exc
    outputs = json.loads(out)
    if "inventory" not in outputs:
        raise InventoryError("the stack has no `inventory` output: run `pulumi up` first")
    return Inventory.from_dict(outputs["inventory"])


def load(target: str, stack: str | None = None) -> Inventory:
    if target == "local":
        return load_local()
    if target in ("aws", "stack"):
        return load_pulumi(stack)
    raise InventoryError(f"--target must be 'local' or 'aws', not {target!r}")
