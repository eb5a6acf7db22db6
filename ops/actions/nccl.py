"""NCCL's transport picture, read from the `NCCL_DEBUG=INFO` lines of a job log.

NCCL logs one line per connection it builds, e.g.

    gpu-node-02:41:97 [2] NCCL INFO Channel 00 : 6[2] -> 7[3] via SHM/direct/direct
    gpu-node-02:41:97 [3] NCCL INFO Channel 00/0 : 7[3] -> 0[0] [send] via NET/Libfabric/0

Links over SHM or P2P stay inside a node; links over NET cross nodes. A NET link
is logged twice (the [send] side and the [receive] side), so links are counted
once per (channel, from, to). The network it chose shows as "Using network X" and,
with the aws-ofi-nccl plugin, "NET/OFI Selected provider is efa".
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_CHANNEL = re.compile(
    r"NCCL INFO Channel (?P<chan>\d+)(?:/\d+)? : (?P<src>\d+)\[\w+\] -> (?P<dst>\d+)\[\w+\]"
    r"(?: \[(?:send|receive)\])? via (?P<via>\S+(?: [A-Za-z]\S*)*)"
)
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (?P<prov>[\w;:-]+)")
_NETWORK = re.compile(r"NCCL INFO Using network (?P<net>.+?)\s*$")
_INTRA = ("SHM", "P2P", "NVLS")


@dataclass
class NcclPicture:
    intra: Counter = field(default_factory=Counter)  # transport ("SHM", "P2P/IPC") -> links
    inter: Counter = field(default_factory=Counter)  # transport ("NET/Libfabric") -> links
    providers: set[str] = field(default_factory=set)
    networks: set[str] = field(default_factory=set)
    lines: int = 0  # NCCL INFO lines seen

    @property
    def intra_links(self) -> int:
        return sum(self.intra.values())

    @property
    def inter_links(self) -> int:
        return sum(self.inter.values())

    def describe(self) -> str:
        if not self.lines:
            return "no NCCL lines in the log (no NCCL in this run: CPU training uses gloo)"
        parts = [
            f"{self.intra_links} links inside a node ({_fmt(self.intra) or 'none'})",
            f"{self.inter_links} across nodes ({_fmt(self.inter) or 'none'})",
        ]
        if self.networks:
            parts.append("network " + ", ".join(sorted(self.networks)))
        if self.providers:
            parts.append("provider " + ", ".join(sorted(self.providers)))
        return "; ".join(parts)

    def warnings(self, expect_efa: bool) -> list[str]:
        out = []
        if expect_efa and self.lines and "NET/Socket" in _families(self.inter):
            out.append("NCCL used TCP sockets (NET/Socket) between nodes, not EFA: check FI_PROVIDER "
                       "and the aws-ofi-nccl library path")
        if expect_efa and self.lines and not self.providers and self.inter_links:
            out.append("NCCL never reported 'NET/OFI Selected provider': the EFA plugin was not loaded")
        return out


def _family(via: str) -> str:
    """'NET/Libfabric/0/GDRDMA' -> 'NET/Libfabric', 'SHM/direct/direct' -> 'SHM', 'P2P/IPC' -> 'P2P/IPC'."""
    head, _, rest = via.partition("/")
    if head == "NET":
        return "NET/" + rest.split("/")[0] if rest else "NET"
    if head == "P2P":
        return "P2P/" + rest.split("/")[0] if rest else "P2P"
    return head


def _families(counter: Counter) -> set[str]:
    return set(counter)


def _fmt(counter: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()))


def parse(lines) -> NcclPicture:
    """Parse an iterable of log lines (srun -l prefixes such as '3: ' are fine)."""
    pic = NcclPicture()
    seen: set[tuple[str, str, str]] = set()
    for line in lines:
        if "NCCL INFO" not in line:
            continue
        pic.lines += 1
        if m := _CHANNEL.search(line):
            key = (m["chan"], m["src"], m["dst"])
            if key in seen:
                continue
            seen.add(key)
            fam = _family(m["via"])
            (pic.intra if fam.startswith(_INTRA) else pic.inter)[fam] += 1
        elif m := _PROVIDER.search(line):
            pic.providers.add(m["prov"].rstrip(","))
        elif m := _NETWORK.search(line):
            pic.networks.add(m["net"])
    return pic
