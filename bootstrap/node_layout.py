"""Where things live on a cluster node, and what each role's node is made of.

Paths of every file the bootstrap installs, its state and its programs; the roles, their bootstrap
steps in order, their apt packages, file modes and which rendered files a role does not get. Other
parts (inventory, local cluster, fab, the boot test) import these; rendering (bootstrap/render.py)
fills the templates with them.
"""

from __future__ import annotations

from cluster.hostpaths import BOOTSTRAP_PATH, HEALTHCHECK_PATH
from cluster.platform import Platform

ROLES = ("controller", "gpu")

# Where things live on a node; other parts (inventory, local cluster, fab) import these.
SLURM_CONF_DIR = "/etc/slurm/"  # configless: slurmctld serves every file here to the GPU nodes
SLURM_CONF = "/etc/slurm/slurm.conf"
GRES_CONF = "/etc/slurm/gres.conf"
# Only where the platform has cgroups (cluster/platform.py); slurmctld serves it to the nodes.
CGROUP_CONF = "/etc/slurm/cgroup.conf"
EXPORTS_FILE = "/etc/exports.d/slurm-gpu.exports"
HOSTS_BLOCK_FILE = "/etc/slurm-gpu/hosts.block"
# Configless GPU nodes: slurmd's options (--conf-server) and the systemd drop-in that reads them.
SLURMD_ENV_FILE = "/etc/slurm-gpu/slurmd.env"
SLURMD_DROPIN = "/etc/systemd/system/slurmd.service.d/slurm-gpu.conf"
# Spot GPU nodes: the interruption watcher (bootstrap/spot_watch.py), its unit and its settings.
SPOT_WATCH_PATH = "/usr/local/sbin/slurm-gpu-spot-watch"
SPOT_WATCH_UNIT = "slurm-gpu-spot-watch.service"
SPOT_WATCH_UNIT_PATH = f"/etc/systemd/system/{SPOT_WATCH_UNIT}"
SPOT_WATCH_ENV = "/etc/slurm-gpu/spot-watch.env"
SPOT_WATCH_POLL_S = 5  # AWS recommends checking for interruption notices every 5 seconds
# The controller's instance metadata guard (its `imds` step): an nftables table that resets every
# connection to the metadata service but root's and SlurmUser's (the power programs'), loaded at every
# boot by its own unit. nftables, not iptables: one rule file replaced atomically, matched on the
# socket's owner (`meta skuid`); Ubuntu 24.04's archive has nftables 1.0.9 and Debian 12's 1.0.6
# (Priority: important there), and Ubuntu's iptables is itself the nf_tables backend. Whether or not
# the image has it, the controller's `packages` step installs it (PACKAGES).
IMDS_GUARD_UNIT = "slurm-gpu-imds-guard.service"
IMDS_GUARD_UNIT_PATH = f"/etc/systemd/system/{IMDS_GUARD_UNIT}"
IMDS_GUARD_RULES = "/etc/slurm-gpu/imds-guard.nft"
IMDS_GUARD_TABLE = "slurm_gpu_imds"
IMDS_GUARD_USERS = ("root", "slurm")  # slurm: slurm.conf's SlurmUser, who runs the power programs
# slurmctld's drop-in: Requires= and After= the guard's unit (fails closed: no guard, no slurmctld).
SLURMCTLD_DROPIN = "/etc/systemd/system/slurmctld.service.d/slurm-gpu-imds-guard.conf"
# The metadata service's IPv6 address on Nitro instances (EC2 User Guide, "Access instance metadata":
# [fd00:ec2::254], when its IPv6 endpoint is on): guarded too, with the IPv4 one.
IMDS_IPV6 = "fd00:ec2::254"
# Slurm's SuspendProgram/ResumeProgram on AWS (run by slurmctld as SlurmUser) and their log.
SUSPEND_PATH = "/usr/local/sbin/slurm-gpu-suspend"
RESUME_PATH = "/usr/local/sbin/slurm-gpu-resume"
# Both are two-line wrappers of this one program (`slurm-gpu-power suspend|resume HOSTLIST`).
POWER_PATH = "/usr/local/sbin/slurm-gpu-power"
# `slurm-gpu-power start-failed HOSTLIST CODE MESSAGE` (the local cluster's programs run it too) tells
# Slurm at once of nodes that did not start: power_down_force with the reason "start failed: CODE:
# MESSAGE" (one line, at most START_FAILED_MAX characters), which fab reads (ops/actions/node_power.py).
START_FAILED_REASON = "start failed:"
START_FAILED_MAX = 200
POWER_LOG = "/var/log/slurm/slurm-gpu-power.log"
# The controller's own venv for those programs: boto3 (POWER_PACKAGES, pinned in requirements.txt),
# made by the controller bootstrap's `power` step. Slurm runs the programs with no PATH: their
# first line names this interpreter.
POWER_VENV = "/opt/slurm-gpu/power"
POWER_PACKAGES = ("boto3", "botocore")
ENV_PROFILE = "/etc/profile.d/slurm-gpu.sh"
TRAINING_VENV = "/opt/slurm-gpu/venv"
TRAINING_PYTHON = f"{TRAINING_VENV}/bin/python"
# Per-host state (under /var/lib/slurm, which the local cluster gives each host).
STATE_DIR = "/var/lib/slurm/slurm-gpu"
MARKER_PATH = f"{STATE_DIR}/bootstrap.done"
# The version of the bootstrap a node last ran to the end (`bootstrap_version`): `fab status` names
# nodes whose version differs from what this checkout renders, `fab update-nodes` brings them up.
VERSION_PATH = f"{STATE_DIR}/bootstrap.version"
# Present while a GPU node holds the munge key it made for itself at first boot: slurmd's
# drop-in does not start slurmd while it exists (a configless slurmd cannot fetch its config with
# a key the controller does not share; Slurm 23.11 then exits for good). fab's key sync
# (ops/actions/munge.py) installs the cluster's key, removes it, and starts slurmd.
NODE_LOCAL_KEY_MARKER = f"{STATE_DIR}/munge-key.node-local"
# apt on the node waits this long for a dpkg lock held by another apt (first-boot unattended
# upgrades): the bootstrap's `packages` step installs every package, not cloud-init's package
# module, which gives up after 30 s before apt-get even runs (APT_LOCK_WAIT_TIMEOUT in cloud-init's
# cloudinit/distros/package_management/apt.py), so no apt.conf setting can extend its wait.
APT_LOCK_CONF = "/etc/apt/apt.conf.d/90slurm-gpu-lock-wait"
APT_LOCK_TIMEOUT_S = 900
# Where real_gpus: the image's kernel and NVIDIA packages stay as it shipped them (the GPU
# bootstrap's `holds` step: apt-mark hold of the installed ones, and unattended-upgrades'
# Package-Blacklist for these prefixes). A newer image is the way to newer ones (docs/PLATFORM.md).
HOLD_PREFIXES = ("linux-image", "linux-headers", "linux-modules", "linux-aws", "nvidia", "libnvidia")
APT_HOLD_CONF = "/etc/apt/apt.conf.d/51slurm-gpu-hold-gpu-stack"
# Each bootstrap step's record: <step>.status ("running|ok|skipped|failed ... <UTC time>") and
# <step>.log (its output); ops/actions/cloudinit.py reads them to name a failed step.
STEPS_DIR = f"{STATE_DIR}/bootstrap"
HOSTS_BEGIN = "# BEGIN slurm-gpu hosts"
HOSTS_END = "# END slurm-gpu hosts"

