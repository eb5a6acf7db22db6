"""Every `slurm-gpu:` stack setting with its default: cluster/stack_config.py parses them, for
`pulumi up` (infra/config.py) and for the estimate (ops/cost/estimate.py) alike."""

from __future__ import annotations

import re
from typing import Any

NAMESPACE = "slurm-gpu"

# key -> (default, example used in error messages). A default of None means optional;
# REQUIRED means the user must set it.
REQUIRED = object()
SETTINGS: dict[str, tuple[Any, str]] = {
    "adminCidr": (REQUIRED, "203.0.113.7/32"),
    "allowWideAdminCidr": (False, "true"),
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
    "scratchSizeGiB": (100, "500"),
    "gpuMarket": ("on-demand", "spot"),
    "capacityReservationId": (None, "cr-0123456789abcdef0"),
}

# How GPU nodes are bought (infra/market.py renders each on the instances; docs/CONFIG.md says
# what each costs and gives up). The controller is always On-Demand.
ON_DEMAND, SPOT, CAPACITY_RESERVATION, CAPACITY_BLOCK = "on-demand", "spot", "capacity-reservation", "capacity-block"
MARKETS = (ON_DEMAND, SPOT, CAPACITY_RESERVATION, CAPACITY_BLOCK)
RESERVED_MARKETS = (CAPACITY_RESERVATION, CAPACITY_BLOCK)
# EC2 resource ids: "cr-" and 8 or 17 hex digits (EC2 API Reference, CapacityReservation).
CAPACITY_RESERVATION_ID_RE = re.compile(r"^cr-([0-9a-f]{8}|[0-9a-f]{17})$")
