"""The local cluster of `fab local.up`: network namespaces on this machine, CPU only, offline."""

from __future__ import annotations

import json

from bootstrap import render
from bootstrap.inventory import LOCAL_INVENTORY, Inventory, InventoryError
from bootstrap.platform import LOCAL as LOCAL_PLATFORM
from ops.targets.base import CONFIGS, Target, register

# gres.conf File= prefix: the local hosts' GPUs are plain stand-in files (localcluster creates them).
GPU_DEVICE_PREFIX = LOCAL_PLATFORM.gpu_device_prefix


class Local(Target):
    name = "local"
    describe = "the cluster of `fab local.up`"
    default_config = CONFIGS / "local-tiny.yaml"
    device_prefix = GPU_DEVICE_PREFIX
    real_gpus = False
    nccl_efa = False
    hub_offline = True  # the job runs with HF_HUB_OFFLINE=1
    cloud_init = False  # `fab local.up` configures the hosts
    takes_stack = False
    skip_steps = render.LOCAL_SKIP_STEPS
    # A host's own /usr/local/sbin only: /etc/slurm-gpu is the cluster's shared directory (written by
    # `fab local.up`), and the rest of /etc is this machine's own.
    update_paths = (render.BOOTSTRAP_PATH, render.HEALTHCHECK_PATH)
    measured_network = True
    gloo_ifname = "eth0"  # each host's end of its veth pair on the bridge (localcluster/netns.py add_host)

    def load(self, stack: str | None) -> Inventory:
        if not LOCAL_INVENTORY.exists():
            raise InventoryError(
                f"no local cluster: {LOCAL_INVENTORY} is missing. Start one with `fab local.up`."
            )
        return Inventory.from_dict(json.loads(LOCAL_INVENTORY.read_text()))


LOCAL = register(Local())
