"""Idle GPU nodes stop paying: the controller's instance role for Slurm's power programs.

slurmctld's SuspendProgram/ResumeProgram (bootstrap/scripts/power-ec2.sh.j2) stop and
start GPU instances through the EC2 API with this role. It may stop and start only
instances carrying this cluster's tags (Cluster=<name>, Role=gpu: never the controller,
never another cluster's nodes), and describe instances (DescribeInstances cannot be
scoped by tag or resource). Nothing else: no wildcard actions, no managed policies.
"""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws

GPU_ROLE_TAG = "gpu"  # the Role tag infra/nodes.py puts on GPU instances
STOP_START = ("ec2:StartInstances", "ec2:StopInstances")


def power_policy(cluster_name: str, region: str | None) -> dict:
    """The role's only policy document."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "StopStartThisClustersGpuNodes",
                "Effect": "Allow",
                "Action": list(STOP_START),
                "Resource": f"arn:aws:ec2:{region or '*'}:*:instance/*",
                "Condition": {"StringEquals": {
                    "aws:ResourceTag/Cluster": cluster_name,
                    "aws:ResourceTag/Role": GPU_ROLE_TAG,
                }},
            },
            {
                # Finding the instances of a hostlist by their tags; this action has no
                # resource-level permissions, so it cannot be narrowed further.
                "Sid": "FindInstances",
                "Effect": "Allow",
                "Action": "ec2:DescribeInstances",
                "Resource": "*",
            },
        ],
    }


ASSUME_ROLE_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{
        "Effect": "Allow",
        "Principal": {"Service": "ec2.amazonaws.com"},
        "Action": "sts:AssumeRole",
    }],
}


class PowerSaveComponent(pulumi.ComponentResource):
    """Role + inline policy + instance profile for the controller."""

    def __init__(self, name: str, *, cluster_name: str, region: str | None,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:PowerSave", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = {"Cluster": cluster_name, "Name": f"{cluster_name}-power-save"}
        self.role = aws.iam.Role(
            f"{name}-role",
            assume_role_policy=json.dumps(ASSUME_ROLE_POLICY),
            description=f"slurm-gpu {cluster_name}: the controller stops/starts this cluster's idle GPU nodes",
            tags=tags,
            opts=child,
        )
        self.policy = aws.iam.RolePolicy(
            f"{name}-stop-start",
            role=self.role.id,
            policy=json.dumps(power_policy(cluster_name, region)),
            opts=child,
        )
        self.instance_profile = aws.iam.InstanceProfile(
            f"{name}-profile", role=self.role.name, tags=tags, opts=child,
        )
        self.register_outputs({"roleArn": self.role.arn, "instanceProfile": self.instance_profile.name})
