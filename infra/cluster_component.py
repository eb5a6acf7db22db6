"""The whole cluster: network + security group + nodes, and the inventory fab reads."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from bootstrap.node_layout import TRAINING_PYTHON
from cluster.facts import STACK_TAG, ClusterFacts
from cluster.settings import SPOT
from cluster.spec import Access, AwsResources, ClusterSpec, ScratchVolume
from cluster.stack_config import StackConfig
from infra.ami import Ami, ImagesArgs, ImagesComponent
from infra.kms import EbsKey
from infra.market import Reservation, ignored_on_update, instance_args, market_key, uses_placement_group
from infra.network import NetworkArgs, NetworkComponent
from infra.nodes import NodesArgs, NodesComponent
from infra.power_role import PowerSaveArgs, PowerSaveComponent
from infra.quotas import stack_name
from infra.security import SecurityArgs, SecurityComponent
from infra.spot_guard import SpotRequestGuard, provider_account

SERVICE_CMD = "sudo systemctl {action} {service}"


def build_inventory(facts: ClusterFacts, controller_public_ip: str | None,
                    instance_ids: dict[str, str] | None = None, scratch_volume: dict | None = None) -> dict:
    """The `inventory` output: the AWS target's cluster spec (cluster/spec.py) in its written form.
    `scratch_volume`: the shared /scratch's own gp3 EBS volume on the controller (infra/nodes.py):
    {"throughput_mbps", "iops", "size_gib", "volume_id"} (`fab estimate` and the cost lines read them)."""
    spec = ClusterSpec(target="aws", facts=facts, access=Access(
        controller_public_ip=controller_public_ip,
        python=TRAINING_PYTHON,  # where the GPU nodes' bootstrap installs the training stack
        service_cmd=SERVICE_CMD,
    ), aws=AwsResources(
        instance_ids=dict(instance_ids or {}),  # fab reads each host's SSH host keys from its console by id
        scratch_volume=ScratchVolume(**scratch_volume) if scratch_volume else None,
    ))
    return spec.to_dict()


@dataclass(frozen=True)
class ClusterArgs:
    """What ClusterComponent builds the whole cluster from: the settings, the plan's facts and lookups."""

    cfg: StackConfig
    facts: ClusterFacts
    images: dict[str, Ami]
    availability_zone: str
    user_data: dict[str, str]
    efa_interfaces: int
    region: str | None = None
    ebs_key: EbsKey | None = None
    reservation: Reservation | None = None


