"""Which AMI the cluster boots.

By default the newest image matching the AWS platform's `ami_name`
(bootstrap/platform.py: the Deep Learning Base GPU AMI for Ubuntu 24.04, with the
NVIDIA driver, CUDA, and the EFA stack with aws-ofi-nccl under /opt/amazon); the
ARM64 build carries "ARM64" in its name and is excluded by the architecture
filter. The controller boots the same image: one OS for every host keeps the
bootstrap single. Why 24.04: docs/PLATFORM.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi_aws as aws

from bootstrap.platform import AWS
from infra.config import ConfigError, StackConfig
from infra.instance_types import ARCH

DLAMI_NAME = AWS.ami_name
AMAZON = "amazon"


@dataclass(frozen=True)
class Ami:
    id: str
    name: str
    root_device_name: str
    root_snapshot_gib: int | None


def resolve_ami(cfg: StackConfig) -> Ami:
    if cfg.ami_id:
        filters = [{"name": "image-id", "values": [cfg.ami_id]}]
        owners = None
        what = f"slurm-gpu:amiId {cfg.ami_id}"
    else:
        filters = [
            {"name": "name", "values": [DLAMI_NAME]},
            {"name": "architecture", "values": [ARCH]},
            {"name": "state", "values": ["available"]},
        ]
        owners = [AMAZON]
        what = f"the newest '{DLAMI_NAME}' image"
    try:
        res = aws.ec2.get_ami(most_recent=True, owners=owners, filters=filters)
    except Exception as exc:
        raise ConfigError(
            f"could not find {what} in this region ({exc}); set an AMI with "
            f"`pulumi config set slurm-gpu:amiId ami-...`"
        ) from exc
    if res.architecture and res.architecture != ARCH:
        raise ConfigError(f"slurm-gpu:amiId {res.id} is {res.architecture}; the cluster needs {ARCH}")
    root = next((m for m in res.block_device_mappings or []
                 if m.device_name == res.root_device_name), None)
    size = None
    if root is not None and root.ebs and root.ebs.get("volume_size"):
        size = int(root.ebs["volume_size"])
    if size is not None and cfg.root_volume_gib < size:
        raise ConfigError(
            f"slurm-gpu:rootVolumeGiB is {cfg.root_volume_gib} but the AMI {res.id} needs at least "
            f"{size} GiB; set it with `pulumi config set slurm-gpu:rootVolumeGiB {max(size, 200)}`"
        )
    return Ami(id=res.id, name=res.name, root_device_name=res.root_device_name,
               root_snapshot_gib=size)
