"""The platforms a cluster boots on, as data: the one place these facts live.

`AWS` is what `pulumi up` boots (the AMI, its OS, Python, Slurm from its apt, driver,
EFA); `LOCAL` is the local cluster (this machine's Debian 12 in network namespaces).
The AMI look-up (infra/ami.py), the rendered files (bootstrap/render.py and the
templates, through `ClusterFacts.platform`) and the tests (tests/test_target_pins.py,
tests/test_slurm_keys.py) read these facts; nothing else states them. Why Ubuntu 24.04:
docs/PLATFORM.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str  # short key: "aws", "local"
    os: str  # distribution and release, e.g. "Ubuntu 24.04"
    # EC2 image name pattern (get_ami's name filter, owner amazon); None: not an AMI.
    ami_name: str | None
    python: str  # the OS's python3 ("3.12"): the training venv's interpreter
    slurm: str  # major.minor of the OS's slurm-wlm package ("23.11")
    # pip --platform tags of the nodes (wheels the GPU nodes can install).
    wheel_platforms: tuple[str, ...]
    nvidia_driver: str | None  # driver branch shipped by the image; None: no real GPU
    cuda: str | None
    efa_dir: str | None  # EFA installer's prefix (fi_info, libfabric); None: no EFA
    ofi_nccl_dir: str | None  # aws-ofi-nccl (NCCL's libfabric plugin)
    # Whether slurmd can confine jobs with cgroups (proctrack/cgroup, task/cgroup,
    # cgroup.conf). A network-namespace host has no delegated cgroup tree.
    cgroup: bool
    gpu_device_prefix: str  # gres.conf File= prefix: /dev/nvidia, or stand-in files
    init: str  # "systemd" (units, drop-ins) or "hostctl" (localcluster/hostctl.sh)

    @property
    def real_gpus(self) -> bool:
        """True where an NVIDIA driver must be opened before the device files exist."""
        return self.nvidia_driver is not None

    def describe(self) -> str:
        gpu = f"NVIDIA driver {self.nvidia_driver}, CUDA {self.cuda}" if self.real_gpus else "stand-in GPU files"
        return f"{self.os}, Python {self.python}, Slurm {self.slurm}, {gpu}"


MANYLINUX_X86_64 = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "linux_x86_64")

# The AWS Deep Learning Base image for Ubuntu 24.04 (release notes: Python 3.12, driver
# 595.x, CUDA 13.x, EFA 1.47+, aws-ofi-nccl 1.18+; G4dn, G5, G6, G6e, P4d, P5).
# Ubuntu 24.04's slurm-wlm is 23.11. The ARM64 build has "ARM64" in its name and is
# excluded by the architecture filter.
AWS = Platform(
    name="aws",
    os="Ubuntu 24.04",
    ami_name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *",
    python="3.12",
    slurm="23.11",
    wheel_platforms=MANYLINUX_X86_64,
    nvidia_driver="595",
    cuda="13",
    efa_dir="/opt/amazon/efa",
    ofi_nccl_dir="/opt/amazon/ofi-nccl",
    cgroup=True,
    gpu_device_prefix="/dev/nvidia",
    init="systemd",
)

# The local cluster: Debian 12's packages (slurm-wlm 22.05, python3 3.11) in network
# namespaces of this machine; no cgroup delegation, GPUs are plain files.
LOCAL = Platform(
    name="local",
    os="Debian 12",
    ami_name=None,
    python="3.11",
    slurm="22.05",
    wheel_platforms=MANYLINUX_X86_64,
    nvidia_driver=None,
    cuda=None,
    efa_dir=None,
    ofi_nccl_dir=None,
    cgroup=False,
    gpu_device_prefix="/var/lib/slurm/gpu-standin/nvidia",
    init="hostctl",
)

PLATFORMS = {p.name: p for p in (AWS, LOCAL)}


def platform(name: str) -> Platform:
    try:
        return PLATFORMS[name]
    except KeyError:
        raise ValueError(f"unknown platform {name!r}; known: {', '.join(PLATFORMS)}") from None
