"""The harness for the Pulumi program tests: AWS facts as the provider returns them,
a mock monitor that records every resource, and `run_program(config)`.

The instance-type figures are AWS's published ones (DescribeInstanceTypes).
"""

from __future__ import annotations

import base64
import fnmatch
import gzip
import hashlib
from dataclasses import dataclass, field

import pulumi
from pulumi.runtime.mocks import MockEngine, MockMonitor

REGION = "ap-northeast-2"
ZONES = [f"{REGION}{z}" for z in "abcd"]
DLAMI_ID = "ami-0fd3bc7a446d73ca2"  # the baseline's image in ap-northeast-2
DLAMI_ROOT_GIB = 75
DLAMI_NAME = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261006"
# Canonical's plain Ubuntu 24.04 server image (owner 099720109477), the controller's.
CANONICAL = "099720109477"
UBUNTU_ID = "ami-0a8f4c2e6b1d3f579"
UBUNTU_IDS = {UBUNTU_ID, "ami-0c1d2e3f4a5b6c7d8"}  # images the mocks describe as Canonical's
UBUNTU_ROOT_GIB = 8
UBUNTU_NAME = "ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-20261001"

# KMS keys as DescribeKey reports them. The account's default EBS key is AWS's own unless a
# test says otherwise (GetEbsDefaultKmsKeyId answers with the alias ARN for it).
ACCOUNT = "111122223333"
AWS_EBS_ALIAS = f"arn:aws:kms:{REGION}:{ACCOUNT}:alias/aws/ebs"
AWS_EBS_KEY = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
CMK = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
CMK_DISABLED = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/2345bcde-23bc-45de-67f0-2345678901bc"
CMK_OTHER_REGION = f"arn:aws:kms:us-east-1:{ACCOUNT}:key/3456cdef-34cd-56ef-7801-3456789012cd"
CMK_ASYMMETRIC = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/4567def0-45de-67f0-8912-4567890123de"


def _key(arn, manager="CUSTOMER", state="Enabled", spec="SYMMETRIC_DEFAULT", usage="ENCRYPT_DECRYPT"):
    return {"id": arn.rsplit("/", 1)[1], "arn": arn, "keyId": arn.rsplit("/", 1)[1], "keyManager": manager,
            "keyState": state, "keySpec": spec, "customerMasterKeySpec": spec, "keyUsage": usage,
            "enabled": state == "Enabled", "multiRegion": False}


KMS_KEYS = {
    AWS_EBS_ALIAS: _key(AWS_EBS_KEY, manager="AWS"),
    CMK: _key(CMK),
    CMK_DISABLED: _key(CMK_DISABLED, state="Disabled"),
    CMK_OTHER_REGION: _key(CMK_OTHER_REGION),
    CMK_ASYMMETRIC: _key(CMK_ASYMMETRIC, spec="RSA_2048", usage="SIGN_VERIFY"),
}
KMS_KEYS.update({k["keyId"]: k for k in list(KMS_KEYS.values())})

# A real-looking key (random bytes, base64) and the admin address from TEST-NET-3.
SSH_KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG3p3cFq1yJ0o6b8x3m0tq0kqf1Xb8c2s6yQmXyW8mQd admin@laptop"
)
ADMIN_CIDR = "203.0.113.7/32"


def _gpu(count, name, mem, manufacturer="NVIDIA"):
    return [{"count": count, "manufacturer": manufacturer, "name": name, "memorySize": mem}]


