"""gp3's rules, once: the limits EC2 puts on a gp3 volume's provisioned throughput and IOPS.

The stack's settings are checked against them (cluster/stack_config.py) and the estimate and the
spend price what lies above the baseline (ops/cost/). Throughput is in MiB/s, as AWS's gp3 figures
and the EC2 API give it; EC2 allows at most 0.25 MiB/s per IOPS (so throughput above 750 needs IOPS
above the 3000 baseline) and at most 500 IOPS per GiB of the volume
(https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html#gp3-ebs-volume-type).
"""

from __future__ import annotations

import math

GP3_THROUGHPUT = (125, 1000)  # baseline (free), most
GP3_IOPS = (3000, 16000)  # baseline (free), most
GP3_MIBPS_PER_IOPS = 0.25
GP3_IOPS_PER_GIB = 500


def gp3_min_iops(throughput: float) -> int:
    """The fewest IOPS gp3 accepts with this throughput (MiB/s)."""
    return max(GP3_IOPS[0], math.ceil(throughput / GP3_MIBPS_PER_IOPS))