# Mode of each rendered file (default 0644).
FILE_MODES = {HEALTHCHECK_PATH: 0o755, BOOTSTRAP_PATH: 0o755, SUSPEND_PATH: 0o755, RESUME_PATH: 0o755,
              POWER_PATH: 0o755, SPOT_WATCH_PATH: 0o755}


# Debian/Ubuntu packages per role (the bootstrap's `packages` step installs them).
PACKAGES = {
    # python3-pip: the `wheels` step downloads the GPU nodes' training stack; python3-venv: the
    # power-save programs' boto3 venv (POWER_VENV).
    # nftables: the `imds` step's metadata guard (IMDS_GUARD_RULES).
    "controller": ("slurm-wlm", "munge", "nfs-common", "nfs-kernel-server", "python3-pip",
                   "python3-venv", "nftables"),
    # python3-dev and a C compiler: Triton (torch.compile, flex attention) builds C against
    # Python.h at run time.
    "gpu": ("slurm-wlm", "munge", "nfs-common", "python3-venv", "python3-pip", "python3-dev",
            "build-essential"),
}


def role_packages(platform: Platform, role: str) -> tuple[str, ...]:
    """The apt packages a role's node installs: PACKAGES, and on a GPU node of a platform that
    takes torch from the OS (`Platform.os_torch`) that package too."""
    check_role(role)
    extra = (platform.os_torch.package,) if role == "gpu" and platform.os_torch else ()
    return PACKAGES[role] + extra


# Steps of each role's bootstrap script, in order (SLURM_GPU_SKIP_STEPS picks from these).
STEPS = {
    # scratchvol before nfs: nfs-server exports /scratch's own volume, never the folder under it.
    "controller": ("hostname", "hosts", "packages", "dirs", "jobuser", "munge", "scratchvol", "nfs", "scratch",
                   "power", "imds", "wheels", "services"),
    "gpu": (
        "hostname", "hosts", "holds", "packages", "dirs", "jobuser", "munge", "healthcheck", "nfs", "scratch",
        "training", "gpus", "services",
    ),
}


# What each role does not get. GPU nodes run slurmd in configless mode: slurm.conf and
# gres.conf come from slurmctld at start, so no GPU node file depends on the node list.
NOT_FOR_ROLE = {
    "controller": (HEALTHCHECK_PATH, SLURMD_ENV_FILE, SLURMD_DROPIN, SPOT_WATCH_PATH, SPOT_WATCH_UNIT_PATH,
                   SPOT_WATCH_ENV),
    # slurmctld runs the power programs: only the controller has them.
    # GPU nodes have no instance role (infra/nodes.py): no credentials in their metadata to guard.
    "gpu": (EXPORTS_FILE, SLURM_CONF, GRES_CONF, CGROUP_CONF, SUSPEND_PATH, RESUME_PATH, POWER_PATH,
            IMDS_GUARD_RULES, IMDS_GUARD_UNIT_PATH, SLURMCTLD_DROPIN),
}



def check_role(role: str) -> None:
    """Refuse a role other than ROLES' ones."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)} (got {role!r})")
