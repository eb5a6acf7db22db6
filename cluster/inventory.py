"""The cluster description infra/, localcluster/ and ops/ share: the inventory.

The Pulumi stack exports it as the output `inventory`; the local cluster writes the
same JSON to the local target's LOCAL_INVENTORY (cluster/targets/local.py). Both build it
with `from_facts`, so there is one builder; `fab` reads it back with `Inventory.from_dict`
(`cluster.targets.load` loads it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from cluster.errors import UserError
from cluster.facts import ClusterFacts, facts_to_dict


class InventoryError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    name: str
    private_ip: str
    role: str  # "controller" or "gpu"
    public_ip: str | None = None


@dataclass(frozen=True)
class Inventory:
    target: str  # a key of cluster.targets (e.g. "aws" or "local")
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
    # Who the cluster's jobs run as (ClusterFacts.job_user); "" in inventories written before it
    # existed: their jobs run as ssh_user.
    job_user: str = ""
    ssh_key_file: str | None = None
    extra: dict = field(default_factory=dict)
    # cluster.facts.ClusterFacts as a dict (facts_to_dict): what `fab reconfigure`
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


def from_facts(facts: ClusterFacts, *, target: str, controller_public_ip: str | None, python: str,
               service_cmd: str, ssh_key_file: str | None = None, extra: dict | None = None) -> Inventory:
    """The inventory of a cluster planned as `facts` (GPU nodes by private address only)."""
    return Inventory(
        target=target,
        cluster_name=facts.cluster_name,
        ssh_user=facts.ssh_user,
        controller=Node(facts.controller.name, facts.controller.ip, "controller", controller_public_ip),
        gpu_nodes=tuple(Node(h.name, h.ip, "gpu") for h in facts.gpu_nodes),
        gpus_per_node=facts.shape.gpu_count,
        gpu_type=facts.shape.gpu_type,
        nvlink=facts.nvlink,
        efa=facts.efa,
        python=python,
        service_cmd=service_cmd,
        scratch=facts.scratch,
        job_user=facts.job_user,
        ssh_key_file=ssh_key_file,
        extra=extra or {},
        facts=facts_to_dict(facts),  # what `fab reconfigure` renders slurm.conf from
    )
