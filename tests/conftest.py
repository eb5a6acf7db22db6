import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(config, items):
    # Cluster tests (and `root` ones) need root. In CI they must run (never a quiet skip); on a
    # developer's non-root machine they are skipped with a reason.
    if os.geteuid() == 0 or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="needs root (network namespaces, root-owned files); run scripts/test.sh as root")
    for item in items:
        if "cluster" in item.keywords or "root" in item.keywords:
            item.add_marker(skip)
