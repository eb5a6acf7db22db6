"""The cluster spec: one typed record of a cluster, built by its target's plan and written as the inventory.

Each fact lives once. `facts` (cluster/facts.py ClusterFacts) holds what the rendered files come from:
names, addresses, node shape, scratch, users, power saving, platform (and with it the GPU device
prefix). `access` holds how fab reaches and acts on the hosts. `aws` holds what `pulumi up` made
(target "aws" only). The readers' names (`cluster_name`, `gpus_per_node`, `controller`, ...) are
read-only views of those parts, not copies.

Who builds it (each target's own plan): infra/cluster_component.py (the stack's `inventory`
output), localcluster/plan.py (LOCAL_INVENTORY), boottest/boot_cluster.py (BOOT_INVENTORY).
Who reads it: cluster/targets/ `load`, then ops/ through these typed fields.

On disk it is `to_dict()` as JSON, with `schema` = SCHEMA. An inventory written before the schema
existed (no `schema` key: the flat form with `extra` and `facts` as a dict) is read by `_from_flat`,
so `fab status`, `fab down` and `fab train` keep working on a stack that was brought up by an older
fab without forcing a `pulumi up` first (which may replace resources); one that predates the facts
(no `facts`) cannot be read and names the fix. An unknown newer schema is refused, naming it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from cluster.errors import UserError
from cluster.facts import ClusterFacts, facts_from_dict

# Version of the written form. 1 was the flat form without a `schema` key (read by `_from_flat`).
SCHEMA = 2

REFRESH = "re-run `pulumi up` (or `fab local.up`) to rewrite it"


class InventoryError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    """A host as fab reaches it."""
    name: str
    private_ip: str
    role: str  # "controller" or "gpu"
    public_ip: str | None = None


@dataclass(frozen=True)
class Access:
    """How fab reaches the hosts and acts on them."""
    # Python on the GPU nodes that has the training stack.
    python: str
    # How to act on a daemon on a host: "{action}" and "{service}" are filled in (munge, slurmd, slurmctld).
    service_cmd: str
    # The controller's address from this machine (AWS: its public IP; locally: its bridge IP).
    controller_public_ip: str | None = None
    ssh_key_file: str | None = None
    # The cluster's own known_hosts (local and boot clusters pin their keys when they start);
    # None: one per stack under fab's config directory, filled from the EC2 console (ops/ssh/hostkeys.py).
    known_hosts: str | None = None


@dataclass(frozen=True)
class ScratchVolume:
    """The shared /scratch's own gp3 EBS volume on the controller, as the provider reports it
    (infra/nodes.py): `fab estimate` and the cost lines read it."""
    throughput_mbps: int
    iops: int
    size_gib: int
    volume_id: str


@dataclass(frozen=True)
class AwsResources:
    """What `pulumi up` made, for fab's EC2 calls (the stack's region and name are facts: `facts.region`,
    `facts.stack`)."""
    # host name -> EC2 instance id: fab reads each host's SSH host keys from its console output by id.
    instance_ids: dict[str, str] = field(default_factory=dict)
    scratch_volume: ScratchVolume | None = None


@dataclass(frozen=True)
class ClusterSpec:
    target: str  # a key of cluster.targets ("aws", "local", "boot")
    facts: ClusterFacts
    access: Access
    aws: AwsResources | None = None

    # ---------------------------------------------------------------- views (nothing stored twice)

    @property
    def cluster_name(self) -> str:
        return self.facts.cluster_name

    @property
    def ssh_user(self) -> str:
        return self.facts.ssh_user

    @property
    def job_user(self) -> str:
        return self.facts.job_user

    @property
    def scratch(self) -> str:
        return self.facts.scratch

    @property
    def gpus_per_node(self) -> int:
        return self.facts.shape.gpu_count

    @property
    def gpu_type(self) -> str:
        return self.facts.shape.gpu_type

    @property
    def nvlink(self) -> bool:
        return self.facts.nvlink

    @property
    def efa(self) -> bool:
        return self.facts.efa

    @property
    def gpu_device_prefix(self) -> str:
        """gres.conf's File= prefix: the facts' (their platform's unless a test moved it)."""
        return self.facts.gpu_device_prefix

    @property
    def idle_stop_s(self) -> int | None:
        """Seconds an idle GPU node runs before it is stopped; None: power saving off."""
        return self.facts.power_save.suspend_time if self.facts.power_save else None

    @property
    def python(self) -> str:
        return self.access.python

    @property
    def service_cmd(self) -> str:
        return self.access.service_cmd

    @property
    def ssh_key_file(self) -> str | None:
        return self.access.ssh_key_file

    @property
    def controller(self) -> Node:
        c = self.facts.controller
        return Node(c.name, c.ip, "controller", self.access.controller_public_ip)

    @property
    def gpu_nodes(self) -> tuple[Node, ...]:
        return tuple(Node(h.name, h.ip, "gpu") for h in self.facts.gpu_nodes)

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.controller, *self.gpu_nodes)

    # ---------------------------------------------------------------- the written form

    def to_dict(self) -> dict:
        """Plain JSON form (lists, not tuples): the stack's `inventory` output and the inventory files."""
        return json.loads(json.dumps({"schema": SCHEMA, **asdict(self)}))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> ClusterSpec:
        if not isinstance(data, dict):
            raise InventoryError(f"the inventory is not a JSON object; {REFRESH}")
        schema = data.get("schema", 1)
        try:
            if schema == 1:
                return _from_flat(data)
            if schema != SCHEMA:
                raise InventoryError(f"the inventory has schema {schema!r}, this fab reads {SCHEMA}: "
                                     "update slurm-gpu (git pull), or " + REFRESH)
            aws = dict(data["aws"]) if data.get("aws") is not None else None
            facts = facts_from_dict(data["facts"])
            if aws is not None:  # written when the region and stack were AWS resources, not facts
                facts = replace(facts, region=facts.region or aws.pop("region", None),
                                stack=facts.stack or aws.pop("stack", None))
                aws.pop("region", None), aws.pop("stack", None)
            return cls(target=data["target"], facts=facts, access=Access(**data["access"]),
                       aws=_aws(**aws) if aws is not None else None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, InventoryError):
                raise
            raise InventoryError(f"inventory is malformed ({exc}); {REFRESH}") from exc


