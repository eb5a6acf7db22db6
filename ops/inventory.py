"""Loading the inventory (bootstrap/inventory.py): how `fab` reaches a cluster.

Each target (ops/targets/) knows where its inventory lives: the Pulumi stack's output
`inventory`, or the JSON the local cluster writes. Everything `fab` does starts from one.
"""

from __future__ import annotations

from bootstrap.inventory import Inventory, InventoryError
from ops import targets


def load(target: str, stack: str | None = None) -> Inventory:
    try:
        tgt = targets.get(target)
    except targets.TargetError as exc:
        raise InventoryError(str(exc)) from None
    return tgt.load(stack)
