"""The inventory: the cluster spec (cluster/spec.py) as a target wrote it and fab reads it back.

The Pulumi stack exports it as the output `inventory`; the local cluster and the boot test write
the same JSON to their target's state directory (cluster/targets/local.py, boot.py). `fab` reads it
back with `Inventory.from_dict` (`cluster.targets.load` loads it). `Inventory` is `ClusterSpec`
itself, not a copy: the name the readers in ops/ use for the spec they loaded.
"""

from cluster.spec import ClusterSpec as Inventory
from cluster.spec import InventoryError, Node

__all__ = ["Inventory", "InventoryError", "Node"]
