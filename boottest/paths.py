"""Where a boot-test cluster keeps its state on the host (cluster.py makes it, teardown.py removes it)."""

from __future__ import annotations

import os
from pathlib import Path

STATE_ROOT = Path(os.environ.get("SLURM_GPU_BOOT_STATE", "/var/lib/slurm-gpu-boot"))
INVENTORY = STATE_ROOT / "inventory.json"  # what ops/targets/boot.py loads
