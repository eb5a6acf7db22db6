"""Where the local cluster lives: addresses, names and paths under the state dir.

The layout is fixed by docs/ARCHITECTURE.md: bridge sgpu0 at 10.213.0.1/24, the
controller at .10 and gpu-node-NN at .10+N, state under /var/lib/slurm-gpu-local.
"""

from __future__ import annotations

from pathlib import Path

from cluster.platform import LOCAL as LOCAL_PLATFORM
from cluster.targets.local import LOCAL_INVENTORY, LOCAL_STATE

BRIDGE = "sgpu0"
SUBNET = "10.213.0.0/24"
BRIDGE_IP = "10.213.0.1"
PREFIX_LEN = 24
CLUSTER_NAME = "local"
GPU_TYPE = "sim"

MIN_NODES, MAX_NODES = 1, 20
MIN_GPUS, MAX_GPUS = 1, 8
DEFAULT_NODES, DEFAULT_GPUS = 2, 2

STATE = LOCAL_STATE
INVENTORY = LOCAL_INVENTORY
STATE_FILE = STATE / "cluster.json"
HOSTS_DIR = STATE / "hosts"
BIN_DIR = STATE / "bin"
HOSTCTL = BIN_DIR / "hostctl"
ETC_SLURM = STATE / "etc-slurm"  # the cluster's /etc/slurm
ETC_SLURM_GPU = STATE / "etc-slurm-gpu"  # the cluster's /etc/slurm-gpu (hosts block)
# Kept across `down`: the cluster's SSH key pair and the hosts' SSH host keys
# (so known_hosts stays valid), and /scratch (shared data, HF cache).
SSH_DIR = STATE / "ssh"
CLUSTER_KEY = SSH_DIR / "id_ed25519"
AUTHORIZED_KEYS = SSH_DIR / "authorized_keys"
# The hosts' pinned SSH host keys (fab and the power programs check them), rewritten by `up`.
KNOWN_HOSTS = STATE / "known_hosts"
SCRATCH = STATE / "scratch"

# Inside every host the GPUs are plain files under the host's own /var/lib/slurm (the local
# target's fact, which fab's sanity job checks).
GPU_DEVICE_PREFIX = LOCAL_PLATFORM.gpu_device_prefix
# Mount points the hosts need that the root filesystem may lack (made by `up`,
# removed by `down` when empty).
MOUNT_POINTS = (Path("/scratch"), Path("/etc/slurm-gpu"))

# One `up`/`down` at a time (a separate file from the tests' flock on
# /tmp/slurm-gpu-cluster.lock, so a test holding that lock can call `up`).
OP_LOCK = Path("/run/lock/slurm-gpu-local.lock")


def netns_name(host: str) -> str:
    return f"sgpu-{host}"


def veth_name(index: int) -> str:
    """Bridge side of host `index`'s veth pair (15-character limit on names)."""
    return f"sgv{index}"


def host_dir(host: str) -> Path:
    return HOSTS_DIR / host


def host_key(host: str) -> Path:
    return SSH_DIR / f"host-{host}_ed25519"
