import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def pytest_configure(config):
    # Several tests press Ctrl-C on `fab` (SIGINT to it, or to this process around a remote command). A
    # runner started in the background by a non-interactive shell (`cmd &`, nohup) hands its children
    # SIGINT ignored, and Python keeps an ignored SIGINT ignored: those tests would see no interrupt at
    # all. Take Python's own handler back; processes started from here then get SIGINT's default action.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    # Cluster tests (and `root` ones) need root. In CI they must run (never a quiet skip); on a
    # developer's non-root machine they are skipped with a reason.
    if os.geteuid() == 0 or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="needs root (network namespaces, root-owned files); run scripts/test.sh as root")
    for item in items:
        if "cluster" in item.keywords or "root" in item.keywords or "boot" in item.keywords:
            item.add_marker(skip)
