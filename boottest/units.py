"""Which systemd units may have failed on a settled boot-test host.

systemd calls a booted system "degraded" as soon as any unit failed, so "running or degraded"
would call a host settled with slurmd, munge or a bootstrap unit failed. A host is settled only
when systemd finished booting and no unit failed but those below: units that cannot run in a
systemd-nspawn container whatever we render, each with its reason (docs/BOOTTEST.md lists them).
"""

from __future__ import annotations

# unit -> why it cannot run in a container. Keep it short: every entry hides a failure.
ALLOWED_FAILED: dict[str, str] = {
    "proc-fs-nfsd.mount": (
        "the NFS server's control file system (type nfsd, from the kernel's nfsd module) on "
        "/proc/fs/nfsd; a container cannot load a kernel module (`mount: unknown filesystem type "
        "'nfsd'` where the machine's kernel has not loaded it), and the boot platforms run no NFS "
        "server"),
    "run-rpc_pipefs.mount": (
        "the RPC pipe file system (type rpc_pipefs, from the kernel's sunrpc module) on "
        "/run/rpc_pipefs, for rpc.gssd and rpc.idmapd (Kerberos NFS and NFSv4 id mapping, unused "
        "here); a container cannot load a kernel module (`mount: unknown filesystem type "
        "'rpc_pipefs'`)"),
}

FAILED_CMD = "systemctl list-units --state=failed --all --plain --no-legend --no-pager --full"


def parse_failed(text: str) -> list[str]:
    """The unit names in FAILED_CMD's output (one unit a line, its name first)."""
    return sorted({line.split()[0] for line in text.splitlines() if line.strip()})


def not_allowed(failed: list[str]) -> list[str]:
    """The failed units that make a host not settled."""
    return [u for u in failed if u not in ALLOWED_FAILED]