class ClusterComponent(pulumi.ComponentResource):
    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cfg, facts, reservation = args.cfg, args.facts, args.reservation

        self.network = NetworkComponent(f"{name}-net", NetworkArgs(
            cluster_name=facts.cluster_name, vpc_cidr=cfg.vpc_cidr,
            subnet_cidr=cfg.subnet_cidr, public_subnet_cidr=cfg.public_subnet_cidr,
            availability_zone=args.availability_zone,
            # Moved only by the config (or a reservation's zone, which the nodes must launch in).
            zone_configured=bool(cfg.availability_zone or (reservation and reservation.availability_zone)),
        ), opts=child)
        self.security = SecurityComponent(f"{name}-sec", SecurityArgs(
            cluster_name=facts.cluster_name, vpc_id=self.network.vpc.id, admin_cidr=cfg.admin_cidr,
        ), opts=child)
        ebs_key_arn = args.ebs_key.arn if args.ebs_key else None
        # The controller's role to stop/start idle GPU nodes (none when they never stop).
        self.power = PowerSaveComponent(f"{name}-power", PowerSaveArgs(
            cluster_name=facts.cluster_name, region=args.region, ebs_key_arn=ebs_key_arn,
            stack=facts.stack,
        ), opts=child) if facts.power_save is not None else None
        # The image ids the instances take, kept with the stack (infra/ami.py).
        self.images = ImagesComponent(f"{name}-images", ImagesArgs(images=args.images), opts=child)
        self.nodes = NodesComponent(f"{name}-nodes", NodesArgs(
            facts=facts,
            ssh_public_key=cfg.ssh_public_key,
            ami=self.images.ami,
            follow_ami=self.images.follow,
            ebs_key_arn=ebs_key_arn,
            controller_instance_type=cfg.controller_instance_type,
            gpu_instance_type=cfg.gpu_instance_type,
            root_volume_gib=cfg.root_volume_gib,
            public_subnet_id=self.network.public_subnet.id,
            gpu_subnet_id=self.network.gpu_subnet.id,
            security_group_id=self.security.group.id,
            user_data=args.user_data,
            # The scratch volume lies in the controller's zone: its subnet's, kept per stack (infra/network.py).
            controller_zone=self.network.public_subnet.availability_zone,
            scratch_size_gib=cfg.scratch_size_gib,
            efa_interfaces=args.efa_interfaces,
            controller_internet=self.network.controller_internet,
            gpu_internet=self.network.gpu_internet,
            controller_instance_profile=self.power.instance_profile.name if self.power else None,
            scratch_throughput_mbps=cfg.scratch_throughput_mbps,
            scratch_iops=cfg.scratch_iops,
            # The GPU nodes' market (infra/market.py): spot and reservations place the nodes
            # themselves; a Capacity Block's own placement group, if it has one, is joined.
            gpu_market_args=instance_args(cfg),
            gpu_placement_group=(True if uses_placement_group(cfg)
                                 else (reservation.placement_group if reservation else None)),
            gpu_market_key=market_key(cfg),
            gpu_market_ignored=ignored_on_update(cfg),
            # A cluster placement group lies in one zone (EC2 User Guide, "Placement groups"): a new
            # one with the GPU subnet when a zone move replaces that subnet.
            placement_group_replace_with=[self.network.gpu_subnet],
        ), opts=pulumi.ResourceOptions(parent=self, depends_on=[self.network, self.security]))
        # Each spot node's persistent request is cancelled before the node goes (infra/spot_guard.py).
        account = provider_account() if cfg.gpu_market == SPOT else None
        self.spot_guards = [
            SpotRequestGuard(f"{name}-{h.name}-spot-request", node=node, region=args.region, account=account,
                             tags={"Cluster": facts.cluster_name, "Role": "gpu",
                                   "Name": f"{facts.cluster_name}-{h.name}", STACK_TAG: stack_name()},
                             opts=child)
            for h, node in zip(facts.gpu_nodes, self.nodes.gpu_nodes, strict=True)
        ] if cfg.gpu_market == SPOT else []

        self.controller_public_ip = self.nodes.controller.public_ip
        self.node_list = [
            {"name": h.name, "private_ip": h.ip, "role": role}
            for h, role in [(facts.controller, "controller")] + [(h, "gpu") for h in facts.gpu_nodes]
        ]
        names = [facts.controller.name] + [h.name for h in facts.gpu_nodes]
        # The shared volume as the provider reports it, for `fab estimate` and the cost lines.
        vol = self.nodes.scratch_volume
        self.inventory = pulumi.Output.all(
            self.nodes.controller.public_ip, vol.throughput, vol.iops, vol.size, vol.id,
            self.nodes.controller.id, *[n.id for n in self.nodes.gpu_nodes]
        ).apply(lambda v: build_inventory(facts, v[0], dict(zip(names, v[5:], strict=True)),
                                          {"throughput_mbps": v[1], "iops": v[2], "size_gib": v[3],
                                           "volume_id": v[4]}))

        hosts = [(facts.controller.name, self.nodes.controller)] + \
            [(h.name, n) for h, n in zip(facts.gpu_nodes, self.nodes.gpu_nodes, strict=True)]
        # Read from each instance's state, which keeps its image while `ami` changes are ignored.
        self.images_running = pulumi.Output.all(**{h: inst.ami for h, inst in hosts})

        self.register_outputs({
            "controllerPublicIp": self.controller_public_ip,
            "images": self.images_running,
            "nodes": self.node_list,
            "inventory": self.inventory,
        })
