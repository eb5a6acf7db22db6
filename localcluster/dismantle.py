"""Taking a local cluster down: every process in its namespaces, the namespaces, veths and
bridge, the mount points `up` made and the runtime files. Keeps /scratch and the SSH keys.

Works from the saved state when there is one and from what it finds by name (namespaces
sgpu-*, veths sgv*, bridge sgpu0) when there is none, so a cluster whose state file is
lost or unreadable is removed all the same.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from localcluster import hosts, netns
from localcluster import topology as layout
from localcluster.preflight import ClusterError
from localcluster.state import ClusterState


def namespaces() -> set[str]:
    """The network namespace ids ("net:[ino]") of the cluster's hosts: those of its named namespaces (sgpu-*,
    which `ip netns add` bind-mounts under /run/netns). Every process of a host is in its named network
    namespace (hosts.start_holder enters it, and every command there enters the holder's), so these ids find
    them all. The ids a state file recorded are not used: the kernel reuses namespace inode numbers, and once
    a host's holder is gone its mount and UTS ids may be another process's (a container's, another tool's),
    which must never be killed."""
    ns = set()
    for name in netns.our_netns():
        try:
            ns.add(f"net:[{os.stat(netns.netns_path(name)).st_ino}]")
        except OSError:
            pass
    return ns


def leftovers() -> list[str]:
    """What of a local cluster exists on this machine (empty when nothing)."""
    found = [f"namespace {n}" for n in netns.our_netns()]
    found += [f"link {v}" for v in netns.our_veths()]
    if netns.link_exists(layout.BRIDGE):
        found.append(f"bridge {layout.BRIDGE}")
    ns = namespaces()
    found += [f"process {p}" for p in hosts.processes_in(ns) if hosts.alive(p)] if ns else []
    return found


def teardown(state: ClusterState | None, out: Callable[[str], None]) -> None:
    """Remove the cluster (see the module docstring); ClusterError naming what is left, if any."""
    t0 = time.monotonic()
    was_up = state is not None or bool(leftovers())
    survivors = hosts.kill_all(namespaces())
    hosts.reap()
    indexes = {e.netns: e.index for e in (state.hosts if state else ())}
    for name in set(indexes) | set(netns.our_netns()):
        netns.delete_host(name, indexes.get(name))
    for veth in netns.our_veths():
        netns.ip("link", "del", veth, check=False)
    netns.delete_bridge()
    _unmount_empty_netns_dir()
    for mp in state.made_mount_points if state else ():
        try:
            Path(mp).rmdir()
        except OSError:
            pass
    for path in (layout.HOSTS_DIR, layout.ETC_SLURM, layout.ETC_SLURM_GPU, layout.BIN_DIR):
        shutil.rmtree(path, ignore_errors=True)
    for path in (layout.INVENTORY, layout.STATE_FILE):
        path.unlink(missing_ok=True)
    left = leftovers() + [f"process {p}" for p in survivors]
    if left:
        raise ClusterError(f"local.down could not remove: {', '.join(left)}")
    if not was_up:  # idempotent (`fab local.down && fab local.up`), but say that nothing was there
        out(f"no local cluster was up: nothing to stop; kept {layout.SCRATCH} and {layout.SSH_DIR}")
        return
    out(f"local cluster down ({time.monotonic() - t0:.1f} s); kept {layout.SCRATCH} and {layout.SSH_DIR}")


def _unmount_empty_netns_dir() -> None:
    """`ip netns add` turns /run/netns into a mount point; undo it once no namespace is left."""
    if netns.NETNS_DIR.is_dir() and not any(netns.NETNS_DIR.iterdir()):
        while subprocess.run(["mountpoint", "-q", str(netns.NETNS_DIR)]).returncode == 0:
            if subprocess.run(["umount", str(netns.NETNS_DIR)], capture_output=True).returncode:
                break
