"""Build the boot test's cached images, apt repositories and wheelhouses ahead of the test:
`python -m boottest.prebuild [PLATFORM ...]` (default: every boot platform).

The test session starts this in the background when boot tests are selected (tests/conftest.py)
and runs them last, so a fresh CI machine's downloads and debootstraps overlap the other tests
instead of adding to the run. Each entry is built under its lock (boottest/cache.py): a boot test
that gets there first builds it itself, and the other waits and reuses it."""

from __future__ import annotations

import sys
import time

from boottest import boot_cluster as cluster
from cluster.platform import platform
from cluster.targets.boot import BOOT


def main(argv: list[str]) -> int:
    plats = [platform(name) for name in argv] or list(BOOT.platforms)
    for plat in plats:
        t0 = time.monotonic()
        bc = cluster.BootCluster(plat)
        bc.build()
        print(f"boottest.prebuild: {plat.name} ready in {time.monotonic() - t0:.1f} s: {bc.timings}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
