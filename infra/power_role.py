"""Idle GPU nodes stop paying: the controller's instance role for Slurm's power programs.

slurmctld's SuspendProgram/ResumeProgram (bootstrap/scripts/power-ec2.py.j2) stop and
start GPU instances through the EC2 API with this role. It may stop and start only
instances carrying this cluster's tags (Cluster=<name>, Role=gpu: never the controller)
and this stack's tag (STACK_TAG=<organization/project/stack>: never the nodes of another stack,
which may share the cluster name; IAM's aws:ResourceTag/<key> condition key, IAM User Guide,
"Controlling access to AWS resources using tags":
https://docs.aws.amazon.com/IAM/latest/UserGuide/access_tags.html), and describe instances (DescribeInstances cannot be
scoped by tag or resource). Where the root volumes use a customer-managed KMS key
(slurm-gpu:ebsKmsKeyId, infra/kms.py), starting an instance needs that key too: the role
may use exactly that key, only through EC2, and create grants on it only for EC2's volumes
(kms:GrantIsForAWSResource), as AWS documents for EBS encryption. Nothing else: no wildcard
actions, no managed policies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.facts import STACK_TAG

GPU_ROLE_TAG = "gpu"  # the Role tag infra/nodes.py puts on GPU instances
STOP_START = ("ec2:StartInstances", "ec2:StopInstances")
# AWS's list for EBS encryption with a KMS key (kms:ReEncrypt* named as its two actions:
# the policy pack refuses wildcard actions); kms:CreateGrant goes in its own statement.
EBS_KEY_USE = ("kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext",
               "kms:ReEncryptFrom", "kms:ReEncryptTo")


def power_policy(cluster_name: str, region: str | None, ebs_key_arn: str | None = None,
                 stack: str | None = None) -> dict:
    """The role's only policy document; ebs_key_arn: the root volumes' customer-managed key;
    stack: the owning stack's STACK_TAG value (None: the Cluster tag alone)."""
    doc = {
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
                    **({f"aws:ResourceTag/{STACK_TAG}": stack} if stack else {}),
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
    if ebs_key_arn:
        via_ec2 = ({"StringEquals": {"kms:ViaService": f"ec2.{region}.amazonaws.com"}} if region
                   else {"StringLike": {"kms:ViaService": "ec2.*.amazonaws.com"}})
        doc["Statement"] += [
            {
                # Starting an instance decrypts its volumes' data keys with this key, through EC2.
                "Sid": "UseTheRootVolumesKeyThroughEc2",
                "Effect": "Allow",
                "Action": list(EBS_KEY_USE),
                "Resource": ebs_key_arn,
                "Condition": via_ec2,
            },
            {
                # EC2 attaches the volumes with a grant it creates on the caller's behalf.
                "Sid": "LetEc2GrantTheRootVolumesKey",
                "Effect": "Allow",
                "Action": "kms:CreateGrant",
                "Resource": ebs_key_arn,
                "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}},
            },
        ]
    return doc


ASSUME_ROLE_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{
        "Effect": "Allow",
        "Principal": {"Service": "ec2.amazonaws.com"},
        "Action": "sts:AssumeRole",
    }],
}


@dataclass(frozen=True)
class PowerSaveArgs:
    """What PowerSaveComponent makes the controller's power-saving role from."""

    cluster_name: str
    region: str | None
    ebs_key_arn: str | None = None
    stack: str | None = None


class PowerSaveComponent(pulumi.ComponentResource):
    """Role + inline policy + instance profile for the controller."""

    def __init__(self, name: str, args: PowerSaveArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:PowerSave", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = {"Cluster": args.cluster_name, "Name": f"{args.cluster_name}-power-save"}
        self.role = aws.iam.Role(
            f"{name}-role",
            assume_role_policy=json.dumps(ASSUME_ROLE_POLICY),
            description=f"slurm-gpu {args.cluster_name}: the controller stops/starts this cluster's idle GPU nodes",
            tags=tags,
            opts=child,
        )
        self.policy = aws.iam.RolePolicy(
            f"{name}-stop-start",
            role=self.role.id,
            policy=json.dumps(power_policy(args.cluster_name, args.region, args.ebs_key_arn, args.stack)),
            opts=child,
        )
        self.instance_profile = aws.iam.InstanceProfile(
            f"{name}-profile", role=self.role.name, tags=tags, opts=child,
        )
        self.register_outputs({"roleArn": self.role.arn, "instanceProfile": self.instance_profile.name})
