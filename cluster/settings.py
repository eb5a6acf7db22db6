"""Every `slurm-gpu:` stack setting with its default: infra/config.py validates them,
the estimate (ops/cost/estimate.py) reads the defaults of a stack file that leaves them out."""

from __future__ import annotations

from typing import Any

NAMESPACE = "slurm-gpu"

# key -> (default, example used in error messages). A default of None means optional;
# REQUIRED means the user must set it.
REQUIRED = object()
SETTINGS: dict[str, tuple[Any, str]] = {
    "adminCidr": (REQUIRED, "203.0.113.7/32"),
    "sshPublicKey": (REQUIRED, '"$(cat ~/.ssh/id_ed25519.pub)"'),
    "gpuNodeCount": (2, "2"),
    "gpuInstanceType": ("g6.12xlarge", "g6.12xlarge"),
    "controllerInstanceType": ("c6i.xlarge", "c6i.xlarge"),
    "amiId": (None, "ami-0123456789abcdef0"),
    "controllerAmiId": (None, "ami-0123456789abcdef0"),
    "ebsKmsKeyId": (None, "arn:aws:kms:ap-northeast-2:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"),
    "rootVolumeGiB": (200, "200"),
    "vpcCidr": ("10.0.0.0/16", "10.0.0.0/16"),
    "subnetCidr": ("10.0.1.0/24", "10.0.1.0/24"),
    "publicSubnetCidr": (None, "10.0.0.0/24"),
    "availabilityZone": (None, "ap-northeast-2a"),
    "clusterName": ("mini", "mini"),
    "efa": (True, "true"),
    "idleStopMinutes": (30, "30"),
    "scratchThroughputMBps": (125, "1000"),
    "scratchIops": (None, "4000"),
}
