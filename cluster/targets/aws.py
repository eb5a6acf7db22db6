"""A cluster on AWS: the current Pulumi stack's `inventory` output."""

from __future__ import annotations

import json
import subprocess

from cluster.inventory import Inventory, InventoryError
from cluster.platform import AWS as AWS_PLATFORM
from cluster.targets.base import Target, register


class Aws(Target):
    name = "aws"
    describe = "the current Pulumi stack, the default"
    platforms = (AWS_PLATFORM,)
    hub_offline = False
    cloud_init = True
    takes_stack = True
    power_up_time = "~2-4 minutes"  # an EC2 start plus boot

    def load(self, stack: str | None) -> Inventory:
        cmd = ["pulumi", "stack", "output", "--json"]
        if stack:
            cmd += ["--stack", stack]
        try:
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        except FileNotFoundError as exc:
            raise InventoryError(
                "the pulumi CLI is not installed: install it, or use `--target local`"
            ) from exc
        except subprocess.CalledProcessError as exc:
            raise InventoryError(f"`pulumi stack output` failed: {exc.stderr.strip()}") from exc
        try:
            outputs = json.loads(out)
        except ValueError:
            outputs = None
        if not isinstance(outputs, dict):
            raise InventoryError(f"`{' '.join(cmd)}` did not answer a JSON object (it said {out.strip()[:200]!r}): "
                                 "run it yourself to see why (a newer pulumi CLI, a stack that needs `pulumi "
                                 "login`), or pass --stack with the stack's name")
        if "inventory" not in outputs:
            raise InventoryError("the stack has no `inventory` output: run `pulumi up` first")
        return Inventory.from_dict(outputs["inventory"])


AWS = register(Aws())
