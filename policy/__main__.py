"""slurm-gpu's CrossGuard policy pack: the cluster's security invariants.

Run it with the stack: `pulumi preview --policy-pack policy` (see policy/README.md).
The rules live in rules.py so tests import them without starting the pack's server.
"""

import sys
from pathlib import Path

from pulumi_policy import EnforcementLevel, PolicyPack

# The engine runs this directory with runpy, which puts it first on sys.path;
# say so explicitly for any other way of running it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rules import PACK_NAME, policies  # noqa: E402

PolicyPack(
    name=PACK_NAME,
    policies=policies(),
    enforcement_level=EnforcementLevel.MANDATORY,
    description="slurm-gpu security invariants: SSH only from adminCidr, IMDSv2, encrypted volumes, "
                "EFA placement and self rules, no munge key or private key in any resource, "
                "no public IP on GPU nodes, a tag-scoped power-save role that names its KMS key.",
)