def _aws(scratch_volume: dict | None = None, **rest) -> AwsResources:
    return AwsResources(scratch_volume=ScratchVolume(**scratch_volume) if scratch_volume else None, **rest)


def _from_flat(data: dict) -> ClusterSpec:
    """An inventory written before SCHEMA 2: flat fields copied from the facts, the facts as a dict,
    and `extra` (region, stack, instance_ids, scratch_volume, known_hosts; the power-save figures are
    the facts' own)."""
    if not data.get("facts"):
        raise InventoryError("the inventory carries no cluster facts (it predates them); " + REFRESH
                             + ", or take the stack down with `pulumi destroy`")
    extra = data.get("extra") or {}
    facts = facts_from_dict(data["facts"])
    if not data.get("job_user"):  # written before jobs had their own user: they run as ssh_user
        facts = replace(facts, job_user=facts.ssh_user)
    access = Access(python=data["python"], service_cmd=data["service_cmd"],
                    controller_public_ip=data["controller"].get("public_ip"),
                    ssh_key_file=data.get("ssh_key_file"), known_hosts=extra.get("known_hosts"))
    aws = None
    if data["target"] == "aws":
        # The region and stack were in `extra` (and the stack in the power-save facts, read there by
        # facts_from_dict); they are facts now.
        facts = replace(facts, region=facts.region or extra.get("region"), stack=facts.stack or extra.get("stack"))
        aws = _aws(instance_ids=dict(extra.get("instance_ids") or {}), scratch_volume=extra.get("scratch_volume"))
    return ClusterSpec(target=data["target"], facts=facts, access=access, aws=aws)
