"""The platforms `fab` can drive, one object per target: ask it instead of comparing names.

Every difference between a cluster on AWS and the local cluster lives in the target's
module (aws.py, local.py): where its inventory comes from, whether its GPUs are real,
how its ranks talk (NCCL over EFA or gloo), where model and data may come from, whether
hosts boot through cloud-init. A third target is one new module registered here.
"""

# The targets (aws, local) register themselves on import; base holds what they subclass and register with.
from cluster.inventory import Inventory, InventoryError
from cluster.targets import aws, boot, local
from cluster.targets.base import DEFAULT, Target, TargetError, get, names, of, register, with_stacks

__all__ = ["DEFAULT", "Target", "TargetError", "aws", "boot", "get", "local", "names", "of", "register",
           "with_stacks", "load"]


def load(target: str, stack: str | None = None) -> Inventory:
    """The inventory of the cluster `--target`/`--stack` name; a bad target name is an InventoryError."""
    try:
        tgt = get(target)
    except TargetError as exc:
        raise InventoryError(str(exc)) from None
    return tgt.load(stack)
