"""Instance-type facts -> what Slurm is told about a GPU node, and where it can run.

`aws.ec2.get_instance_type` is asked at plan time, so slurm.conf's node lines and
gres.conf follow the instance type the user chose, not constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi_aws as aws

from cluster.facts import NodeShape
from cluster.stack_config import StackConfig
from infra.config import PlanError

# GPUs whose boards join their GPUs with NVLink. For the others (PCIe only) jobs
# set NCCL_P2P_DISABLE=1: the baseline saw the first collective stall on L4 without it.
NVLINK_GPUS = frozenset({"v100", "a100", "h100", "h200", "b200", "b300", "gb200"})

# The AMI (and so the cluster) is x86_64 Ubuntu.
ARCH = "x86_64"

# Types whose GPUs are joined by NVSwitch: CUDA fails to initialise on them unless
# nvidia-fabricmanager runs (nvidia-smi -L still lists the GPUs). The GPU bootstrap starts and
# requires it there, and the health check drains a node where it stops. EC2 does not report
# NVSwitch; this is NVIDIA's HGX board of each type (A100 on p4d/p4de, H100/H200 on p5*).
NVSWITCH_TYPES = frozenset({"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge",
                            "p5en.48xlarge"})

# CPU sockets of the types that are a whole two-socket host (EC2 reports cores and threads per
# core, not sockets); every other type shows its guest one socket. A wrong count here is only
# a different split of the same cores: slurmd re-splits it and slurmctld checks the totals.
TWO_SOCKET_TYPES = frozenset({"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge",
                              "p5en.48xlarge", "g5.48xlarge", "g6.48xlarge", "g6e.48xlarge"})


@dataclass(frozen=True)
class GpuNodeFacts:
    shape: NodeShape
    nvlink: bool
    efa_supported: bool
    nvswitch: bool = False  # needs nvidia-fabricmanager (NVSWITCH_TYPES)
    # EFA interfaces a node gets: one per network card that takes one (g6.12xlarge 1,
    # p4d.24xlarge 4, p5.48xlarge 32); 0 when slurm-gpu:efa is off.
    efa_interfaces: int = 0


def efa_interface_count(info, *, efa: bool) -> int:
    """One EFA per network card, as far as the type allows EFA interfaces at all."""
    if not efa or not info.efa_supported:
        return 0
    cards = int(info.maximum_network_cards or 1)
    return max(1, min(cards, int(info.efa_maximum_interfaces or 1)))


def real_memory_mib(memory_mib: int) -> int:
    """RealMemory for slurm.conf, a little under the EC2 figure.

    The kernel sees less than the advertised memory (firmware, kernel, page tables),
    and slurmd drains a node whose RealMemory is above what it sees. The baseline
    measured the need on g6.12xlarge: 196608 MiB advertised, RealMemory=185000
    worked. 6% (at least 1 GiB) off, rounded down to 100 MiB, gives 184800 there
    and scales with the type.
    """
    reserve = max(memory_mib * 6 // 100, 1024)
    return (memory_mib - reserve) // 100 * 100


def gres_type(gpu_name: str) -> str:
    """GRES type from the GPU model: 'L4' -> 'l4', 'A10G' -> 'a10g', 'Radeon Pro V520' -> 'radeonprov520'."""
    return "".join(gpu_name.split()).lower()


def gpu_node_facts(info, *, efa: bool, setting: str = "slurm-gpu:gpuInstanceType") -> GpuNodeFacts:
    """Turn a get_instance_type result into the GPU node's Slurm facts, or refuse the type."""
    name = info.instance_type
    gpus = list(info.gpuses or [])
    if not gpus or not gpus[0].count:
        raise PlanError(
            f"{setting} is {name}, which has no GPU; pick a GPU type, e.g. "
            f"`pulumi config set {setting} g6.12xlarge`"
        )
    gpu = gpus[0]
    if (gpu.manufacturer or "").upper() != "NVIDIA":
        raise PlanError(
            f"{setting} is {name}, whose GPUs are {gpu.manufacturer} {gpu.name}; the cluster needs "
            f"NVIDIA GPUs (driver, CUDA and NCCL come with the NVIDIA AMI)"
        )
    _check_arch(info, setting)
    if efa and not info.efa_supported:
        raise PlanError(
            f"{setting} is {name}, which does not support EFA while slurm-gpu:efa is true; pick an "
            f"EFA type (e.g. g6.12xlarge, p5.48xlarge) or run over TCP with "
            f"`pulumi config set slurm-gpu:efa false`"
        )
    shape = NodeShape(
        cpus=int(info.default_vcpus),
        real_memory_mib=real_memory_mib(int(info.memory_size)),
        gpu_count=int(gpu.count),
        gpu_type=gres_type(gpu.name),
        sockets=2 if name in TWO_SOCKET_TYPES else 1,
        threads_per_core=int(info.default_threads_per_core or 1),
    )
    try:
        shape.check()
    except ValueError as exc:
        raise PlanError(f"{setting} is {name}, whose CPU facts do not add up ({exc})") from exc
    return GpuNodeFacts(shape=shape, nvlink=shape.gpu_type in NVLINK_GPUS,
                        efa_supported=bool(info.efa_supported),
                        efa_interfaces=efa_interface_count(info, efa=efa),
                        nvswitch=name in NVSWITCH_TYPES)


