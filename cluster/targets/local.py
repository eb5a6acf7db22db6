"""The local cluster of `fab local.up`: network namespaces on this machine, CPU only, offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.hostpaths import BOOTSTRAP_PATH, HEALTHCHECK_PATH
from cluster.inventory import Inventory, InventoryError
from cluster.platform import LOCAL as LOCAL_PLATFORM
from cluster.targets.base import Target, register

# Where the local cluster keeps its state and writes its inventory.
LOCAL_STATE = Path(os.environ.get("SLURM_GPU_LOCAL_STATE", "/var/lib/slurm-gpu-local"))
LOCAL_INVENTORY = LOCAL_STATE / "inventory.json"

# What the local cluster skips (SLURM_GPU_SKIP_STEPS) when it runs the bootstrap scripts in a
# network-namespace host: no apt, kernel NFS server or systemd there, and the training
# stack is the repo's .venv. (hostname and hosts run: each host has its own UTS
# namespace and bind-mounted /etc/hostname and /etc/hosts.)
LOCAL_SKIP_STEPS = {
    "controller": ("packages", "nfs", "imds", "wheels", "services"),
    "gpu": ("packages", "nfs", "training", "services"),
}


class Local(Target):
    name = "local"
    describe = "the cluster of `fab local.up`"
    platforms = (LOCAL_PLATFORM,)
    hub_offline = True  # the job runs with HF_HUB_OFFLINE=1
    cloud_init = False  # `fab local.up` configures the hosts
    takes_stack = False
    power_up_time = "a few seconds"  # a host's slurmd started again (localcluster/power_save.py)
    skip_steps = LOCAL_SKIP_STEPS
    # A host's own /usr/local/sbin only: /etc/slurm-gpu is the cluster's shared directory (written by
    # `fab local.up`), and the rest of /etc is this machine's own.
    update_paths = (BOOTSTRAP_PATH, HEALTHCHECK_PATH)
    measured_network = True
    gloo_ifname = "eth0"  # each host's end of its veth pair on the bridge (localcluster/netns.py add_host)

    def load(self, stack: str | None) -> Inventory:
        if not LOCAL_INVENTORY.exists():
            raise InventoryError(
                f"no local cluster: {LOCAL_INVENTORY} is missing. Start one with `fab local.up`."
            )
        return Inventory.from_dict(json.loads(LOCAL_INVENTORY.read_text()))


LOCAL = register(Local())
