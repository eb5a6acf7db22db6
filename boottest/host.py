"""What the boot test reads from and runs on the host: commands, and the host's own apt
mirror (the archive this machine is configured to use; the repo names no registry)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

APT_SOURCES = (Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*")))


class BootError(RuntimeError):
    pass


def run(*cmd: str, check: bool = True, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
        raise BootError(f"`{' '.join(cmd)}` exited {proc.returncode}: {out}")
    return proc


def debian_mirror() -> str:
    """The URI of the host's main Debian archive (the entry with the `main` component whose
    suite is a plain release name, not -security or -updates)."""
    for path in APT_SOURCES:
        if not path.is_file():
            continue
        text = path.read_text()
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
                suites = fields.get("Suites", "").split()
                if "main" in fields.get("Components", "").split() and any("-" not in s for s in suites):
                    if "debian-security" not in fields.get("URIs", ""):
                        return fields["URIs"].split()[0]
        else:
            for line in text.splitlines():
                m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+([a-z]+)\s+.*\bmain\b", line)
                if m and "security" not in m.group(1):
                    return m.group(1)
    raise BootError("no Debian archive in this host's apt sources (/etc/apt/sources.list*): the boot "
                    "test builds its images and package repository from the archive apt is configured for")
