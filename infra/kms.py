"""Which KMS key encrypts the root volumes, and whether the power-save role must be granted it.

Root volumes are always encrypted. EC2's StartInstances on an instance whose volumes use a
customer-managed key needs the caller (the controller's power-save role, infra/power_role.py) to
be allowed that key; the AWS-managed aws/ebs key needs nothing (its key policy lets any
principal of the account use it through EC2). So, at plan time:

- `slurm-gpu:ebsKmsKeyId` set: the root volumes name that key and the role is granted
  exactly it (the key's policy must let IAM policies grant it: the default key policy does).
- unset: the account's default EBS key is looked up. AWS-managed: nothing to grant. Customer
  managed while GPU nodes stop when idle: refused, naming the key and the setting, because
  the role could not start the nodes again; naming the key in config keeps the grant and the
  volumes on that key even if the account's default changes later.

Spot GPU nodes (slurm-gpu:gpuMarket spot) on a customer-managed key: EC2 starts an interrupted
spot instance again through the service-linked role AWSServiceRoleForEC2Spot, which must be
allowed the key ("Service-linked role for Spot Instance requests": "Grant access to customer
managed keys for use with encrypted AMIs and EBS snapshots",
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/service-linked-roles-spot-instance-requests.html).
The program cannot see the key's grants, so it warns with the grant to make.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.settings import NAMESPACE, SPOT
from cluster.stack_config import StackConfig
from infra.config import PlanError

SETTING = f"{NAMESPACE}:ebsKmsKeyId"
# What EBS needs of a key to encrypt and decrypt volumes (AWS: "Requirements for Amazon EBS
# encryption"): symmetric, for encryption, enabled.
EBS_KEY_SPEC = "SYMMETRIC_DEFAULT"
EBS_KEY_USAGE = "ENCRYPT_DECRYPT"


@dataclass(frozen=True)
class EbsKey:
    """arn: the key the root volumes name and the power-save role is granted; None: the
    account's AWS-managed default, which needs no grant."""
    arn: str | None


SPOT_ROLE = "aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"
# What the Spot role needs of the key (the create-grant example of the page cited above).
SPOT_ROLE_OPERATIONS = ("Decrypt", "Encrypt", "GenerateDataKey", "GenerateDataKeyWithoutPlaintext",
                        "CreateGrant", "DescribeKey", "ReEncryptFrom", "ReEncryptTo")


def resolve_ebs_key(cfg: StackConfig, region: str | None) -> EbsKey:
    key = _resolve(cfg, region)
    if cfg.gpu_market == SPOT:
        _warn_spot_role(key.arn or _customer_default(), region)
    return key


def _customer_default() -> str | None:
    """The account's default EBS key where it is customer-managed (None: AWS-managed or unreadable)."""
    try:
        key = aws.kms.get_key(key_id=aws.ebs.get_default_kms_key().key_arn)
    except Exception:
        return None
    return key.arn if key.key_manager == "CUSTOMER" else None


def _warn_spot_role(key_arn: str | None, region: str | None) -> None:
    if not key_arn:
        return
    account = key_arn.split(":")[4]
    where = f" --region {region}" if region else ""
    pulumi.log.warn(
        f"spot GPU nodes' root volumes use the customer-managed key {key_arn}: EC2 restarts an interrupted "
        f"spot instance through the service-linked role AWSServiceRoleForEC2Spot, which needs a grant on it "
        f"(else the restart fails). If the role is not there yet: `aws iam create-service-linked-role "
        f"--aws-service-name spot.amazonaws.com`; then `aws kms create-grant{where} --key-id {key_arn} "
        f"--grantee-principal arn:aws:iam::{account}:role/{SPOT_ROLE} --operations "
        f"{' '.join(SPOT_ROLE_OPERATIONS)}` (docs/CONFIG.md)")


def _resolve(cfg: StackConfig, region: str | None) -> EbsKey:
    if cfg.ebs_kms_key_id:
        key = _describe(cfg.ebs_kms_key_id, f"{SETTING} {cfg.ebs_kms_key_id}")
        problems = []
        if key.key_state != "Enabled":
            problems.append(f"is {key.key_state}, not Enabled")
        if key.key_spec != EBS_KEY_SPEC or key.key_usage != EBS_KEY_USAGE:
            problems.append(f"is {key.key_spec}/{key.key_usage}; EBS needs a symmetric "
                            f"{EBS_KEY_SPEC}/{EBS_KEY_USAGE} key")
        key_region = key.arn.split(":")[3]
        if region and key_region != region:
            problems.append(f"is in {key_region}; the volumes are in {region} (EBS needs a key of their region)")
        if problems:
            raise PlanError(f"{SETTING}: the key {key.arn} " + "; ".join(problems) +
                              f"; name a usable key with `pulumi config set {SETTING} arn:aws:kms:...`")
        return EbsKey(arn=key.arn)
    if cfg.idle_stop_minutes == 0:
        return EbsKey(arn=None)  # no power-save role: nothing of ours starts the instances
    try:
        default = aws.ebs.get_default_kms_key().key_arn
    except Exception as exc:
        raise PlanError(
            f"could not read this account's default EBS encryption key ({exc}); name the key the root "
            f"volumes use with `pulumi config set {SETTING} arn:aws:kms:...`"
        ) from exc
    key = _describe(default, f"the account's default EBS key {default}")
    if key.key_manager == "AWS":
        return EbsKey(arn=None)
    raise PlanError(
        f"{SETTING} is unset and this account's default EBS key in {region or 'this region'} is "
        f"customer-managed ({key.arn}): the controller's power-save role could not start stopped GPU "
        f"nodes without a grant on it. Name the key, and the role is granted exactly it: "
        f"`pulumi config set {SETTING} {key.arn}`; or keep GPU nodes running with "
        f"`pulumi config set {NAMESPACE}:idleStopMinutes 0`"
    )


def _describe(key_id: str, what: str):
    try:
        return aws.kms.get_key(key_id=key_id)
    except Exception as exc:
        raise PlanError(
            f"could not describe {what} ({exc}); the deployer needs kms:DescribeKey on it; set "
            f"`pulumi config set {SETTING} arn:aws:kms:...` to a key of this region"
        ) from exc
