"""The boot test's harness: the cluster's three roles booted for real, in systemd-nspawn
containers (systemd as PID 1, cloud-init NoCloud running the stack's own user-data),
from cached Debian images, with packages from a local apt repository and wheelhouse.

Modules: cache (where built things live), host (the host's apt mirror, commands),
images (debootstrap), aptrepo (the local apt repository), wheelhouse (the GPU nodes' pins),
nspawn (one container), cluster (the three roles), teardown (nothing left behind).
What the boot test stands in for, per platform: docs/BOOTTEST.md.
"""
