"""Boot the boot test's cluster by hand, to look inside: `python -m boottest [PLATFORM]`
(default boot-debian12). Boots the three roles, waits for cloud-init, prints each host's state
and how to reach it, then holds until Ctrl-C (or SIGTERM) and tears everything down."""

from __future__ import annotations

import signal
import sys

from boottest import boot_cluster as cluster
from boottest import teardown
from cluster.platform import platform


def main(argv: list[str]) -> int:
    plat = platform(argv[0] if argv else "boot-debian12")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM tears down as Ctrl-C does
    teardown.everything()
    bc = cluster.BootCluster(plat)
    try:
        bc.up()
        print(f"boottest: {plat.name} containers started; waiting for cloud-init", flush=True)
        for name, st in bc.wait_cloud_init().items():
            print(f"  {name:12} cloud-init {st.get('status')} {st.get('errors') or ''}", flush=True)
        print(f"boottest: `fab status --target boot`, `fab train --target boot`; timings {bc.timings}\n"
              "boottest: Ctrl-C tears it down", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        print("boottest: interrupted; tearing down", flush=True)
    finally:
        bc.down()
        left = teardown.leftovers()
        print(f"boottest: torn down; left: {left or 'nothing'}", flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
