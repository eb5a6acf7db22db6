"""Which configuration keys each Slurm version accepts, for the files bootstrap/ renders.

Slurm refuses to start on a key it does not know, and the two platforms run different
Slurm versions (cluster/platform.py: 22.05 locally, 23.11 on AWS): a key that only one
of them knows would pass every local test and stop the other at first boot. This table is
what tests/unit/test_slurm_keys.py checks every rendered file against. It lists the keys the
project renders or may reasonably render, not Slurm's whole vocabulary; a new key goes in
here after checking the version's parser. Source: `slurm_conf_options`,
`_nodename_options`, `_partition_options` (src/common/read_config.c), the cgroup.conf
`options` (src/common/cgroup.c, src/interfaces/cgroup.c) and `_gres_options`
(src/common/gres.c, src/interfaces/gres.c) of slurm-22.05.8 (Debian 12) and
slurm-23.11.4 (Ubuntu 24.04), and slurm-24.11.5 (Debian 13, the boot test's newer
platform), which accepts every key of the 23.11 table. The 22.05 table is also checked
against this machine's installed libslurmfull.
"""

from __future__ import annotations

_SLURM_CONF_COMMON = frozenset({
    "AccountingStorageType", "AuthInfo", "AuthType", "ClusterName", "CredType", "CryptoType",
    "DefMemPerCPU", "EnforcePartLimits", "GresTypes", "HealthCheckInterval", "HealthCheckNodeState",
    "HealthCheckProgram", "InactiveLimit", "JobAcctGatherType", "JobCompType", "JobRequeue",
    "KillOnBadExit", "KillWait", "MessageTimeout", "MinJobAge", "MpiDefault", "PrologFlags",
    "PropagateResourceLimits", "PropagateResourceLimitsExcept", "ProctrackType", "ResumeProgram",
    "ResumeRate", "ResumeTimeout", "ReturnToService", "SchedulerParameters", "SchedulerType", "SelectType",
    "SelectTypeParameters", "SlurmUser", "SlurmctldHost", "SlurmctldLogFile", "SlurmctldParameters",
    "SlurmctldPidFile", "SlurmctldPort", "SlurmctldTimeout", "SlurmdLogFile", "SlurmdPidFile",
    "SlurmdPort", "SlurmdSpoolDir", "SlurmdTimeout", "StateSaveLocation", "SuspendExcNodes",
    "SuspendProgram", "SuspendRate", "SuspendTime", "SuspendTimeout", "TaskPlugin",
    "TaskPluginParam", "TreeWidth", "UnkillableStepTimeout",
    # Lines that start a node or partition definition (their own keys: NODE_KEYS, PARTITION_KEYS).
    "NodeName", "PartitionName",
})
_NODE_COMMON = frozenset({
    "NodeName", "NodeAddr", "NodeHostname", "CPUs", "Boards", "Sockets", "CoresPerSocket",
    "ThreadsPerCore", "RealMemory", "Gres", "Features", "State", "Weight", "TmpDisk",
})
_PARTITION_COMMON = frozenset({
    "PartitionName", "Nodes", "Default", "MaxTime", "DefaultTime", "State", "OverSubscribe",
    "MaxNodes", "DefMemPerCPU", "SuspendTime", "ResumeTimeout", "SuspendTimeout",
})
_GRES_COMMON = frozenset({
    "NodeName", "Name", "Type", "File", "Count", "Cores", "CPUs", "Flags", "Links", "AutoDetect",
})
_CGROUP_COMMON = frozenset({
    "CgroupPlugin", "ConstrainCores", "ConstrainDevices", "ConstrainRAMSpace", "ConstrainSwapSpace",
    "AllowedRAMSpace", "AllowedSwapSpace", "IgnoreSystemd", "IgnoreSystemdOnFailure",
    "MaxRAMPercent", "MinRAMSpace", "CgroupMountpoint",
})

# version -> file kind -> accepted keys. "slurm.conf:NodeName" and "slurm.conf:PartitionName":
# the keys of a NodeName= / PartitionName= line.
ACCEPTED_KEYS: dict[str, dict[str, frozenset[str]]] = {
    "22.05": {
        "slurm.conf": _SLURM_CONF_COMMON,
        "slurm.conf:NodeName": _NODE_COMMON,
        "slurm.conf:PartitionName": _PARTITION_COMMON,
        "gres.conf": _GRES_COMMON,
        # 22.05 still knows cgroup v1's kernel-memory keys (removed in 23.11).
        "cgroup.conf": _CGROUP_COMMON | {"ConstrainKmemSpace", "AllowedKmemSpace"},
    },
    "23.11": {
        # New in 23.11: SuspendExcStates, MaxBatchRequeue.
        "slurm.conf": _SLURM_CONF_COMMON | {"SuspendExcStates", "MaxBatchRequeue"},
        "slurm.conf:NodeName": _NODE_COMMON,
        "slurm.conf:PartitionName": _PARTITION_COMMON,
        "gres.conf": _GRES_COMMON,
        "cgroup.conf": _CGROUP_COMMON | {"EnableControllers"},
    },
}
# 24.11.5 reads every key of the 23.11 table (checked in its read_config.c, gres.c, cgroup.c).
ACCEPTED_KEYS["24.11"] = dict(ACCEPTED_KEYS["23.11"])

# Old names every version above still reads but only as aliases of the new: rendered files use
# the new name. Slurm 22.05 renamed CryptoType (crypto/munge) to CredType (cred/munge); its
# read_config.c reads CryptoType only when CredType is absent, swapping crypto/ for cred/.
RENAMED_KEYS = {"CryptoType": "CredType"}


def config_keys(text: str, kind: str = "slurm.conf") -> list[tuple[str, str]]:
    """(line kind, key) of every setting in a Slurm config file's text. In slurm.conf the first
    word of a line is a file key and the other words of a NodeName=/PartitionName= line are
    that line's keys ("NodeName", key); in gres.conf and cgroup.conf every word is a key."""
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if kind != "slurm.conf":
            found += [("", w.split("=", 1)[0]) for w in words]
            continue
        first = words[0].split("=", 1)[0]
        found.append(("", first))
        if first in ("NodeName", "PartitionName") and len(words) > 1:
            found += [(first, w.split("=", 1)[0]) for w in words[1:]]
    return found


def unknown_keys(text: str, kind: str, version: str) -> list[str]:
    """Keys of `text` (a `kind` file) that Slurm `version` does not accept (case-insensitive,
    as Slurm reads them)."""
    if version not in ACCEPTED_KEYS:
        raise ValueError(f"no key table for Slurm {version}; known: {', '.join(ACCEPTED_KEYS)}")
    table = ACCEPTED_KEYS[version]
    bad = []
    for sub, key in config_keys(text, kind):
        accepted = table[f"{kind}:{sub}"] if sub else table[kind]
        if key.lower() not in {k.lower() for k in accepted}:
            bad.append(f"{sub + ' ' if sub else ''}{key}")
    return bad
