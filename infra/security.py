"""The cluster's one security group and its exact rules.

Inbound: SSH from the admin CIDR only, and everything from the group itself
(Slurm, NFS, NCCL, EFA). Outbound: everything to the group itself - EFA's
transport needs the self-referencing egress rule, an egress to 0.0.0.0/0 does
not cover it - and everything to the internet for package installs (apt, pip,
model downloads). The group declares no inline rules and every rule is its own
resource, so a rule added by hand in the console shows up as drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws


@dataclass(frozen=True)
class SecurityArgs:
    """What SecurityComponent makes the cluster's security group from."""

    cluster_name: str
    vpc_id: pulumi.Input[str]
    admin_cidr: str


class SecurityComponent(pulumi.ComponentResource):
    def __init__(self, name: str, args: SecurityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Security", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = {"Cluster": args.cluster_name, "Name": f"{args.cluster_name}-nodes"}

        self.group = aws.ec2.SecurityGroup(
            f"{name}-sg",
            vpc_id=args.vpc_id,
            description=f"slurm-gpu cluster {args.cluster_name}: SSH from the admin CIDR, all within the group",
            tags=tags,
            opts=child,
        )
        sg = self.group.id

        def rule(kind, suffix: str, description: str, **peer):
            return kind(f"{name}-{suffix}", security_group_id=sg, description=description,
                        tags=tags, opts=child, **peer)

        ingress, egress = aws.vpc.SecurityGroupIngressRule, aws.vpc.SecurityGroupEgressRule
        self.ssh_from_admin = rule(ingress, "ssh-from-admin", "SSH from the admin CIDR only",
                                   ip_protocol="tcp", from_port=22, to_port=22, cidr_ipv4=args.admin_cidr)
        self.all_from_self = rule(ingress, "all-from-self",
                                  "all traffic between cluster nodes (Slurm, NFS, NCCL, EFA)",
                                  ip_protocol="-1", referenced_security_group_id=sg)
        self.all_to_self = rule(egress, "all-to-self",
                                "all traffic to cluster nodes; EFA needs this self-referencing egress",
                                ip_protocol="-1", referenced_security_group_id=sg)
        self.all_to_internet = rule(egress, "all-to-internet",
                                    "outbound internet for package installs and model downloads",
                                    ip_protocol="-1", cidr_ipv4="0.0.0.0/0")
        self.register_outputs({"securityGroupId": self.group.id})