# instance type -> (vCPUs, memory MiB, GPUs, EFA, architectures, zones offered)
# and, below, (network cards, EFA interfaces) where the type has more than one card.
INSTANCE_TYPES = {
    "g6.12xlarge": (48, 196608, _gpu(4, "L4", 22888), True, ["x86_64"], ZONES[:3]),
    "g6.48xlarge": (192, 786432, _gpu(8, "L4", 22888), True, ["x86_64"], ["ap-northeast-2b", "ap-northeast-2d"]),
    "p5.48xlarge": (192, 2097152, _gpu(8, "H100", 81559), True, ["x86_64"], ["ap-northeast-2c"]),
    "p4d.24xlarge": (96, 1179648, _gpu(8, "A100", 40960), True, ["x86_64"], ZONES[:2]),
    "g4dn.xlarge": (4, 16384, _gpu(1, "T4", 15360), False, ["x86_64"], ZONES),
    "g5g.xlarge": (4, 8192, _gpu(1, "T4g", 15360), False, ["arm64"], ZONES[:2]),
    "g4ad.16xlarge": (64, 262144, _gpu(4, "Radeon Pro V520", 8192, "AMD"), True, ["x86_64"], ZONES[:2]),
    "c6i.xlarge": (4, 8192, [], False, ["x86_64"], ZONES),
    "c7i.48xlarge": (192, 393216, [], True, ["x86_64"], ZONES),
    "t3.large": (2, 8192, [], False, ["x86_64", "i386"], ZONES),
    "m7g.large": (2, 8192, [], False, ["arm64"], ZONES),
}


NETWORK_CARDS = {"p4d.24xlarge": (4, 4), "p5.48xlarge": (32, 32)}

# instance type -> (default cores, default threads per core), as DescribeInstanceTypes reports.
CPU_CORES = {
    "g6.12xlarge": (24, 2), "g6.48xlarge": (96, 2), "p5.48xlarge": (96, 2), "p4d.24xlarge": (48, 2),
    "g4dn.xlarge": (2, 2), "g5g.xlarge": (4, 1), "g4ad.16xlarge": (32, 2), "c6i.xlarge": (2, 2),
    "c7i.48xlarge": (96, 2), "t3.large": (1, 2), "m7g.large": (2, 1),
}


# EC2's On-Demand vCPU quotas as Service Quotas names them, by quota code.
QUOTA_NAMES = {
    "L-DB2E81BA": "Running On-Demand G and VT instances",
    "L-417A185B": "Running On-Demand P instances",
    "L-1216C47A": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
    "L-3819A6DF": "All G and VT Spot Instance Requests",
    "L-7212CCBC": "All P4, P3 and P2 Spot Instance Requests",
    "L-C4BD4855": "All P5 Spot Instance Requests",
    "L-34B43A08": "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
}
# What an account answers unless a test says otherwise: room for every case's stack.
ROOMY_QUOTA = 100000.0


def quota_result(code: str, value: float | None) -> dict:
    arn = f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:ec2/{code}"
    return {"id": arn, "arn": arn, "quotaCode": code, "quotaName": QUOTA_NAMES[code], "serviceCode": "ec2",
            "serviceName": "Amazon Elastic Compute Cloud (Amazon EC2)", "value": value, "defaultValue": value,
            "adjustable": True, "globalQuota": False, "region": REGION, "usageMetrics": []}


def capacity_block_result(rid: str, instance_type: str = "p5.48xlarge", zone: str = "ap-northeast-2c",
                          count: int = 2, available: int | None = None, state: str = "active",
                          placement_group_arn: str = "") -> dict:
    """DescribeCapacityReservations of a Capacity Block, as getCapacityBlockReservation returns it."""
    return {"id": rid, "arn": f"arn:aws:ec2:{REGION}:{ACCOUNT}:capacity-reservation/{rid}",
            "availabilityZone": zone, "instanceType": instance_type, "instanceCount": count,
            "availableInstanceCount": count if available is None else available, "state": state,
            "reservationType": "capacity-block", "instancePlatform": "Linux/UNIX", "tenancy": "default",
            "startDate": "2026-12-07T11:30:00Z", "endDate": "2026-12-08T11:30:00Z",
            "placementGroupArn": placement_group_arn, "ownerId": ACCOUNT}


@dataclass(frozen=True)
class Running:
    """An instance already running in the account (DescribeInstances)."""
    id: str
    instance_type: str
    tags: dict = field(default_factory=dict)
    state: str = "running"
    lifecycle: str = ""  # DescribeInstances' InstanceLifecycle: spot, capacity-block; "" for On-Demand
    reservation: str = ""  # the capacity reservation it was launched into (filter capacity-reservation-id)


