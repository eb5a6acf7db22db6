"""Pinned SSH host keys: one known_hosts file per cluster, and what fills it.

fab never accepts a host key it has not been given: paramiko loads this file and uses
RejectPolicy, and `fab ssh` runs OpenSSH with StrictHostKeyChecking=yes on the same file.
The keys come from a source an attacker on the network path cannot forge: on AWS the
host keys cloud-init prints to the instance's console output, read through the EC2 API
(`parse_console_output`); on the local cluster the keys `fab local.up` generated.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")


class HostKeyError(RuntimeError):
    pass


def fingerprint(key_b64: str) -> str:
    """OpenSSH's SHA256 fingerprint of a base64 public key blob (as `ssh-keygen -l` prints it)."""
    digest = hashlib.sha256(base64.b64decode(key_b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_line(names: Iterable[str], key: str) -> str:
    """`name1,name2 <type> <base64>` (the key without its comment)."""
    keytype, blob = key.split()[:2]
    return f"{','.join(names)} {keytype} {blob}"


def write_known_hosts(path: Path, entries: Iterable[tuple[Iterable[str], Iterable[str]]]) -> None:
    """entries: (names of a host, its public keys). Written atomically, mode 0644."""
    lines = [known_hosts_line(names, key) for names, keys in entries for key in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.chmod(0o644)
    tmp.replace(path)


_KEY_LINE = re.compile(r"^(?P<type>" + "|".join(map(re.escape, KEY_TYPES)) + r") (?P<blob>[A-Za-z0-9+/]+={0,3})(\s|$)")
