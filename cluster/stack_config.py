"""The stack's configuration: every `slurm-gpu:` setting, parsed once and validated.

`StackConfig.from_mapping` is a pure function over the raw key/value pairs (no Pulumi here), so
the rules are unit-tested on their own and one parse serves both sides: infra/config.py feeds it
from `pulumi.Config` before the program declares any resource, and the estimate
(ops/cost/estimate.py) from the stack's file (`read_stack_file`). Every error names the setting
and the command that fixes it.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.errors import UserError
from cluster.facts import max_gpu_nodes
from cluster.gp3 import GP3_IOPS, GP3_IOPS_PER_GIB, GP3_MIBPS_PER_IOPS, GP3_THROUGHPUT, gp3_min_iops
from cluster.settings import (
    CAPACITY_BLOCK,
    CAPACITY_RESERVATION,
    CAPACITY_RESERVATION_ID_RE,
    MARKETS,
    NAMESPACE,
    ON_DEMAND,
    REQUIRED,
    RESERVED_MARKETS,
    SETTINGS,
)

# Below this the root volume cannot hold the AMI plus the training stack and
# the model cache; the AMI's own snapshot size is checked later (infra/ami.py).
MIN_ROOT_VOLUME_GIB = 50
# gp3 volumes stop at 16 TiB.
MAX_ROOT_VOLUME_GIB = 16384
# The most GPU nodes a stack has: the controller's user-data lists them all (slurm.conf's node
# lines, the hosts block: about 18 bytes each, gzip-compressed) and must stay within EC2's 16 KiB
# with room to spare (tests/unit/test_user_data_size.py: at this count every host's user-data is at
# most 12 KiB, three quarters of the limit).
MAX_GPU_NODES = 96

# A Slurm ClusterName that is also safe in hostnames, AWS tags and key-pair
# names: lower case (slurmdbd lower-cases it anyway), starts with a letter.
CLUSTER_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$|^[a-z]$")
INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
AMI_ID_RE = re.compile(r"^ami-[0-9a-f]{8,17}$")
# A KMS key as IAM policies name it: the key's ARN, or its id (resolved to the ARN at plan time).
# Aliases are refused: an IAM statement on an alias ARN does not grant use of the key.
KMS_KEY_ID = r"(mrk-[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
KMS_KEY_RE = re.compile(rf"^(arn:aws[a-z-]*:kms:[a-z]{{2}}(-[a-z]+)+-\d:\d{{12}}:key/)?{KMS_KEY_ID}$")
AZ_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
SSH_KEY_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
)


class ConfigError(UserError):
    """A bad setting (infra/config.py's PlanError is the one Pulumi prints without a traceback)."""


def _set_cmd(key: str, example: str) -> str:
    return f"set it with `pulumi config set {NAMESPACE}:{key} {example}`"


def _fail(key: str, problem: str, example: str) -> ConfigError:
    return ConfigError(f"{NAMESPACE}:{key} {problem}; {_set_cmd(key, example)}")



# idleStopMinutes: 0 turns stopping off; otherwise at least this long, so a node is not
# stopped and started again between the jobs of one session (a start takes minutes).
MIN_IDLE_STOP_MINUTES = 5
MAX_IDLE_STOP_MINUTES = 7 * 24 * 60

# The shared /scratch (the controller's own gp3 volume, infra/nodes.py): its size (gp3: 1 GiB to
# 16 TiB; below 10 GiB the model and the wheel cache would not fit); gp3's own rules: cluster/gp3.py.
SCRATCH_SIZE_GIB = (10, 16384)
# The settings that say who may reach the hosts, not what they are: the only REQUIRED ones.
ACCESS = ("adminCidr", "sshPublicKey")


@dataclass(frozen=True)
class StackConfig:
    # None only where the parse was told not to read them (`access=False`: the estimate's).
    admin_cidr: str | None
    ssh_public_key: str | None
    gpu_node_count: int
    gpu_instance_type: str
    controller_instance_type: str
    ami_id: str | None
    root_volume_gib: int
    vpc_cidr: str
    subnet_cidr: str
    public_subnet_cidr: str
    availability_zone: str | None
    cluster_name: str
    efa: bool
    idle_stop_minutes: int = 30  # 0: GPU nodes never stop when idle
    controller_ami_id: str | None = None  # None: the stack's pinned Ubuntu image (infra/ami.py)
    ebs_kms_key_id: str | None = None  # None: the account's default EBS key (infra/kms.py)
    # The shared /scratch's own volume on the controller: size, gp3 throughput and IOPS.
    scratch_size_gib: int = 100
    scratch_throughput_mbps: int = GP3_THROUGHPUT[0]
    scratch_iops: int = GP3_IOPS[0]
    gpu_market: str = ON_DEMAND  # MARKETS
    capacity_reservation_id: str | None = None  # the reservation's id, for RESERVED_MARKETS only
    allow_wide_admin_cidr: bool = False  # adminCidr may be wider than a /16 (SSH open to that range)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, access: bool = True) -> StackConfig:
        """Parse and validate settings given without the namespace (`adminCidr`, ...).

        Values may be strings (as `pulumi config set` stores them) or YAML scalars. `access=False`
        neither requires nor reads the way in (adminCidr, sshPublicKey: ACCESS): what the cluster is
        and costs does not depend on them, and a stack file may lack them (Pulumi.dev.yaml does).
        """
        unknown = sorted(set(raw) - set(SETTINGS))
        if unknown:
            known = ", ".join(SETTINGS)
            raise ConfigError(
                f"unknown setting {NAMESPACE}:{unknown[0]} (known: {known}); remove it with "
                f"`pulumi config rm {NAMESPACE}:{unknown[0]}`"
            )

        def value(key: str) -> Any:
            default, example = SETTINGS[key]
            v = raw.get(key)
            if isinstance(v, str):
                v = v.strip()
                if v == "":
                    v = None
            if key in ACCESS and not access:
                return None
            if v is None:
                if default is REQUIRED:
                    raise _fail(key, "is required and has no default", example)
                return default
            return v

        vpc = _network("vpcCidr", value("vpcCidr"), min_prefix=16, max_prefix=28)
        subnet = _network("subnetCidr", value("subnetCidr"), min_prefix=16, max_prefix=28)
        if not subnet.subnet_of(vpc):
            raise _fail(
                "subnetCidr",
                f"({subnet}) is not inside {NAMESPACE}:vpcCidr ({vpc})",
                str(next(vpc.subnets(new_prefix=max(vpc.prefixlen, 24)))),
            )

        public_raw = value("publicSubnetCidr")
        if public_raw is None:  # the first /24 of the VPC (smaller VPCs: half of it) beside the GPU subnet
            size = min(max(vpc.prefixlen + 1, 24), 28)
            public_raw = next((str(n) for n in vpc.subnets(new_prefix=size) if not n.overlaps(subnet)), None)
            if public_raw is None:
                raise _fail("vpcCidr", f"({vpc}) has no room beside {NAMESPACE}:subnetCidr ({subnet}) for "
                            "the controller's public subnet; use a larger VPC", "10.0.0.0/16")
        public = _network("publicSubnetCidr", public_raw, min_prefix=16, max_prefix=28)
        if not public.subnet_of(vpc):
            raise _fail("publicSubnetCidr", f"({public}) is not inside {NAMESPACE}:vpcCidr ({vpc})",
                        str(next(vpc.subnets(new_prefix=max(vpc.prefixlen, 24)))))
        if public.overlaps(subnet):
            free = next((n for n in vpc.subnets(new_prefix=max(vpc.prefixlen, 24)) if not n.overlaps(subnet)),
                        None)
            raise _fail("publicSubnetCidr",
                        f"({public}) overlaps {NAMESPACE}:subnetCidr ({subnet}), the GPU nodes' private "
                        "subnet; the controller's public subnet must be separate", str(free or public))

        count = _int("gpuNodeCount", value("gpuNodeCount"))
        room = max_gpu_nodes(str(subnet))
        if count < 1:
            raise _fail("gpuNodeCount", f"must be at least 1, not {count}", "2")
        if count > MAX_GPU_NODES:
            raise _fail("gpuNodeCount", f"is {count}; a stack has at most {MAX_GPU_NODES} GPU nodes (the "
                        "controller's first-boot user-data lists them all, within EC2's 16 KiB)",
                        str(MAX_GPU_NODES))
        if count > room:
            raise _fail(
                "gpuNodeCount",
                f"is {count} but {NAMESPACE}:subnetCidr {subnet} holds at most {room} GPU nodes "
                f"(fixed IPs start at .10); lower the count or use a larger subnet",
                str(room),
            )

        root = _int("rootVolumeGiB", value("rootVolumeGiB"))
        if not MIN_ROOT_VOLUME_GIB <= root <= MAX_ROOT_VOLUME_GIB:
            raise _fail(
                "rootVolumeGiB",
                f"is {root} GiB; it must be between {MIN_ROOT_VOLUME_GIB} and "
                f"{MAX_ROOT_VOLUME_GIB} (the AMI, CUDA, the training stack and model cache live there)",
                "200",
            )

        ami, controller_ami = (_ami_id(key, value(key)) for key in ("amiId", "controllerAmiId"))
        kms_key = _kms_key(value("ebsKmsKeyId"))

        az = value("availabilityZone")
        if az is not None and not AZ_RE.match(str(az)):
            raise _fail("availabilityZone", f"({az!r}) is not an availability zone name",
                        SETTINGS["availabilityZone"][1])

        name = str(value("clusterName"))
        if not CLUSTER_NAME_RE.match(name):
            raise _fail(
                "clusterName",
                f"({name!r}) must be 1-32 characters of lower-case letters, digits and '-', "
                "starting with a letter and not ending with '-' (it is the Slurm ClusterName "
                "and part of AWS names)",
                "mini",
            )

        market, reservation = _market(value("gpuMarket"), value("capacityReservationId"))
        if market == CAPACITY_RESERVATION and az is None:
            # pulumi_aws 7.51.1 has no data source for an On-Demand Capacity Reservation (only
            # get_capacity_block_reservation), so the plan cannot follow its zone as it does a block's.
            raise _fail("availabilityZone", f"is required when {NAMESPACE}:gpuMarket is {CAPACITY_RESERVATION}: "
                        f"the reservation's zone (`aws ec2 describe-capacity-reservations --capacity-reservation-ids "
                        f"{reservation} --query 'CapacityReservations[0].AvailabilityZone'`), which the plan "
                        "cannot read", SETTINGS["availabilityZone"][1])
        idle_raw = value("idleStopMinutes")
        if market in RESERVED_MARKETS and raw.get("idleStopMinutes") in (None, ""):
            # Reserved capacity bills by the hour whether its instances run or not (EC2 User Guide,
            # "Capacity Reservation pricing and billing"; Capacity Blocks are paid up front): stopping
            # idle nodes saves nothing there, so they stay up unless the user asks otherwise.
            idle_raw = 0
        idle = _int("idleStopMinutes", idle_raw)
        if idle != 0 and not MIN_IDLE_STOP_MINUTES <= idle <= MAX_IDLE_STOP_MINUTES:
            raise _fail(
                "idleStopMinutes",
                f"is {idle}; it must be 0 (GPU nodes never stop when idle) or between "
                f"{MIN_IDLE_STOP_MINUTES} and {MAX_IDLE_STOP_MINUTES} minutes of idle time before Slurm "
                "stops a GPU node",
                "30",
            )

        throughput, iops = _scratch_volume(value("scratchThroughputMBps"), value("scratchIops"))
        scratch_gib = _scratch_size(value("scratchSizeGiB"), iops)
        allow_wide = _bool("allowWideAdminCidr", value("allowWideAdminCidr"))
        admin, ssh_key = value("adminCidr"), value("sshPublicKey")

        return cls(
            admin_cidr=None if admin is None else _admin_cidr(admin, allow_wide),
            allow_wide_admin_cidr=allow_wide,
            ssh_public_key=None if ssh_key is None else _ssh_key(ssh_key),
            gpu_node_count=count,
            gpu_instance_type=_instance_type("gpuInstanceType", value("gpuInstanceType")),
            controller_instance_type=_instance_type(
                "controllerInstanceType", value("controllerInstanceType")
            ),
            ami_id=ami,
            controller_ami_id=controller_ami,
            ebs_kms_key_id=kms_key,
            root_volume_gib=root,
            vpc_cidr=str(vpc),
            subnet_cidr=str(subnet),
            public_subnet_cidr=str(public),
            availability_zone=az,
            cluster_name=name,
            efa=_bool("efa", value("efa")),
            idle_stop_minutes=idle,
            scratch_size_gib=scratch_gib,
            scratch_throughput_mbps=throughput,
            scratch_iops=iops,
            gpu_market=market,
            capacity_reservation_id=reservation,
        )


def _scratch_size(raw: Any, iops: int) -> int:
    """The shared /scratch volume's GiB: gp3's range, and room for its IOPS (500 per GiB)."""
    size = _int("scratchSizeGiB", raw)
    low, high = SCRATCH_SIZE_GIB
    if not low <= size <= high:
        raise _fail("scratchSizeGiB", f"is {size} GiB; the shared /scratch volume takes {low} to {high} GiB "
                    "(models, datasets, checkpoints, the wheel cache; it grows in place, never shrinks)", "100")
    least = math.ceil(iops / GP3_IOPS_PER_GIB)
    if size < least:
        raise _fail("scratchSizeGiB", f"is {size} GiB, too small for {NAMESPACE}:scratchIops {iops}: gp3 allows "
                    f"at most {GP3_IOPS_PER_GIB} IOPS per GiB", str(least))
    return size


def _scratch_volume(throughput_raw: Any, iops_raw: Any) -> tuple[int, int]:
    """gp3 throughput and IOPS of the controller's volume (the shared /scratch), by EC2's rules."""
    throughput = _int("scratchThroughputMBps", throughput_raw)
    low, high = GP3_THROUGHPUT
    if not low <= throughput <= high:
        raise _fail("scratchThroughputMBps",
                    f"is {throughput}; gp3 provisions {low} to {high} MiB/s (the shared /scratch on the "
                    f"controller's volume; {low} is gp3's baseline, more is billed per MiB/s-month)", "1000")
    least = gp3_min_iops(throughput)
    if iops_raw is None:
        return throughput, least
    iops = _int("scratchIops", iops_raw)
    if not GP3_IOPS[0] <= iops <= GP3_IOPS[1]:
        raise _fail("scratchIops", f"is {iops}; gp3 provisions {GP3_IOPS[0]} to {GP3_IOPS[1]} IOPS",
                    str(least))
    if iops < least:
        raise _fail("scratchIops",
                    f"is {iops}, too few for {NAMESPACE}:scratchThroughputMBps {throughput}: gp3 allows at "
                    f"most {GP3_MIBPS_PER_IOPS} MiB/s per IOPS, so {throughput} MiB/s needs at least {least} "
                    f"IOPS (or unset {NAMESPACE}:scratchIops to get that)", str(least))
    return throughput, iops


def _market(market_raw: Any, reservation_raw: Any) -> tuple[str, str | None]:
    """gpuMarket and the capacityReservationId it needs (reservations) or refuses (the others)."""
    market = str(market_raw).strip().lower()
    if market not in MARKETS:
        raise _fail("gpuMarket", f"is {market_raw!r}; it must be one of {', '.join(MARKETS)}", ON_DEMAND)
    reservation = None if reservation_raw is None else str(reservation_raw).strip()
    if market in RESERVED_MARKETS:
        if reservation is None:
            raise _fail("capacityReservationId", f"is required when {NAMESPACE}:gpuMarket is {market} (the id "
                        "of the reservation the GPU nodes launch into, from `aws ec2 "
                        "describe-capacity-reservations`)", SETTINGS["capacityReservationId"][1])
        if not CAPACITY_RESERVATION_ID_RE.match(reservation):
            raise _fail("capacityReservationId", f"({reservation!r}) is not a capacity reservation id like "
                        "cr-0123456789abcdef0", SETTINGS["capacityReservationId"][1])
    elif reservation is not None:
        raise ConfigError(
            f"{NAMESPACE}:capacityReservationId is set but {NAMESPACE}:gpuMarket is {market}, which uses no "
            f"reservation; remove it with `pulumi config rm {NAMESPACE}:capacityReservationId`, or "
            f"{_set_cmd('gpuMarket', CAPACITY_RESERVATION)} (or {CAPACITY_BLOCK} for a Capacity Block)")
    return market, reservation


def _int(key: str, v: Any) -> int:
    if isinstance(v, bool):
        raise _fail(key, f"must be a whole number, not {v!r}", SETTINGS[key][1])
    if isinstance(v, int):
        return v
    # ASCII: \d and int() also take '٣'; at most 18 digits: int() refuses over 4300 (ValueError)
    if isinstance(v, str) and re.fullmatch(r"[+-]?[0-9]{1,18}", v):
        return int(v)
    shown = repr(v) if len(repr(v)) <= 40 else f"a value of {len(str(v))} characters"
    raise _fail(key, f"must be a whole number, not {shown}", SETTINGS[key][1])


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise _fail(key, f"must be true or false, not {v!r}", SETTINGS[key][1])


def _network(key: str, v: Any, *, min_prefix: int, max_prefix: int):
    example = SETTINGS[key][1]
    try:
        net = ipaddress.ip_network(str(v), strict=True)
    except ValueError as exc:
        raise _fail(key, f"({v!r}) is not a valid network in CIDR form ({exc})", example) from None
    if net.version != 4:
        raise _fail(key, f"({net}) must be an IPv4 network", example)
    if not net.is_private:
        raise _fail(key, f"({net}) must be a private (RFC 1918) range", example)
    if not min_prefix <= net.prefixlen <= max_prefix:
        raise _fail(key, f"({net}) must have a prefix between /{min_prefix} and /{max_prefix} "
                         "(the AWS limits)", example)
    return net


# adminCidr is the only source SSH (port 22) is open to: one address or a small range. Wider than this
# is SSH open to a large part of the internet, refused unless allowWideAdminCidr says it is meant.
WIDEST_ADMIN_PREFIX = 16


def _admin_cidr(v: Any, allow_wide: bool = False) -> str:
    key, example = "adminCidr", SETTINGS["adminCidr"][1]
    text = str(v)
    if "/" not in text:
        raise _fail(key, f"({text!r}) needs a prefix length, e.g. {text}/32 for one address", example)
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise _fail(key, f"({text!r}) is not a network in CIDR form", example) from None
    if net.is_loopback or net.is_link_local:  # 127/8, ::1, 169.254/16, fe80::/10: never where an admin is
        kind = "loopback" if net.is_loopback else "link-local"
        raise _fail(key, f"({text}) is a {kind} range: no admin connects from there; give your own public "
                    "address with /32 (e.g. from `curl -s https://checkip.amazonaws.com`)", example)
    if net.prefixlen < WIDEST_ADMIN_PREFIX and not allow_wide:
        whole = net.prefixlen == 0
        raise _fail(
            key,
            f"({text}) would open SSH to {'the whole internet' if whole else 'a range wider than a /16'}; give "
            "your own public address with /32 (e.g. from `curl -s https://checkip.amazonaws.com`), or, if it "
            f"is meant, `pulumi config set {NAMESPACE}:allowWideAdminCidr true`",
            example,
        )
    if net.version != 4:
        raise _fail(key, f"({text}) is IPv6 but the cluster's VPC is IPv4-only", example)
    if str(net) != text:
        raise _fail(key, f"({text}) has host bits set; did you mean {net}?", str(net))
    return text


def _ssh_key(v: Any) -> str:
    key, example = "sshPublicKey", SETTINGS["sshPublicKey"][1]
    text = str(v).strip()
    parts = text.split()
    if "PRIVATE KEY" in text:
        raise _fail(key, "holds a PRIVATE key; give the public one (the .pub file)", example)
    if len(parts) < 2 or parts[0] not in SSH_KEY_TYPES or \
            not re.fullmatch(r"[A-Za-z0-9+/]+={0,3}", parts[1]) or len(parts[1]) < 60:
        raise _fail(
            key,
            f"is not an OpenSSH public key (expected '<type> <base64> [comment]' with type one of "
            f"{', '.join(SSH_KEY_TYPES)})",
            example,
        )
    return text


def _ami_id(key: str, v: Any) -> str | None:
    if v is not None and not AMI_ID_RE.match(str(v)):
        raise _fail(key, f"({v!r}) is not an AMI id like ami-0123456789abcdef0", SETTINGS[key][1])
    return None if v is None else str(v)


def _kms_key(v: Any) -> str | None:
    key, example = "ebsKmsKeyId", SETTINGS["ebsKmsKeyId"][1]
    if v is None:
        return None
    text = str(v)
    if text.startswith("alias/") or ":alias/" in text:
        raise _fail(key, f"({text!r}) is an alias; IAM grants name the key itself: give the key's ARN "
                         f"(`aws kms describe-key --key-id {text} --query KeyMetadata.Arn`)", example)
    if not KMS_KEY_RE.match(text):
        raise _fail(key, f"({text!r}) is not a KMS key ARN (arn:aws:kms:REGION:ACCOUNT:key/KEY-ID) or key id",
                    example)
    return text


def _instance_type(key: str, v: Any) -> str:
    text = str(v)
    if not INSTANCE_TYPE_RE.match(text):
        raise _fail(key, f"({text!r}) is not an EC2 instance type like g6.12xlarge", SETTINGS[key][1])
    return text


@dataclass(frozen=True)
class StackFile:
    """A stack's Pulumi.<stack>.yaml read without Pulumi: its settings parsed as `pulumi up` parses
    them (without the way in: StackConfig.from_mapping's `access`), and its AWS provider's region and
    profile (the credentials `pulumi` uses for the stack)."""
    name: str  # the file's name, for messages
    settings: StackConfig
    region: str | None
    profile: str | None


def read_stack_file(path: Path) -> StackFile:
    """Parse a Pulumi.<stack>.yaml (Pulumi docs, "Project and stack settings": its `config:` mapping
    holds `namespace:key` pairs). A bad setting raises ConfigError naming the file, the setting and
    the fix."""
    try:
        config = (yaml.safe_load(path.read_text()) or {}).get("config") or {}
    except (OSError, yaml.YAMLError, AttributeError) as exc:
        raise ConfigError(f"{path.name} cannot be read as a Pulumi stack file ({exc}); fix it or "
                          "pass --stack NAME of another") from None
    prefix = NAMESPACE + ":"
    raw = {key[len(prefix):]: v for key, v in config.items() if key.startswith(prefix)}
    try:
        settings = StackConfig.from_mapping(raw, access=False)
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: {exc}") from None
    return StackFile(path.name, settings, config.get("aws:region"), config.get("aws:profile"))
