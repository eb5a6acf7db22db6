"""The root volumes' KMS key and the power-save role's grant on it.

StartInstances on an instance whose volumes use a customer-managed key fails unless the
caller may use that key. The stack names the key (slurm-gpu:ebsKmsKeyId) and the role is
granted exactly it; a customer-managed account default left unnamed is refused.
"""

from __future__ import annotations

import json

import pytest

from infra.config import PlanError
from tests.support.pulumi_mocks import (
    AWS_EBS_ALIAS,
    CMK,
    CMK_ASYMMETRIC,
    CMK_DISABLED,
    CMK_OTHER_REGION,
    ClusterMocks,
    run_program,
    stack_config,
)

CMK_ID = CMK.rsplit("/", 1)[1]
USE = ["kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext",
       "kms:ReEncryptFrom", "kms:ReEncryptTo"]


def _policy(run) -> dict:
    (policy,) = run.of_type("role_policy")
    return json.loads(policy.inputs["policy"])


def _kms_statements(doc: dict) -> list[dict]:
    return [st for st in doc["Statement"]
            if any(str(a).startswith("kms:") for a in ([st["Action"]] if isinstance(st["Action"], str)
                                                        else st["Action"]))]


@pytest.mark.parametrize("given", [CMK, CMK_ID], ids=["arn", "key-id"])
def test_a_named_key_encrypts_every_root_volume_and_only_it_is_granted(given):
    run = run_program(stack_config(ebsKmsKeyId=given))
    instances = run.of_type("instance")
    assert len(instances) == 3
    for inst in instances:
        root = inst.inputs["rootBlockDevice"]
        assert root["encrypted"] is True and root["kmsKeyId"] == CMK  # the ARN, also from a key id
    statements = {st["Sid"]: st for st in _kms_statements(_policy(run))}
    assert statements == {
        "UseTheRootVolumesKeyThroughEc2": {
            "Sid": "UseTheRootVolumesKeyThroughEc2", "Effect": "Allow", "Action": USE, "Resource": CMK,
            "Condition": {"StringEquals": {"kms:ViaService": "ec2.ap-northeast-2.amazonaws.com"}},
        },
        "LetEc2GrantTheRootVolumesKey": {
            "Sid": "LetEc2GrantTheRootVolumesKey", "Effect": "Allow", "Action": "kms:CreateGrant",
            "Resource": CMK, "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}},
        },
    }
    # The stop/start statements are as before: tag-scoped, no KMS in them.
    (stop_start,) = [st for st in _policy(run)["Statement"] if st["Sid"] == "StopStartThisClustersGpuNodes"]
    assert stop_start["Condition"]["StringEquals"]["aws:ResourceTag/Cluster"] == "mini"


def test_the_aws_managed_default_key_needs_no_grant():
    run = run_program(stack_config())
    for inst in run.of_type("instance"):
        assert "kmsKeyId" not in inst.inputs["rootBlockDevice"]
    assert _kms_statements(_policy(run)) == []
    calls = [t for t, _ in run.mocks.calls]
    assert "aws:ebs/getDefaultKmsKey:getDefaultKmsKey" in calls
    assert ("aws:kms/getKey:getKey", {"keyId": AWS_EBS_ALIAS}) in run.mocks.calls


def test_a_customer_managed_default_key_is_refused_until_named():
    mocks = ClusterMocks(default_ebs_key=CMK)
    with pytest.raises(PlanError) as info:
        run_program(stack_config(), mocks)
    message = str(info.value)
    assert "slurm-gpu:ebsKmsKeyId is unset" in message and "customer-managed" in message
    assert f"pulumi config set slurm-gpu:ebsKmsKeyId {CMK}" in message
    assert mocks.resources == [] and mocks.components == []
    # Named, it is granted.
    run = run_program(stack_config(ebsKmsKeyId=CMK), ClusterMocks(default_ebs_key=CMK))
    assert {st["Resource"] for st in _kms_statements(_policy(run))} == {CMK}


def test_without_power_saving_there_is_no_role_to_grant():
    run = run_program(stack_config(idleStopMinutes=0), ClusterMocks(default_ebs_key=CMK))
    assert run.of_type("role_policy") == [] and run.of_type("role") == []
    for inst in run.of_type("instance"):
        assert "kmsKeyId" not in inst.inputs["rootBlockDevice"]


BAD_KEYS = [
    ("alias/my-ebs-key", r"is an alias; IAM grants name the key itself"),
    ("arn:aws:kms:ap-northeast-2:111122223333:alias/my-ebs-key", r"is an alias"),
    ("my-ebs-key", r"is not a KMS key ARN"),
    ("arn:aws:kms:ap-northeast-2:111122223333:key/*", r"is not a KMS key ARN"),
    (CMK_DISABLED, r"is Disabled, not Enabled"),
    (CMK_OTHER_REGION, r"is in us-east-1; the volumes are in ap-northeast-2"),
    (CMK_ASYMMETRIC, r"EBS needs a symmetric SYMMETRIC_DEFAULT/ENCRYPT_DECRYPT key"),
    ("arn:aws:kms:ap-northeast-2:111122223333:key/9999aaaa-99aa-99aa-99aa-9999aaaa9999",
     r"could not describe .*NotFoundException"),
]


@pytest.mark.parametrize("key,pattern", BAD_KEYS, ids=[f"bad-{i}" for i in range(len(BAD_KEYS))])
def test_bad_keys_are_refused_naming_the_setting(key, pattern):
    mocks = ClusterMocks()
    with pytest.raises(PlanError, match=pattern) as info:
        run_program(stack_config(ebsKmsKeyId=key), mocks)
    assert "slurm-gpu:ebsKmsKeyId" in str(info.value)
    assert mocks.resources == [] and mocks.components == []
