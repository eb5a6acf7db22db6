"""The whole cluster: network + security group + nodes, and the inventory fab reads."""

from __future__ import annotations

from dataclasses import asdict

import pulumi

from bootstrap.facts import ClusterFacts
from bootstrap.render import TRAINING_PYTHON
from infra.config import StackConfig
from infra.network import NetworkComponent
from infra.nodes import NodesComponent
from infra.security import SecurityComponent
from ops.inventory import Inventory, Node

SERVICE_CMD = "sudo systemctl {action} {service}"


def build_inventory(facts: ClusterFacts, controller_public_ip: str | None,
                    gpu_public_ips: list[str | None], region: str | None) -> dict:
    """The `inventory` output: ops.inventory.Inventory as a plain dict."""
    inv = Inventory(
        target="aws",
        cluster_name=facts.cluster_name,
        ssh_user=facts.ssh_user,
        controller=Node(facts.controller.name, facts.controller.ip, "controller",
                        controller_public_ip),
        gpu_nodes=tuple(Node(h.name, h.ip, "gpu", ip)
                        for h, ip in zip(facts.gpu_nodes, gpu_public_ips, strict=True)),
        gpus_per_node=facts.shape.gpu_count,
        gpu_type=facts.shape.gpu_type,
        nvlink=facts.nvlink,
        efa=facts.efa,
        python=TRAINING_PYTHON,  # where the GPU nodes' bootstrap installs the training stack
        service_cmd=SERVICE_CMD,
        scratch=facts.scratch,
        extra={"region": region} if region else {},
    )
    return asdict(inv)


class ClusterComponent(pulumi.ComponentResource):
    def __init__(self, name: str, *, cfg: StackConfig, facts: ClusterFacts, ami_id: str,
                 availability_zone: str, user_data: dict[str, str], region: str | None = None,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        self.network = NetworkComponent(
            f"{name}-net", cluster_name=facts.cluster_name, vpc_cidr=cfg.vpc_cidr,
            subnet_cidr=cfg.subnet_cidr, availability_zone=availability_zone, opts=child,
        )
        self.security = SecurityComponent(
            f"{name}-sec", cluster_name=facts.cluster_name, vpc_id=self.network.vpc.id,
            admin_cidr=cfg.admin_cidr, opts=child,
        )
        self.nodes = NodesComponent(
            f"{name}-nodes",
            facts=facts,
            ssh_public_key=cfg.ssh_public_key,
            ami_id=ami_id,
            controller_instance_type=cfg.controller_instance_type,
            gpu_instance_type=cfg.gpu_instance_type,
            root_volume_gib=cfg.root_volume_gib,
            subnet_id=self.network.subnet.id,
            security_group_id=self.security.group.id,
            user_data=user_data,
            internet=self.network.internet_access,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.network, self.security]),
        )

        self.controller_public_ip = self.nodes.controller.public_ip
        self.node_list = [
            {"name": h.name, "private_ip": h.ip, "role": role}
            for h, role in [(facts.controller, "controller")] + [(h, "gpu") for h in facts.gpu_nodes]
        ]
        self.inventory = pulumi.Output.all(
            self.nodes.controller.public_ip, *[e.public_ip for e in self.nodes.gpu_public_ips]
        ).apply(lambda ips: build_inventory(facts, ips[0], list(ips[1:]), region))

        self.register_outputs({
            "controllerPublicIp": self.controller_public_ip,
            "nodes": self.node_list,
            "inventory": self.inventory,
        })
