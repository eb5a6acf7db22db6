"""The boot test's cluster (boottest/): systemd-nspawn containers of this machine booted with
the stack's own user-data through cloud-init, reached over SSH as on AWS (cloud-init wait,
host keys pinned from the consoles, sudo as the image's default user), CPU only, offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.inventory import Inventory, InventoryError
from cluster.platform import BOOT_DEBIAN12, BOOT_DEBIAN13
from cluster.targets.base import Target, register

# Where a boot-test cluster keeps its state on the host (boottest/boot_cluster.py makes it,
# boottest/teardown.py removes it), and the inventory of the running one.
STATE_ROOT = Path(os.environ.get("SLURM_GPU_BOOT_STATE", "/var/lib/slurm-gpu-boot"))
BOOT_INVENTORY = STATE_ROOT / "inventory.json"


class Boot(Target):
    name = "boot"
    describe = "the boot test's containers (boottest/)"
    platforms = (BOOT_DEBIAN12, BOOT_DEBIAN13)
    hub_offline = True  # the containers reach only their bridge
    cloud_init = True  # hosts finish their first boot through cloud-init, as on AWS
    takes_stack = False

    def load(self, stack: str | None) -> Inventory:
        if not BOOT_INVENTORY.exists():
            raise InventoryError(f"no boot cluster: {BOOT_INVENTORY} is missing. The boot test "
                                 "(pytest -m boot tests/boot/test_boot_cluster.py) starts one.")
        return Inventory.from_dict(json.loads(BOOT_INVENTORY.read_text()))


BOOT = register(Boot())