def instance_type_result(itype: str) -> dict:
    vcpus, mem, gpus, efa, archs, _ = INSTANCE_TYPES[itype]
    cards, efa_max = NETWORK_CARDS.get(itype, (1, 1 if efa else 0))
    return {
        "id": itype,
        "instanceType": itype,
        "defaultVcpus": vcpus,
        "defaultCores": CPU_CORES[itype][0],
        "defaultThreadsPerCore": CPU_CORES[itype][1],
        "memorySize": mem,
        "gpuses": gpus,
        "efaSupported": efa,
        "efaMaximumInterfaces": efa_max,
        "maximumNetworkCards": cards,
        "supportedArchitectures": archs,
        "currentGeneration": True,
    }


def ami_result(image_id: str = DLAMI_ID, root_gib: int = DLAMI_ROOT_GIB, arch: str = "x86_64",
               name: str = DLAMI_NAME) -> dict:
    return {
        "id": image_id,
        "imageId": image_id,
        "name": name,
        "architecture": arch,
        "rootDeviceName": "/dev/sda1",
        "blockDeviceMappings": [
            {"deviceName": "/dev/sda1", "ebs": {"volume_size": str(root_gib), "volume_type": "gp3"},
             "noDevice": "", "virtualName": ""},
        ],
        "state": "available",
    }


def user_data_of(instance: Registered) -> str:
    """The cloud-config an instance boots: its userDataBase64 input, base64 and gzip undone as
    EC2 and cloud-init do."""
    return gzip.decompress(base64.b64decode(instance.inputs["userDataBase64"])).decode()


def user_data_size(instance: Registered) -> int:
    """What EC2's 16 KiB limit counts: the user-data bytes before base64 (here gzip's)."""
    return len(base64.b64decode(instance.inputs["userDataBase64"]))


@dataclass
class Registered:
    typ: str
    name: str
    inputs: dict
    urn: str = ""
    parent: str = ""  # the parent's URN ("" for none)
    dependencies: tuple[str, ...] = ()  # URNs of explicit depends_on
    ignore_changes: tuple[str, ...] = ()
    replace_on_changes: tuple[str, ...] = ()
    delete_before_replace: bool = False
    replacement_trigger: object = None  # ResourceOptions.replacement_trigger, as the engine gets it
    replace_with: tuple[str, ...] = ()  # URNs of ResourceOptions.replace_with


def _value(value):
    """A protobuf Value (how the SDK sends replacement_trigger) as plain Python."""
    from google.protobuf import json_format

    return json_format.MessageToDict(value)


def _engine_in_range(self, request):
    """The SDK's mock engine has no RequirePulumiVersion RPC (the program's first call: infra/program.py
    MIN_PULUMI_CLI): stand in for an engine that satisfies the range. tests/unit/test_infra_project.py shows an
    older engine refused."""
    return None


MockEngine.RequirePulumiVersion = _engine_in_range


class RecordingMonitor(MockMonitor):
    """The SDK's mock monitor, also recording each resource's parent, dependencies and
    which components called register_outputs (MockResourceArgs carries neither)."""

    def __init__(self, mocks: ClusterMocks):
        super().__init__(mocks)
        self.cluster_mocks = mocks
        self.outputs_registered: set[str] = set()

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            rec = Registered(request.type, request.name, {}, response.urn, request.parent,
                             tuple(request.dependencies), tuple(request.ignoreChanges),
                             tuple(request.replaceOnChanges), request.deleteBeforeReplace,
                             _value(request.replacement_trigger) if request.HasField("replacement_trigger")
                             else None, tuple(request.replace_with))
            self.cluster_mocks.components.append(rec)
            for r in self.cluster_mocks.resources:
                if r.typ == request.type and r.name == request.name and not r.urn:
                    r.urn, r.parent, r.dependencies = rec.urn, rec.parent, rec.dependencies
                    r.ignore_changes, r.replace_on_changes = rec.ignore_changes, rec.replace_on_changes
                    r.delete_before_replace = rec.delete_before_replace
                    r.replacement_trigger = rec.replacement_trigger
                    r.replace_with = rec.replace_with
        return response

    def RegisterResourceOutputs(self, request):
        self.outputs_registered.add(request.urn)
        return super().RegisterResourceOutputs(request)


