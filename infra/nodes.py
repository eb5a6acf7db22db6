"""The cluster's hosts: a key pair, a cluster placement group, the controller, N GPU nodes.

Every host has a fixed private IP (bootstrap.facts.plan_hosts), so /etc/hosts and
slurm.conf are rendered at plan time. IMDSv2 is required and root volumes are
encrypted gp3 on every host.

Internet access for GPU nodes: each GPU node's primary interface is created as
its own ENI (interface type "efa" when EFA is on; EFA can only be chosen at
launch, and an ENI created beforehand is the provider's way to launch with one)
and gets an Elastic IP. AWS only auto-assigns a public IP to an interface the
launch itself creates, so a pre-made ENI needs the EIP for apt/pip/model
downloads. The EIP is associated before the instance launches, so the first
boot already has a route out. This costs no NAT gateway and keeps one public
subnet; the security group still admits SSH from the admin CIDR only.
"""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_aws as aws

from bootstrap.facts import ClusterFacts, Host


class NodesComponent(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        *,
        facts: ClusterFacts,
        ssh_public_key: str,
        ami_id: str,
        controller_instance_type: str,
        gpu_instance_type: str,
        root_volume_gib: int,
        subnet_id: pulumi.Input[str],
        security_group_id: pulumi.Input[str],
        user_data: dict[str, str],
        internet: Sequence[pulumi.Resource],
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__("slurm-gpu:infra:Nodes", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cluster = facts.cluster_name
        self._cluster = cluster
        self._root_volume_gib = root_volume_gib

        self.key_pair = aws.ec2.KeyPair(
            f"{name}-key", public_key=ssh_public_key,
            tags={"Cluster": cluster, "Name": f"{cluster}-admin"}, opts=child,
        )
        self.placement_group = aws.ec2.PlacementGroup(
            f"{name}-pg", strategy="cluster",
            tags={"Cluster": cluster, "Name": f"{cluster}-gpu"}, opts=child,
        )

        self.controller = aws.ec2.Instance(
            f"{name}-{facts.controller.name}",
            ami=ami_id,
            instance_type=controller_instance_type,
            key_name=self.key_pair.key_name,
            subnet_id=subnet_id,
            private_ip=facts.controller.ip,
            vpc_security_group_ids=[security_group_id],
            associate_public_ip_address=True,
            metadata_options=self._imdsv2(),
            root_block_device=self._root("controller", facts.controller),
            user_data=user_data["controller"],
            tags=self._tags("controller", facts.controller),
            # Boot only once the subnet routes to the internet: cloud-init installs packages.
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(internet)),
        )

        self.gpu_interfaces: list[aws.ec2.NetworkInterface] = []
        self.gpu_public_ips: list[aws.ec2.Eip] = []
        self.gpu_nodes: list[aws.ec2.Instance] = []
        for host in facts.gpu_nodes:
            eni = aws.ec2.NetworkInterface(
                f"{name}-{host.name}-eni",
                subnet_id=subnet_id,
                private_ips=[host.ip],
                security_groups=[security_group_id],
                interface_type="efa" if facts.efa else None,
                description=f"{cluster} {host.name} primary interface",
                tags=self._tags("gpu", host),
                opts=child,
            )
            eip = aws.ec2.Eip(
                f"{name}-{host.name}-eip",
                domain="vpc",
                network_interface=eni.id,
                associate_with_private_ip=host.ip,
                tags=self._tags("gpu", host),
                opts=pulumi.ResourceOptions(parent=self, depends_on=list(internet)),
            )
            node = aws.ec2.Instance(
                f"{name}-{host.name}",
                ami=ami_id,
                instance_type=gpu_instance_type,
                key_name=self.key_pair.key_name,
                placement_group=self.placement_group.name,
                primary_network_interface={"network_interface_id": eni.id},
                metadata_options=self._imdsv2(),
                root_block_device=self._root("gpu", host),
                user_data=user_data["gpu"],
                tags=self._tags("gpu", host),
                opts=pulumi.ResourceOptions(parent=self, depends_on=[eip]),
            )
            self.gpu_interfaces.append(eni)
            self.gpu_public_ips.append(eip)
            self.gpu_nodes.append(node)

        self.register_outputs({
            "controllerId": self.controller.id,
            "controllerPublicIp": self.controller.public_ip,
            "gpuNodeIds": [n.id for n in self.gpu_nodes],
        })

    def _tags(self, role: str, host: Host) -> dict[str, str]:
        return {"Cluster": self._cluster, "Role": role, "Name": f"{self._cluster}-{host.name}"}

    def _root(self, role: str, host: Host) -> aws.ec2.InstanceRootBlockDeviceArgs:
        return aws.ec2.InstanceRootBlockDeviceArgs(
            volume_type="gp3",
            volume_size=self._root_volume_gib,
            encrypted=True,
            delete_on_termination=True,
            tags=self._tags(role, host),
        )

    @staticmethod
    def _imdsv2() -> aws.ec2.InstanceMetadataOptionsArgs:
        # Session tokens required: IMDSv1's plain GETs are what SSRF attacks abuse.
        return aws.ec2.InstanceMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required")
