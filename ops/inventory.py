"""Loading the inventory (bootstrap/inventory.py): how `fab` reaches a cluster.

The Pulumi stack exports it as the output `inventory`; the local cluster writes
the same JSON to LOCAL_INVENTORY. Everything `fab` does starts from one of these.
"""

from __future__ import annotations

import json
import subprocess

from bootstrap.inventory import LOCAL_INVENTORY, Inventory, InventoryError


def load_local() -> Inventory:
    if not LOCAL_INVENTORY.exists():
        raise InventoryError(
            f"no local cluster: {LOCAL_INVENTORY} is missing. Start one with `fab local.up`."
        )
    return Inventory.from_dict(json.loads(LOCAL_INVENTORY.read_text()))


def load_pulumi(stack: str | None = None) -> Inventory:
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
    outputs = json.loads(out)
    if "inventory" not in outputs:
        raise InventoryError("the stack has no `inventory` output: run `pulumi up` first")
    return Inventory.from_dict(outputs["inventory"])


def load(target: str, stack: str | None = None) -> Inventory:
    if target == "local":
        return load_local()
    if target in ("aws", "stack"):
        return load_pulumi(stack)
    raise InventoryError(f"--target must be 'local' or 'aws', not {target!r}")