class ClusterMocks(pulumi.runtime.Mocks):
    """Answers the provider calls the program makes and records every resource."""

    def __init__(self, ami_root_gib: int = DLAMI_ROOT_GIB, ami_arch: str = "x86_64",
                 newest_dlami: str = DLAMI_ID, newest_ubuntu: str = UBUNTU_ID,
                 default_ebs_key: str = AWS_EBS_ALIAS, stashed: dict | None = None,
                 arches: dict[str, str] | None = None, quotas: dict[str, float | str | None] | None = None,
                 running: list[Running] | None = None, capacity_blocks: dict[str, dict | str] | None = None):
        self.resources: list[Registered] = []  # custom resources, with their inputs
        self.components: list[Registered] = []  # everything registered, components included
        self.calls: list[tuple[str, dict]] = []
        self.read_back: dict[str, dict] = {}  # resource name -> the state new_resource answered
        self.ami_root_gib = ami_root_gib
        self.ami_arch = ami_arch
        self.arches = dict(arches or {})  # image id -> architecture, where not ami_arch
        # What get_ami's newest match is today, per owner.
        self.newest = {"amazon": newest_dlami, CANONICAL: newest_ubuntu}
        self.default_ebs_key = default_ebs_key
        # pulumi.Stash as the engine keeps it: the value of its first deployment (a previous
        # run's `stashed`), whatever `input` says later (docs: "Stash", "Updating stashed values").
        self.prior_stash = dict(stashed or {})
        self.stashed: dict[str, object] = {}
        self._public = 0
        # quota code -> its value (None: answered without one), or the provider's error reading it
        # (ROOMY_QUOTA where not given)
        self.quotas = dict(quotas or {})
        self.running = list(running or [])
        # Capacity Block id -> capacity_block_result(...) fields, or the provider's error reading it
        self.capacity_blocks = dict(capacity_blocks or {})

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append((args.token, dict(args.args)))
        if args.token == "aws:ec2/getInstanceType:getInstanceType":
            itype = args.args["instanceType"]
            if itype not in INSTANCE_TYPES:
                raise Exception(f"InvalidInstanceType: The following supplied instance types do not exist: [{itype}]")
            return instance_type_result(itype)
        if args.token == "aws:ec2/getInstanceTypes:getInstanceTypes":
            (flt,) = args.args["filters"]
            assert flt["name"] == "instance-type"
            return {"id": REGION, "instanceTypes": [t for t in flt["values"] if t in INSTANCE_TYPES]}
        if args.token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            (flt,) = args.args["filters"]
            assert flt["name"] == "instance-type"
            zones = sorted({z for t in flt["values"] for z in INSTANCE_TYPES.get(t, (0,) * 6)[5]})
            return {"id": REGION, "locations": zones, "locationTypes": ["availability-zone"] * len(zones),
                    "instanceTypes": list(flt["values"]) * len(zones)}
        if args.token == "aws:ec2/getAmi:getAmi":
            filters = {f["name"]: f["values"] for f in args.args.get("filters", [])}
            if "image-id" in filters:
                image = filters["image-id"][0]
            else:
                (owner,) = args.args["owners"]
                image = self.newest[owner]
            if image in UBUNTU_IDS or image == self.newest[CANONICAL]:
                return ami_result(image, UBUNTU_ROOT_GIB, self.arches.get(image, self.ami_arch), UBUNTU_NAME)
            return ami_result(image, self.ami_root_gib, self.arches.get(image, self.ami_arch))
        if args.token == "aws:ebs/getDefaultKmsKey:getDefaultKmsKey":
            return {"id": REGION, "keyArn": self.default_ebs_key}
        if args.token == "aws:kms/getKey:getKey":
            key = KMS_KEYS.get(args.args["keyId"])
            if key is None:  # the provider's error, as the engine hands it back (failures)
                return {}, [("keyId", f"NotFoundException: Key '{args.args['keyId']}' does not exist")]
            return key
        if args.token == "aws:servicequotas/getServiceQuota:getServiceQuota":
            assert args.args["serviceCode"] == "ec2"
            value = self.quotas.get(args.args["quotaCode"], ROOMY_QUOTA)
            if isinstance(value, str):  # the provider's error, as the engine hands it back
                return {}, [("quotaCode", value)]
            return quota_result(args.args["quotaCode"], value)
        if args.token == "aws:ec2/getInstances:getInstances":
            filters = {f["name"]: f["values"] for f in args.args.get("filters", [])}
            states = args.args.get("instanceStateNames") or ["running"]  # the provider's default
            found = [r for r in self.running if r.state in states and self._matches(r, filters)]
            return {"id": REGION, "ids": [r.id for r in found], "privateIps": [], "publicIps": [],
                    "ipv6Addresses": []}
        if args.token == "aws:ec2/getInstance:getInstance":
            inst = next((r for r in self.running if r.id == args.args["instanceId"]), None)
            if inst is None:
                return {}, [("instanceId", "Your query returned no results")]
            return {"id": inst.id, "instanceType": inst.instance_type, "tags": dict(inst.tags),
                    "instanceState": inst.state}
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"id": ACCOUNT, "accountId": ACCOUNT, "arn": f"arn:aws:iam::{ACCOUNT}:user/test",
                    "userId": "AIDATEST"}
        if args.token == "aws:ec2/getCapacityBlockReservation:getCapacityBlockReservation":
            block = self.capacity_blocks.get(args.args["id"])
            if block is None:
                return {}, [("id", "no matching EC2 Capacity Block Reservation found")]
            if isinstance(block, str):
                return {}, [("id", block)]
            return block
        raise Exception(f"unexpected call {args.token}")

    @staticmethod
    def _matches(inst: Running, filters: dict[str, list[str]]) -> bool:
        """DescribeInstances filters: instance-type (with wildcards), instance-lifecycle, tag:KEY."""
        for name, values in filters.items():
            if name == "instance-type":
                ok = any(fnmatch.fnmatchcase(inst.instance_type, p) for p in values)
            elif name == "instance-lifecycle":
                ok = inst.lifecycle in values
            elif name == "capacity-reservation-id":
                ok = inst.reservation in values
            elif name == "tag-key":
                ok = any(k in inst.tags for k in values)
            elif name.startswith("tag:"):  # values take * and ? wildcards (EC2 API Reference, Filters)
                ok = name[4:] in inst.tags and any(fnmatch.fnmatchcase(inst.tags[name[4:]], v) for v in values)
            else:
                raise Exception(f"unexpected filter {name}")
            if not ok:
                return False
        return True

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        inputs = dict(args.inputs)
        if not args.custom:  # component resources have no inputs to check
            return f"{args.name}-id", inputs
        self.resources.append(Registered(args.typ, args.name, inputs))
        state = dict(inputs)
        if args.typ == "aws:ebs/volume:Volume":  # EC2's id form: the controller's bootstrap checks it
            vid = "vol-" + hashlib.sha256(args.name.encode()).hexdigest()[:17]
            self.read_back[args.name] = state
            return vid, state
        if args.typ == "aws:ec2/instance:Instance":
            market = inputs.get("instanceMarketOptions") or {}
            if market.get("marketType") == "spot":  # RunInstances made a persistent Spot request
                state["spotInstanceRequestId"] = f"sir-{args.name}"
            if market.get("marketType") == "capacity-block":
                # What the provider may read back for an instance in a Capacity Block: no market
                # options (hashicorp/terraform-provider-aws PR #48701, "perpetual diff").
                state["instanceMarketOptions"] = None
            if inputs.get("associatePublicIpAddress"):
                self._public += 1
                state["publicIp"] = f"198.51.100.{self._public}"
            else:
                state["publicIp"] = ""
        if args.typ == "aws:ec2/eip:Eip":
            self._public += 1
            state["publicIp"] = f"198.51.100.{100 + self._public}"
            state["allocationId"] = f"eipalloc-{args.name}"
        if args.typ == "aws:ec2/keyPair:KeyPair":
            state["keyName"] = f"{args.name}-1a2b3c"
        if args.typ == "aws:ec2/placementGroup:PlacementGroup":
            state["name"] = f"{args.name}-4d5e6f"
        if args.typ == "pulumi:index:Stash":
            state["output"] = self.prior_stash.get(args.name, inputs.get("input"))
            self.stashed[args.name] = state["output"]
        if args.typ in ("aws:iam/instanceProfile:InstanceProfile", "aws:iam/role:Role"):
            state["name"] = f"{args.name}-5e6f7a"  # the provider's auto-name
        self.read_back[args.name] = state
        return f"{args.name}-id", state

    def of_type(self, typ: str) -> list[Registered]:
        return [r for r in self.resources if r.typ == typ]


