"""The platforms `fab` can drive, one object per target: ask it instead of comparing names.

Every difference between a cluster on AWS and the local cluster lives in the target's
module (aws.py, local.py): where its inventory comes from, whether its GPUs are real,
how its ranks talk (NCCL over EFA or gloo), where model and data may come from, whether
hosts boot through cloud-init. A third target is one new module registered here.
"""

# The targets (aws, local) register themselves on import; base holds what they subclass and register with.
from ops.targets import aws, boot, local
from ops.targets.base import CONFIGS, DEFAULT, Target, TargetError, get, names, of, register, with_stacks

__all__ = ["CONFIGS", "DEFAULT", "Target", "TargetError", "aws", "boot", "get", "local", "names", "of", "register",
           "with_stacks"]
