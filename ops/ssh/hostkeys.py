"""Pinned SSH host keys: one known_hosts file per cluster, and what fills it.

fab never accepts a host key it has not been given: each connection gets the pinned keys
of its host (by node name, so a controller whose public IP changed after a stop/start is
still recognised) and paramiko's RejectPolicy; `fab ssh` runs OpenSSH with
StrictHostKeyChecking=yes and HostKeyAlias=<node name> on the same file.

The keys come from a source an attacker on the network path cannot forge:
- AWS: the host keys printed to each instance's console output at first boot, by the
  bootstrap as it starts and by cloud-init when it ends (`-----BEGIN SSH HOST KEY KEYS-----`,
  checked against the fingerprint block printed with it),
  read through the EC2 API with the `aws` CLI (`aws ec2 get-console-output`), the same
  way for GPU nodes (no public IP needed).
  What a node prints is not all the node's own: a step's output can carry text from /scratch
  or the network. So the pin comes from the bootstrap's own block, the one before its first
  step line (nothing a step prints can come before it); every other block on the console (cloud-init's
  at the end of boot) must hold the same keys, else nothing is pinned. Markers count only as whole
  lines (after cloud-init's `logger -t ec2` prefix): cloud-init's tools/write-ssh-key-fingerprints
  prints them so, and cc_keys_to_console writes its output to the console.
  And no step's output reaches the console at all: cloud-init's output goes to
  /var/log/cloud-init-output.log alone, and the bootstrap writes only its own lines there
  (bootstrap/templates/cloud-config.yaml.j2, `to_console` in bootstrap/scripts/_steps.sh.j2). So a
  console that EC2 cut to its newest 64 KB
  (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_GetConsoleOutput.html), long kernel
  boot messages before the bootstrap, say, still holds only blocks the host's own programs printed.
  The file lives in ~/.config/slurm-gpu/<cluster>-<controller instance id>/known_hosts.
- The local cluster: the keys `fab local.up` generated, written when it comes up
  (/var/lib/slurm-gpu-local/known_hosts, named by the inventory's access.known_hosts).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import UserError

KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")
CONFIG_HOME = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "slurm-gpu"
KEYS_BEGIN, KEYS_END = "-----BEGIN SSH HOST KEY KEYS-----", "-----END SSH HOST KEY KEYS-----"
FP_BEGIN, FP_END = "-----BEGIN SSH HOST KEY FINGERPRINTS-----", "-----END SSH HOST KEY FINGERPRINTS-----"
# What may stand before a marker or a key on its line: cloud-init pipes its block through
# `logger --stderr -t ec2` (`<14>Dec  4 01:02:03 ec2: `, or `ec2: `); the bootstrap's lines are bare.
_PREFIX = r"(?:<\d{1,3}>)?(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d )?(?:ec2: ?)?"
_KEY = re.compile(_PREFIX + r"(?P<type>" + "|".join(map(re.escape, KEY_TYPES))
                  + r") (?P<blob>AAAA[A-Za-z0-9+/]+={0,3})(?: [^\s].*)?\s*")
_FP = re.compile(r"\b\d+ (?P<fp>SHA256:[A-Za-z0-9+/]+)\b")
# The bootstrap's first step line (bootstrap/scripts/_steps.sh.j2, run_steps: `log "step ${s}"` or
# `log "skip ${s}"`): its own host key block comes before it, anything a step prints after it.
_FIRST_STEP = re.compile(r"slurm-gpu-bootstrap\([a-z-]+\): (?:step|skip) \S")
Key = tuple[str, str]  # (type, base64 blob)


class HostKeyError(UserError, RuntimeError):
    """A host key is missing, cannot be fetched, or does not match the pinned one."""


def fingerprint(key_b64: str) -> str:
    """OpenSSH's SHA256 fingerprint of a base64 public key blob (as `ssh-keygen -l` prints it)."""
    digest = hashlib.sha256(base64.b64decode(key_b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# ---------------------------------------------------------------- the file

def known_hosts_path(inv) -> Path:
    """The cluster's known_hosts: the inventory's own (local cluster), else one per stack."""
    if inv.access.known_hosts:
        return Path(inv.access.known_hosts)
    ctl_id = _instance_ids(inv).get(inv.controller.name, "no-instance-id")
    return CONFIG_HOME / f"{inv.cluster_name}-{ctl_id}" / "known_hosts"


def _instance_ids(inv) -> dict[str, str]:
    """Host name -> EC2 instance id: what `pulumi up` made (none for clusters on this machine)."""
    return inv.aws.instance_ids if inv.aws else {}


def write_known_hosts(path: Path, entries: Iterable[tuple[Iterable[str], Iterable[str]]]) -> None:
    """entries: (names of a host, its public key lines). Written atomically, mode 0644."""
    lines = []
    for names, keys in entries:
        for key in keys:
            keytype, blob = key.split()[:2]
            lines.append(f"{','.join(names)} {keytype} {blob}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines))
    tmp.chmod(0o644)
    tmp.replace(path)


def read_known_hosts(path: Path) -> dict[str, list[Key]]:
    """name -> pinned keys (hashed or marker lines are not ours and are skipped)."""
    pins: dict[str, list[Key]] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return pins
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or line.startswith(("#", "@", "|")) or parts[1] not in KEY_TYPES:
            continue
        for name in parts[0].split(","):
            pins.setdefault(name, []).append((parts[1], parts[2]))
    return pins


# ---------------------------------------------------------------- EC2 console output

REFUSED = ("fab pins no key from it. Check the host's keys another way (the EC2 serial console or "
           "Session Manager: `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`) and add `<node name> "
           "<type> <key>` lines to the cluster's known_hosts, or replace the instance")


@dataclass
class _Block:
    start: int  # line number of its BEGIN marker
    lines: list[str]


def parse_console_output(text: str) -> list[Key]:
    """The host keys of the bootstrap's own KEYS block (the first, before the bootstrap's first step),
    each checked against the FINGERPRINTS block printed just before it. Refused: a console whose KEYS
    blocks do not all hold the same keys (a forged block beside the real one), a first block printed
    after the steps began (it may be a step's output), a marker inside a block."""
    lines = text.splitlines()
    keys_blocks, fp_blocks = _blocks(lines, KEYS_BEGIN, KEYS_END), _blocks(lines, FP_BEGIN, FP_END)
    if not keys_blocks:
        raise HostKeyError("the console output holds no SSH HOST KEY KEYS block yet (the bootstrap "
                           "prints it as it starts, a minute or two into the first boot); wait a "
                           "minute and retry")
    first = keys_blocks[0]
    first_step = next((i for i, line in enumerate(lines) if _FIRST_STEP.match(line)), len(lines))
    if first.start > first_step:
        raise HostKeyError("the console's first SSH HOST KEY KEYS block was printed after the bootstrap's "
                           "steps began (the bootstrap's own block, printed before them, is not in the "
                           "console output EC2 keeps), so it may be a step's output: " + REFUSED)
    keys = _keys(first)
    if not keys:
        raise HostKeyError("the console output's SSH HOST KEY KEYS block holds no public key")
    for other in keys_blocks[1:]:
        if sorted(_keys(other)) != sorted(keys):
            raise HostKeyError(f"the console output holds {len(keys_blocks)} SSH HOST KEY KEYS blocks with "
                               "different keys: something on the host printed a forged block; " + REFUSED)
    fps = [b for b in fp_blocks if b.start < first.start]
    if fps:
        printed = {m["fp"] for line in fps[-1].lines for m in [_FP.search(line)] if m}
        for keytype, blob in keys:
            if fingerprint(blob) not in printed:
                raise HostKeyError(f"the console's {keytype} key ({fingerprint(blob)}) is not among the "
                                   f"fingerprints printed with it ({', '.join(sorted(printed))})")
    return keys


def _keys(block: _Block) -> list[Key]:
    """The public keys of a KEYS block: lines that are a key and nothing else (prefix aside)."""
    return [(m["type"], m["blob"]) for line in block.lines for m in [_KEY.fullmatch(line)] if m]


def _marker(line: str, marker: str) -> bool:
    """`line` is `marker` as a whole line (prefix aside), not text that merely holds it."""
    return re.fullmatch(_PREFIX + re.escape(marker) + r"\s*", line) is not None


def _blocks(lines: list[str], begin: str, end: str) -> list[_Block]:
    blocks, current = [], None
    for i, line in enumerate(lines):
        if _marker(line, begin):
            if current is not None:
                raise HostKeyError(f"the console output holds a {begin} line inside another such block "
                                   "(a forged or garbled block); " + REFUSED)
            current = _Block(i, [])
        elif _marker(line, end) and current is not None:
            blocks.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    return blocks


def console_output(instance_id: str, region: str | None) -> str:
    """The instance's console output through the EC2 API (the `aws` CLI and its credentials)."""
    if not shutil.which("aws"):
        raise HostKeyError(
            "no pinned host keys for this cluster and no `aws` CLI to read them: install the AWS CLI "
            "(with the credentials you ran `pulumi up` with); fab reads the host keys cloud-init "
            "prints to each instance's console output (`aws ec2 get-console-output`)")
    cmd = ["aws", "ec2", "get-console-output", "--instance-id", instance_id, "--latest", "--output", "json"]
    if region:
        cmd += ["--region", region]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise HostKeyError(f"`{' '.join(cmd)}` failed: {(res.stderr or res.stdout).strip()[-400:]}")
    output = json.loads(res.stdout or "{}").get("Output") or ""
    if output and KEYS_BEGIN not in output:
        try:  # the API returns base64; CLI v2 decodes it, older CLIs may not
            output = base64.b64decode(output, validate=True).decode("utf-8", "replace")
        except ValueError:
            pass
    return output


def fetch_from_ec2(inv, names: Iterable[str]) -> dict[str, list[Key]]:
    """name -> keys read from each instance's console output (AWS inventories carry the ids)."""
    ids = _instance_ids(inv)
    region = inv.facts.region
    out = {}
    for name in names:
        if name not in ids:
            raise HostKeyError(f"no pinned host key for {name} and the inventory has no instance id for it; "
                               "run `pulumi up` to refresh the stack's outputs")
        try:
            out[name] = parse_console_output(console_output(ids[name], region))
        except HostKeyError as exc:
            where = f" ({known_hosts_path(inv)})" if "known_hosts" in str(exc) else ""
            raise HostKeyError(f"{name} ({ids[name]}): {exc}{where}") from None
    return out


# ---------------------------------------------------------------- pins for connections

class Pins:
    """The pinned keys of one cluster, loaded once; missing hosts fetched from EC2 once."""

    def __init__(self, inv):
        self.inv = inv
        self.path = known_hosts_path(inv)
        self._lock = threading.Lock()
        self._keys: dict[str, list[Key]] | None = None

    def keys(self, name: str) -> list[Key]:
        with self._lock:
            if self._keys is None:
                self._keys = read_known_hosts(self.path)
            missing = [n.name for n in self.inv.nodes if not self._keys.get(n.name)]
            if name in missing:
                if not _instance_ids(self.inv):
                    raise HostKeyError(f"no pinned host key for {name} in {self.path}; "
                                       + ("bring the cluster up again with `fab local.up`"
                                          if self.inv.access.known_hosts else
                                          "run `pulumi up` so the inventory names the instances"))
                fetched = fetch_from_ec2(self.inv, missing)
                self._keys.update(fetched)
                write_known_hosts(self.path, [((n,), [f"{t} {b}" for t, b in self._keys[n]])
                                              for n in sorted(self._keys)])
            return list(self._keys[name])


def mismatch_message(name: str, address: str, path: Path, expected: list[Key], presented: Key) -> str:
    want = ", ".join(f"{fingerprint(b)} ({t})" for t, b in expected)
    return (f"host key of {name} ({address}) does not match the key pinned in {path}: expected {want}, "
            f"presented {fingerprint(presented[1])} ({presented[0]}). Someone may be intercepting the "
            f"connection: do not connect. If {name} was really rebuilt, delete its lines from {path} and "
            "run the command again (fab re-reads the keys from the EC2 console output; locally "
            "`fab local.up` writes them).")
