"""The facts every rendered file is made from.

One `ClusterFacts` describes a cluster whether it comes from the Pulumi program
(AWS instance facts) or from the local cluster (this machine). Templates see
nothing else, so the AWS and the local cluster share the same rendered files.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.platform import AWS, PLATFORMS, OsTorch, Platform

# Host addresses inside a subnet. AWS reserves the first four addresses of every subnet
# (network, VPC router, DNS, future use) and the last one (Amazon VPC User Guide, "Subnet CIDR
# blocks": https://docs.aws.amazon.com/vpc/latest/userguide/subnet-sizing.html). The controller
# sits at .10 and GPU node i (1-based) at .10 + i. On AWS the public subnet's NAT gateway takes
# the first address AWS leaves free: given none, it would take a random one, which can be the
# controller's .10 (the NAT gateway is created first).
RESERVED_AT_START = 4
RESERVED_AT_END = 1
CONTROLLER_OFFSET = 10
NAT_GATEWAY_OFFSET = RESERVED_AT_START
# The instance metadata service's address on every EC2 instance (IMDSv2, link-local).
DEFAULT_IMDS = "http://169.254.169.254"


@dataclass(frozen=True)
class Host:
    name: str
    ip: str


@dataclass(frozen=True)
class NodeShape:
    """What Slurm must be told about a GPU node (from the instance type)."""

    cpus: int
    real_memory_mib: int
    gpu_count: int
    gpu_type: str  # lower-case GRES type, e.g. "l4", "h100"
    # CPU topology, written out on the node line: Slurm 23.11.0-23.11.6 given only CPUs= on
    # multi-threaded hardware leaves jobs one thread per core. cpus = sockets x cores x threads.
    sockets: int = 1
    threads_per_core: int = 1

    @property
    def cores_per_socket(self) -> int:
        return self.cpus // (self.sockets * self.threads_per_core)

    def check(self) -> None:
        """Refuse a topology Slurm would not accept (its product must be the CPU count)."""
        if min(self.cpus, self.sockets, self.threads_per_core) < 1 or \
                self.cpus % (self.sockets * self.threads_per_core):
            raise ValueError(
                f"NodeShape: {self.cpus} CPUs are not {self.sockets} socket(s) x whole cores x "
                f"{self.threads_per_core} thread(s) per core")


SYS_CPU = Path("/sys/devices/system/cpu")


def this_machine_topology(sys_cpu: Path = SYS_CPU) -> tuple[int, int, int]:
    """(CPUs, sockets, threads per core) of the online CPUs of this machine, as slurmd counts
    them (the local cluster and the boot test run slurmd here: their node lines must agree)."""
    cpus = _cpu_list((sys_cpu / "online").read_text())
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
    sockets = len({pkg for pkg, _ in cores})
    if len(cpus) % len(cores) or len(cores) % sockets:
        raise ValueError(f"{sys_cpu}: {len(cpus)} CPUs on {len(cores)} cores in {sockets} sockets is "
                         "not a uniform topology Slurm can describe")
    return len(cpus), sockets, len(cpus) // len(cores)


def _cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


@dataclass(frozen=True)
class PowerSave:
    """Slurm power saving: a GPU node idle for `suspend_time` seconds is stopped by
    `suspend_program` and started again by `resume_program` when a job needs it.

    `provider` says who supplies the programs: "ec2" (bootstrap/ renders them: they stop
    and start the instances through the EC2 API) or "local" (the local cluster installs
    its own, which stop and start a host's slurmd). `interval`: how often slurmctld
    looks for idle nodes (SlurmctldParameters=power_save_interval; None keeps Slurm's 10 s).
    """

    suspend_time: int
    suspend_program: str
    resume_program: str
    suspend_timeout: int
    resume_timeout: int
    provider: str = "ec2"
    interval: int | None = None


# On each instance: the Pulumi stack that owns it ("organization/project/stack"; infra/quotas.py
# stack_name). Unique per stack, unlike the Cluster tag (slurm-gpu:clusterName, "mini" by default).
STACK_TAG = "slurm-gpu:stack"

# Jobs run as this user, made by the bootstrap on every host with no sudo and no login shell
# (docs/SECURITY.md): a job cannot become root on its node, so it cannot read the munge key and
# talk to Slurm as another user. Its uid is fixed: Slurm and the NFS export compare uids across hosts.
JOB_USER = "slurmjob"
JOB_UID = 2950
# The folders of the shared scratch that every job writes, the job user's: the job logs (slurmstepd
# opens them as the job's user), the Hugging Face cache and torch's compile cache. Shared by all jobs:
# a job can change what later jobs load from them (docs/SECURITY.md).
JOB_SCRATCH_DIRS = ("logs", "hf-cache", "torch-compile-cache")


@dataclass(frozen=True)
class ClusterFacts:
    cluster_name: str
    controller: Host
    gpu_nodes: tuple[Host, ...]
    shape: NodeShape
    subnet_cidr: str
    ssh_user: str = "ubuntu"
    # Who jobs run as (JOB_USER); the local cluster's jobs run as root, as its Python is in root's home.
    job_user: str = JOB_USER
    job_uid: int = JOB_UID
    scratch: str = "/scratch"
    # gres.conf File= prefix; None: the platform's (/dev/nvidia on AWS, stand-in files locally).
    gpu_device_prefix: str | None = None
    efa: bool = True
    nvlink: bool = False
    # GPUs joined by NVSwitch (p4d, p5): CUDA needs nvidia-fabricmanager running there
    # (infra/instance_types.py NVSWITCH_TYPES); the GPU bootstrap and health check require it.
    nvswitch: bool = False
    # Seconds before slurmctld marks a silent slurmd DOWN (and requeues its --requeue jobs), and
    # how long a requeued job waits before it may start again (AuthInfo=cred_expire). AWS keeps
    # Slurm's defaults; the local cluster shortens both so a node-loss test takes seconds.
    slurmd_timeout: int = 180
    cred_expire: int = 120
    # Seconds between the GPU health checks slurmctld asks every slurmd for (HealthCheckInterval);
    # the local cluster checks more often so a missing stand-in GPU drains its node within seconds.
    health_check_interval: int = 60
    # Seconds between the main scheduler's periodic passes (SchedulerParameters=sched_interval); None
    # keeps Slurm's 60 s. A job whose start time comes (a requeued job after cred_expire) waits for the
    # next pass: the local cluster looks every 5 s.
    sched_interval: int | None = None
    # None: nodes never stop when idle (no power-save keys in slurm.conf).
    power_save: PowerSave | None = None
    # Spot GPU nodes: each runs the interruption watcher (bootstrap/spot_watch.py) as a service.
    # The one switch for it: the stack's market setting decides it (False: on demand).
    spot: bool = False
    # Where the watcher asks for notices: the instance metadata service (tests give a stand-in).
    spot_imds: str = DEFAULT_IMDS
    # What the hosts boot (OS, Python, Slurm version, cgroups, driver): cluster/platform.py.
    platform: Platform = AWS
    # AWS: the stack's region (the EC2 power program's, fab's EC2 calls; None: the power program asks
    # the instance metadata) and the Pulumi stack that owns the instances (their STACK_TAG value,
    # organization/project/stack): the power program, the controller's role and `fab status` touch only
    # its instances, not another stack's of the same cluster name. None off AWS.
    region: str | None = None
    stack: str | None = None

    def __post_init__(self) -> None:
        if self.gpu_device_prefix is None:
            object.__setattr__(self, "gpu_device_prefix", self.platform.gpu_device_prefix)

    @property
    def hosts(self) -> tuple[Host, ...]:
        return (self.controller, *self.gpu_nodes)


def gpu_node_name(index: int) -> str:
    """gpu-node-01, gpu-node-02, ... (1-based, as in the baseline)."""
    return f"gpu-node-{index:02d}"


def max_gpu_nodes(subnet_cidr: str) -> int:
    net = ipaddress.ip_network(subnet_cidr, strict=True)
    return net.num_addresses - CONTROLLER_OFFSET - 1 - RESERVED_AT_END


def host_ip(subnet_cidr: str, index: int) -> str:
    """Fixed private IP: index 0 is the controller, i >= 1 is GPU node i."""
    net = ipaddress.ip_network(subnet_cidr, strict=True)
    if index < 0 or index > max_gpu_nodes(subnet_cidr):
        raise ValueError(
            f"subnet {subnet_cidr} holds at most {max_gpu_nodes(subnet_cidr)} GPU nodes"
        )
    return str(net.network_address + CONTROLLER_OFFSET + index)


def nat_gateway_ip(public_subnet_cidr: str) -> str:
    """The NAT gateway's fixed private IP in the controller's public subnet (AWS)."""
    net = ipaddress.ip_network(public_subnet_cidr, strict=True)
    return str(net.network_address + NAT_GATEWAY_OFFSET)


def plan_hosts(subnet_cidr: str, gpu_node_count: int,
               controller_subnet: str | None = None) -> tuple[Host, tuple[Host, ...]]:
    """The controller and the GPU nodes with their fixed IPs. `controller_subnet`: where
    the controller lives when it is not the GPU nodes' subnet (AWS: the public one)."""
    controller = Host("controller", host_ip(controller_subnet or subnet_cidr, 0))
    nodes = tuple(
        Host(gpu_node_name(i), host_ip(subnet_cidr, i)) for i in range(1, gpu_node_count + 1)
    )
    return controller, nodes


def facts_to_dict(facts: ClusterFacts) -> dict:
    """Plain JSON form, lists not tuples."""
    return json.loads(json.dumps(asdict(facts)))


def facts_from_dict(data: dict) -> ClusterFacts:
    # `extra`: an untyped field facts written before cluster/spec.py carried (always empty).
    data = {k: v for k, v in data.items() if k != "extra"}
    power = dict(data.get("power_save") or {})
    # Facts written before the region and stack were the cluster's own held them in the power-save part.
    for key in ("region", "stack"):
        if key in power:
            data.setdefault(key, power.pop(key))
    try:
        return ClusterFacts(**{
            **data,
            "controller": Host(**data["controller"]),
            "gpu_nodes": tuple(Host(**h) for h in data["gpu_nodes"]),
            "shape": NodeShape(**data["shape"]),
            "power_save": PowerSave(**power) if power else None,
            "platform": _platform_from(data.get("platform")),
        })
    except (KeyError, TypeError) as exc:
        raise ValueError(f"cluster facts are malformed ({exc})") from exc


def _platform_from(data: dict | None) -> Platform:
    """Facts saved before the platform was recorded were AWS's. Facts saved before its glibc was
    recorded carry the wheel tags it now derives: the glibc is the known platform's of that name."""
    if not data:
        return AWS
    data = {k: v for k, v in data.items() if k != "wheel_platforms"}
    if "glibc" not in data and data.get("name") in PLATFORMS:
        data["glibc"] = PLATFORMS[data["name"]].glibc
    return Platform(**{**data, "os_torch": OsTorch(**data["os_torch"]) if data.get("os_torch") else None})