@dataclass
class Run:
    mocks: ClusterMocks
    monitor: RecordingMonitor
    outputs: dict = field(default_factory=dict)

    @property
    def resources(self) -> list[Registered]:
        return self.mocks.resources

    def of_type(self, short: str) -> list[Registered]:
        return self.mocks.of_type(TYPES[short])

    def one(self, short: str) -> Registered:
        found = self.of_type(short)
        assert len(found) == 1, f"expected one {short}, found {len(found)}"
        return found[0]


TYPES = {
    "vpc": "aws:ec2/vpc:Vpc",
    "igw": "aws:ec2/internetGateway:InternetGateway",
    "subnet": "aws:ec2/subnet:Subnet",
    "rt": "aws:ec2/routeTable:RouteTable",
    "nat": "aws:ec2/natGateway:NatGateway",
    "route": "aws:ec2/route:Route",
    "rta": "aws:ec2/routeTableAssociation:RouteTableAssociation",
    "sg": "aws:ec2/securityGroup:SecurityGroup",
    "ingress": "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
    "egress": "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
    "key": "aws:ec2/keyPair:KeyPair",
    "pg": "aws:ec2/placementGroup:PlacementGroup",
    "instance": "aws:ec2/instance:Instance",
    "eni": "aws:ec2/networkInterface:NetworkInterface",
    "eip": "aws:ec2/eip:Eip",
    "role": "aws:iam/role:Role",
    "role_policy": "aws:iam/rolePolicy:RolePolicy",
    "instance_profile": "aws:iam/instanceProfile:InstanceProfile",
    "stash": "pulumi:index:Stash",
    "volume": "aws:ebs/volume:Volume",
    "attachment": "aws:ec2/volumeAttachment:VolumeAttachment",
}

BASE_CONFIG = {"adminCidr": ADMIN_CIDR, "sshPublicKey": SSH_KEY}


def stack_config(**overrides) -> dict[str, str]:
    """`slurm-gpu:` settings as `pulumi config set` stores them (strings); None removes a key."""
    raw = {**BASE_CONFIG, **overrides}
    out = {}
    for key, value in raw.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[f"slurm-gpu:{key}"] = str(value)
    return out


def run_program(config: dict[str, str], mocks: ClusterMocks | None = None) -> Run:
    """Run infra.program.main() under mocks with this stack config; collect what it declared."""
    from infra import program

    mocks = mocks or ClusterMocks()
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="slurm-gpu", stack="test", preview=False, monitor=monitor)
    pulumi.runtime.set_all_config({"aws:region": REGION, **config})
    run = Run(mocks, monitor)

    @pulumi.runtime.test
    def program_test():
        outs = program.main()
        return pulumi.Output.all(**outs).apply(run.outputs.update)

    program_test()
    return run


