"""The platforms a cluster boots on, as data: the one place these facts live.

`AWS` is what `pulumi up` boots (the AMI, its OS, Python, Slurm from its apt, driver,
EFA); `LOCAL` is the local cluster (this machine's Debian 12 in network namespaces).
The AMI look-up (infra/ami.py), the rendered files (bootstrap/render.py and the
templates, through `ClusterFacts.platform`) and the tests (tests/unit/test_target_pins.py,
tests/unit/test_slurm_keys.py) read these facts; nothing else states them. Why Ubuntu 24.04:
docs/PLATFORM.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MachineImage:
    """An EC2 image a role boots, found by name pattern and owner (the newest match)."""
    name: str  # get_ami's name filter
    owner: str  # get_ami's owners: an account id or alias
    gpu_stack: bool  # ships the NVIDIA driver, CUDA and EFA (the platform's nvidia_driver, efa_dir)


@dataclass(frozen=True)
class OsTorch:
    """torch from the OS's own package instead of the pinned wheel: the GPU nodes' `packages`
    step installs `package`, the training venv sees it (--system-site-packages) and pins torch
    to `version` (what pip reads from the package's metadata); the other pins install as usual."""
    package: str  # the apt package, e.g. "python3-torch"
    version: str  # torch's version as pip sees it installed (PEP 440), e.g. "2.6.0+debian"
    # Whether its TCPStore has the libuv backend, which torchrun's c10d rendezvous store always
    # asks for (torch 2.6); without it the job keeps the rendezvous in a file on the shared
    # scratch (jobs/finetune.sbatch.j2).
    libuv: bool


@dataclass(frozen=True)
class Platform:
    name: str  # short key: "aws", "local"
    os: str  # distribution and release, e.g. "Ubuntu 24.04"
    # The GPU nodes' EC2 image: get_ami's name filter; None: not an AMI (owner: ami_owner).
    ami_name: str | None
    python: str  # the OS's python3 ("3.12"): the training venv's interpreter
    slurm: str  # major.minor of the OS's slurm-wlm package ("23.11")
    # The OS's glibc (major.minor): which manylinux wheels its pip installs (`wheel_platforms`).
    glibc: str
    nvidia_driver: str | None  # driver branch shipped by the image; None: no real GPU
    cuda: str | None
    efa_dir: str | None  # EFA installer's prefix (fi_info, libfabric); None: no EFA
    ofi_nccl_dir: str | None  # aws-ofi-nccl (NCCL's libfabric plugin)
    # Whether slurmd can confine jobs with cgroups (proctrack/cgroup, task/cgroup,
    # cgroup.conf). A network-namespace host has no delegated cgroup tree.
    cgroup: bool
    gpu_device_prefix: str  # gres.conf File= prefix: /dev/nvidia, or stand-in files
    init: str  # "systemd" (units, drop-ins) or "hostctl" (localcluster/hostctl.sh)
    # The shared /scratch. nfs_server: the controller exports it with the kernel's NFS server.
    # A GPU node's fstab line mounts scratch_source ("{controller_ip}", "{scratch}" filled in) on /scratch
    # as scratch_fstype with scratch_options.
    nfs_server: bool = True
    scratch_source: str = "{controller_ip}:{scratch}"
    scratch_fstype: str = "nfs"
    scratch_options: str = "defaults,_netdev,nofail"
    # Where the controller finds the shared /scratch's own EBS volume (udev's by-id links, bootstrap
    # `scratchvol` step); None: no EBS here, /scratch stays a folder of the root file system.
    scratch_volume_dir: str | None = None
    # Debian suite the boot test's image is made from (debootstrap); None: not a boot platform.
    debian_suite: str | None = None
    # torch from the OS's package instead of requirements.txt's pin; None: the pinned wheel.
    os_torch: OsTorch | None = None
    # Who publishes the GPU nodes' image (get_ami's owners).
    ami_owner: str | None = None
    # The controller's image: the same OS release (so the same Python and Slurm from its apt)
    # without the GPU stack, on instance types the GPU image does not list (C6i...).
    # None: the controller boots the GPU nodes' image.
    controller_ami_name: str | None = None
    controller_ami_owner: str | None = None
    # Where slurmctld writes its pid file (slurm.conf SlurmctldPidFile). None: it writes none,
    # so none is named: Slurm >= 23.11's unit starts it with --systemd (Type=notify, User=slurm),
    # which skips the pid file. Slurm 22.05's Debian unit runs it as root, which writes one.
    slurmctld_pidfile: str | None = None
    arch: str = "x86_64"  # the machine (uname -m) of every role

    @property
    def wheel_platforms(self) -> tuple[str, ...]:
        """The wheel platform tags pip accepts on this OS, most specific first: what the nodes'
        `pip install` takes, and what a check for another interpreter passes as --platform."""
        return manylinux_tags(self.glibc, self.arch)

    @property
    def images(self) -> dict[str, MachineImage]:
        """Role ("controller", "gpu") -> the EC2 image it boots; empty where not an AMI."""
        if self.ami_name is None or self.ami_owner is None:
            return {}
        gpu = MachineImage(self.ami_name, self.ami_owner, gpu_stack=True)
        if self.controller_ami_name is None or self.controller_ami_owner is None:
            return {"controller": gpu, "gpu": gpu}
        return {"controller": MachineImage(self.controller_ami_name, self.controller_ami_owner,
                                           gpu_stack=False), "gpu": gpu}

    @property
    def real_gpus(self) -> bool:
        """True where an NVIDIA driver must be opened before the device files exist."""
        return self.nvidia_driver is not None

    def describe(self) -> str:
        gpu = f"NVIDIA driver {self.nvidia_driver}, CUDA {self.cuda}" if self.real_gpus else "stand-in GPU files"
        return f"{self.os}, Python {self.python}, Slurm {self.slurm}, {gpu}"


# The legacy manylinux names and the glibc they stand for (PEP 600).
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def manylinux_tags(glibc: str, arch: str) -> tuple[str, ...]:
    """Every platform tag pip accepts for wheels on a glibc `glibc` (e.g. "2.39") Linux of `arch`,
    in pip's order: manylinux_2_<minor> down to 2_5 (the legacy aliases after their 2_<minor>),
    then linux_<arch>. pip's own list (packaging.tags, _manylinux.platform_tags) is made this way;
    `pip download --platform` takes exactly the tags it is given (it expands only the legacy
    aliases), so a shorter list misses wheels a node would install: the real index publishes
    torch 2.13.0's nvidia-cudnn-cu13 9.20.0.48 only as manylinux_2_27 and nvidia-nccl-cu13 2.29.7
    only as manylinux_2_18."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2:
        raise ValueError(f"glibc {glibc!r}: manylinux tags exist for glibc 2.x only")
    tags: list[str] = []
    for m in range(minor, 4, -1):
        tags.append(f"manylinux_2_{m}_{arch}")
        if m in _LEGACY_MANYLINUX:
            tags.append(f"{_LEGACY_MANYLINUX[m]}_{arch}")
    return (*tags, f"linux_{arch}")


# The AWS Deep Learning Base image for Ubuntu 24.04 (release notes: Python 3.12, driver
# 595.x, CUDA 13.x, EFA 1.47+, aws-ofi-nccl 1.18+; G4dn, G5, G6, G6e, P4d, P5).
# Ubuntu 24.04's slurm-wlm is 23.11. The ARM64 build has "ARM64" in its name and is
# excluded by the architecture filter.
# The controller boots Canonical's plain Ubuntu 24.04 server image (owner 099720109477, the
# account Canonical publishes from): the same release, so the same Python 3.12 and Slurm 23.11
# from its apt, no NVIDIA driver or EFA (its bootstrap needs neither), and it supports every
# x86_64 type (the GPU image does not list C6i).
CANONICAL = "099720109477"
AWS = Platform(
    name="aws",
    os="Ubuntu 24.04",
    ami_name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *",
    ami_owner="amazon",
    controller_ami_name="ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-*",
    controller_ami_owner=CANONICAL,
    python="3.12",
    slurm="23.11",
    glibc="2.39",  # Ubuntu 24.04's libc6 2.39 (the same release on both images: one glibc)
    nvidia_driver="595",
    cuda="13",
    efa_dir="/opt/amazon/efa",
    ofi_nccl_dir="/opt/amazon/ofi-nccl",
    cgroup=True,
    gpu_device_prefix="/dev/nvidia",
    init="systemd",
    scratch_volume_dir="/dev/disk/by-id",
)

# The local cluster: Debian 12's packages (slurm-wlm 22.05, python3 3.11) in network
# namespaces of this machine; no cgroup delegation, GPUs are plain files.
LOCAL = Platform(
    name="local",
    os="Debian 12",
    ami_name=None,
    python="3.11",
    slurm="22.05",
    glibc="2.36",
    nvidia_driver=None,
    cuda=None,
    efa_dir=None,
    ofi_nccl_dir=None,
    cgroup=False,
    gpu_device_prefix="/var/lib/slurm/gpu-standin/nvidia",
    init="hostctl",
    slurmctld_pidfile="/run/slurmctld.pid",  # localcluster/hostctl.sh tracks slurmctld by it
)

# The boot test (boottest/, docs/BOOTTEST.md): the three roles booted for real in
# systemd-nspawn containers of this machine, cloud-init NoCloud running the stack's own
# user-data. Two Debian releases bracket the AMI's Slurm 23.11. What differs from the AMI,
# and what stands in for it:
# - no NFS in this kernel: the controller runs no NFS server (nfs_server=False); each
#   container gets the same host directory bound at /srv/cluster-scratch (the controller's
#   at /scratch itself) and a GPU node's fstab line bind-mounts it on /scratch, so the same
#   fstab and systemd ordering run;
# - no GPUs: /dev/nvidiaN are character devices (major 195) the host makes and binds in;
#   no driver, no nvidia-smi (the rendered scripts call it only where real_gpus);
# - no EC2 metadata: a NoCloud seed (meta-data with the SSH key, user-data, network-config);
# - packages from a local apt repository and wheelhouse (CPU torch), bound read-only: the
#   image's apt sources and pip.conf point at them as the AMI's point at its mirrors;
# - no cgroup delegation for slurmd (nspawn mounts the v1 controllers read-only): cgroup=False;
# - Debian 13 (Python 3.13) only: torch is Debian's own CPU build (python3-torch 2.6.0, os_torch),
#   not the pinned 2.13.0: for cp313 this machine's index has only the CUDA build of torch 2.13.0,
#   whose CUDA libraries it cannot supply in full (docs/BOOTTEST.md). The other pins are the same.
#   Debian builds it without libuv: the job's rendezvous store is a file (OsTorch.libuv).
_BOOT = dict(
    ami_name=None,
    nvidia_driver=None,
    cuda=None,
    efa_dir=None,
    ofi_nccl_dir=None,
    cgroup=False,
    gpu_device_prefix="/dev/nvidia",
    init="systemd",
    nfs_server=False,
    scratch_source="/srv/cluster-scratch",
    scratch_fstype="none",
    # _netdev: systemd treats it as the remote mount it stands in for (ordering, as with NFS).
    scratch_options="bind,_netdev,nofail",
)
BOOT_DEBIAN12 = Platform(name="boot-debian12", os="Debian 12", python="3.11", slurm="22.05", glibc="2.36",
                         debian_suite="bookworm", slurmctld_pidfile="/run/slurmctld.pid", **_BOOT)
BOOT_DEBIAN13 = Platform(name="boot-debian13", os="Debian 13", python="3.13", slurm="24.11", glibc="2.41",
                         debian_suite="trixie", os_torch=OsTorch("python3-torch", "2.6.0+debian", libuv=False),
                         **_BOOT)

PLATFORMS = {p.name: p for p in (AWS, LOCAL, BOOT_DEBIAN12, BOOT_DEBIAN13)}


def platform(name: str) -> Platform:
    try:
        return PLATFORMS[name]
    except KeyError:
        raise ValueError(f"unknown platform {name!r}; known: {', '.join(PLATFORMS)}") from None