def _check_arch(info, setting: str) -> None:
    archs = list(info.supported_architectures or [])
    if archs and ARCH not in archs:
        raise PlanError(
            f"{setting} is {info.instance_type} ({'/'.join(archs)}); the cluster's AMI is {ARCH}, "
            f"pick an {ARCH} type"
        )


def instance_type_info(instance_type: str, setting: str):
    """get_instance_type, refusing first (naming the setting) a type the region does not
    have: the plural look-up answers an empty list where the singular one would fail
    with the provider's own error."""
    known = aws.ec2.get_instance_types(filters=[{"name": "instance-type", "values": [instance_type]}])
    if instance_type not in (known.instance_types or []):
        raise PlanError(
            f"{setting} is {instance_type}, which this region does not offer (check the name "
            f"and aws:region); set it with `pulumi config set {setting} g6.12xlarge`"
        )
    return aws.ec2.get_instance_type(instance_type=instance_type)


def lookup_gpu_node_facts(cfg: StackConfig) -> GpuNodeFacts:
    info = instance_type_info(cfg.gpu_instance_type, "slurm-gpu:gpuInstanceType")
    return gpu_node_facts(info, efa=cfg.efa)


def check_controller_type(cfg: StackConfig) -> int:
    """Refuse a controller type the AMI cannot run; its vCPUs (for the quota check)."""
    setting = "slurm-gpu:controllerInstanceType"
    info = instance_type_info(cfg.controller_instance_type, setting)
    _check_arch(info, setting)
    return int(info.default_vcpus)


def choose_availability_zone(cfg: StackConfig) -> str:
    """The configured AZ if it offers both instance types, else the first AZ that does."""
    offered: dict[str, set[str]] = {}
    for itype in {cfg.gpu_instance_type, cfg.controller_instance_type}:
        res = aws.ec2.get_instance_type_offerings(
            location_type="availability-zone",
            filters=[{"name": "instance-type", "values": [itype]}],
        )
        offered[itype] = set(res.locations or [])
    both = offered[cfg.gpu_instance_type] & offered[cfg.controller_instance_type]
    if cfg.availability_zone:
        for itype, setting in ((cfg.gpu_instance_type, "gpuInstanceType"),
                               (cfg.controller_instance_type, "controllerInstanceType")):
            if cfg.availability_zone not in offered[itype]:
                where = ", ".join(sorted(offered[itype])) or "no zone of this region"
                raise PlanError(
                    f"slurm-gpu:availabilityZone is {cfg.availability_zone}, where "
                    f"slurm-gpu:{setting} {itype} is not offered (offered in: {where}); "
                    f"change it with `pulumi config set slurm-gpu:availabilityZone ZONE`"
                )
        return cfg.availability_zone
    if not both:
        raise PlanError(
            f"no availability zone of this region offers both slurm-gpu:gpuInstanceType "
            f"{cfg.gpu_instance_type} and slurm-gpu:controllerInstanceType "
            f"{cfg.controller_instance_type}; pick other types or another aws:region"
        )
    return sorted(both)[0]
