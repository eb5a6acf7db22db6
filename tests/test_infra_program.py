"""The whole Pulumi program under mocks: what it declares for several clusters, and
that bad input is refused before anything is declared.

Expected values are written out per case (IPs, CPUs, GRES...), not re-derived
from the program's own constants.
"""

from __future__ import annotations

import base64
import gzip
import ipaddress
import re
from dataclasses import dataclass

import pytest
import yaml

from bootstrap import render
from bootstrap.facts import ClusterFacts, Host, NodeShape, max_gpu_nodes
from infra.config import ConfigError
from ops.inventory import Inventory
from tests.test_infra_mocks import (
    ADMIN_CIDR,
    DLAMI_ID,
    SSH_KEY,
    ClusterMocks,
    Run,
    run_program,
    stack_config,
)


@dataclass(frozen=True)
class Case:
    id: str
    config: dict
    gpu_type: str
    controller_type: str
    subnet: str
    vpc: str
    zone: str
    ips: tuple[str, ...]  # controller first
    cpus: int
    gpus: int
    gres: str
    memory_mib: int  # advertised by EC2
    nvlink: bool
    efa: bool
    root_gib: int
    cluster: str
    ami: str = DLAMI_ID


CASES = [
    Case("seed-2x-g6.12xlarge", {}, "g6.12xlarge", "c6i.xlarge", "10.0.1.0/24", "10.0.0.0/16",
         "ap-northeast-2a", ("10.0.1.10", "10.0.1.11", "10.0.1.12"), 48, 4, "l4", 196608, False, True,
         200, "mini"),
    Case("3x-g6.48xlarge", {"gpuNodeCount": 3, "gpuInstanceType": "g6.48xlarge"}, "g6.48xlarge",
         "c6i.xlarge", "10.0.1.0/24", "10.0.0.0/16", "ap-northeast-2b",
         ("10.0.1.10", "10.0.1.11", "10.0.1.12", "10.0.1.13"), 192, 8, "l4", 786432, False, True, 200,
         "mini"),
    Case("4x-p5.48xlarge", {"gpuNodeCount": "4", "gpuInstanceType": "p5.48xlarge", "rootVolumeGiB": 500,
                             "clusterName": "h100s", "vpcCidr": "10.20.0.0/16", "subnetCidr": "10.20.4.0/24",
                             "controllerInstanceType": "t3.large", "amiId": "ami-0a1b2c3d4e5f60718"},
         "p5.48xlarge", "t3.large", "10.20.4.0/24", "10.20.0.0/16", "ap-northeast-2c",
         ("10.20.4.10", "10.20.4.11", "10.20.4.12", "10.20.4.13", "10.20.4.14"), 192, 8, "h100", 2097152,
         True, True, 500, "h100s", "ami-0a1b2c3d4e5f60718"),
    Case("1x-g4dn-no-efa", {"gpuNodeCount": 1, "gpuInstanceType": "g4dn.xlarge", "efa": False,
                             "availabilityZone": "ap-northeast-2d", "subnetCidr": "10.0.128.0/28"},
         "g4dn.xlarge", "c6i.xlarge", "10.0.128.0/28", "10.0.0.0/16", "ap-northeast-2d",
         ("10.0.128.10", "10.0.128.11"), 4, 1, "t4", 16384, False, False, 200, "mini"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def deployed(request) -> tuple[Case, Run]:
    case = request.param
    return case, run_program(stack_config(**case.config))


def _instances(run: Run):
    by_role = {"controller": [], "gpu": []}
    for inst in run.of_type("instance"):
        by_role[inst.inputs["tags"]["Role"]].append(inst)
    by_role["gpu"].sort(key=lambda r: r.inputs["tags"]["Name"])
    return by_role["controller"], by_role["gpu"]


def _id(res) -> str:
    return f"{res.name}-id"  # what the mocks answer as a resource's id


def _eni_of(run: Run, instance):
    eni_id = instance.inputs["primaryNetworkInterface"]["networkInterfaceId"]
    (eni,) = [e for e in run.of_type("eni") if _id(e) == eni_id]
    return eni


# ---------------------------------------------------------------- network

def test_vpc_subnet_gateway_and_route(deployed):
    case, run = deployed
    vpc, subnet, igw = run.one("vpc"), run.one("subnet"), run.one("igw")
    assert vpc.inputs["cidrBlock"] == case.vpc
    assert subnet.inputs["cidrBlock"] == case.subnet
    assert subnet.inputs["vpcId"] == _id(vpc) and igw.inputs["vpcId"] == _id(vpc)
    assert subnet.inputs["availabilityZone"] == case.zone
    route, rta, rt = run.one("route"), run.one("rta"), run.one("rt")
    assert route.inputs["destinationCidrBlock"] == "0.0.0.0/0"
    assert route.inputs["gatewayId"] == _id(igw) and route.inputs["routeTableId"] == _id(rt)
    assert rta.inputs == {"subnetId": _id(subnet), "routeTableId": _id(rt)}
    assert rt.inputs["vpcId"] == _id(vpc)


def test_exact_security_group_rules(deployed):
    case, run = deployed
    sg = run.one("sg")
    sg_id = _id(sg)
    assert sg.inputs["vpcId"] == _id(run.one("vpc"))
    assert "ingress" not in sg.inputs and "egress" not in sg.inputs  # no inline rules

    def rule(kind, r):
        i = r.inputs
        assert i["securityGroupId"] == sg_id
        return (kind, i["ipProtocol"], i.get("fromPort"), i.get("toPort"), i.get("cidrIpv4"),
                i.get("cidrIpv6"), i.get("prefixListId"), i.get("referencedSecurityGroupId"))

    rules = [rule("in", r) for r in run.of_type("ingress")] + [rule("out", r) for r in run.of_type("egress")]
    assert sorted(rules, key=str) == sorted([
        ("in", "tcp", 22, 22, ADMIN_CIDR, None, None, None),
        ("in", "-1", None, None, None, None, None, sg_id),
        ("out", "-1", None, None, None, None, None, sg_id),
        ("out", "-1", None, None, "0.0.0.0/0", None, None, None),
    ], key=str)
    # Nothing inbound from the internet.
    for r in run.of_type("ingress"):
        assert r.inputs.get("cidrIpv4") not in ("0.0.0.0/0",) and not r.inputs.get("cidrIpv6")
        assert not r.inputs.get("prefixListId")


def test_every_host_is_in_the_group(deployed):
    case, run = deployed
    sg_id = _id(run.one("sg"))
    controller, gpus = _instances(run)
    assert controller[0].inputs["vpcSecurityGroupIds"] == [sg_id]
    for node in gpus:
        assert _eni_of(run, node).inputs["securityGroups"] == [sg_id]


# ---------------------------------------------------------------- hosts

def test_node_count_types_and_fixed_ips(deployed):
    case, run = deployed
    controller, gpus = _instances(run)
    assert len(controller) == 1 and len(gpus) == len(case.ips) - 1
    ctl = controller[0].inputs
    assert ctl["instanceType"] == case.controller_type
    assert ctl["privateIp"] == case.ips[0]
    assert ctl["subnetId"] == _id(run.one("subnet"))
    got = [ctl["privateIp"]]
    for node, ip in zip(gpus, case.ips[1:], strict=False):
        assert node.inputs["instanceType"] == case.gpu_type
        eni = _eni_of(run, node)
        assert eni.inputs["privateIps"] == [ip]
        assert eni.inputs["subnetId"] == _id(run.one("subnet"))
        got.append(eni.inputs["privateIps"][0])
    assert got == list(case.ips)
    assert len(set(got)) == len(got)
    net = ipaddress.ip_network(case.subnet)
    reserved = {net.network_address + i for i in range(4)} | {net.broadcast_address}
    for ip in map(ipaddress.ip_address, got):
        assert ip in net and ip not in reserved


def test_efa_on_every_gpu_node_and_not_on_the_controller(deployed):
    case, run = deployed
    controller, gpus = _instances(run)
    assert "primaryNetworkInterface" not in controller[0].inputs
    assert len(run.of_type("eni")) == len(gpus)  # the controller gets no extra interface
    for node in gpus:
        eni = _eni_of(run, node)
        assert eni.inputs.get("interfaceType") == ("efa" if case.efa else None)
        assert node.inputs["primaryNetworkInterface"].get("deleteOnTermination") in (None, True)


def test_gpu_nodes_share_one_cluster_placement_group(deployed):
    case, run = deployed
    pg = run.one("pg")
    assert pg.inputs["strategy"] == "cluster"
    controller, gpus = _instances(run)
    pg_name = f"{pg.name}-4d5e6f"  # the name the mocks gave it
    assert {n.inputs["placementGroup"] for n in gpus} == {pg_name}
    assert "placementGroup" not in controller[0].inputs


def test_public_access(deployed):
    """The controller has a public IP; GPU nodes reach the internet through an EIP
    associated with their interface before they launch."""
    case, run = deployed
    controller, gpus = _instances(run)
    assert controller[0].inputs["associatePublicIpAddress"] is True
    assert run.one("subnet").inputs.get("mapPublicIpOnLaunch") is False
    eips = run.of_type("eip")
    assert len(eips) == len(gpus)
    for node, ip in zip(gpus, case.ips[1:], strict=False):
        eni = _eni_of(run, node)
        (eip,) = [e for e in eips if e.inputs["networkInterface"] == _id(eni)]
        assert eip.inputs["domain"] == "vpc" and eip.inputs["associateWithPrivateIp"] == ip
        assert eip.urn in node.dependencies  # launched only once it has its way out
    internet = {run.one(s).urn for s in ("igw", "route", "rta")}
    assert internet <= set(controller[0].dependencies)
    for eip in eips:
        assert internet <= set(eip.dependencies)


def test_imdsv2_encrypted_gp3_roots_ami_key_and_tags(deployed):
    case, run = deployed
    key = run.one("key")
    assert key.inputs["publicKey"] == SSH_KEY
    controller, gpus = _instances(run)
    names = ["controller"] + [f"gpu-node-{i:02d}" for i in range(1, len(gpus) + 1)]
    for inst, name in zip(controller + gpus, names, strict=False):
        i = inst.inputs
        assert i["metadataOptions"]["httpTokens"] == "required"
        assert i["metadataOptions"].get("httpEndpoint", "enabled") == "enabled"
        root = i["rootBlockDevice"]
        assert root["encrypted"] is True and root["volumeType"] == "gp3"
        assert root["volumeSize"] == case.root_gib
        assert i["ami"] == case.ami
        assert i["keyName"] == f"{key.name}-1a2b3c"
        role = "controller" if name == "controller" else "gpu"
        assert i["tags"] == {"Cluster": case.cluster, "Role": role, "Name": f"{case.cluster}-{name}"}
    for res in run.resources:
        if "tags" in res.inputs:
            assert res.inputs["tags"]["Cluster"] == case.cluster


# ---------------------------------------------------------------- user-data

def _node_lines(slurm_conf: str) -> list[dict[str, str]]:
    lines = [ln for ln in slurm_conf.splitlines() if re.match(r"^NodeName=", ln)]
    return [dict(tok.split("=", 1) for tok in ln.split()) for ln in lines]


def test_user_data_is_rendered_from_the_cluster_facts(deployed):
    case, run = deployed
    controller, gpus = _instances(run)
    ctl_ud = controller[0].inputs["userData"]
    doc = yaml.safe_load(ctl_ud)
    files = _decoded_files(doc)
    nodes = _node_lines(files[render.SLURM_CONF])
    # Slurm node lines follow config (names, IPs, count) and instance facts.
    assert [n["NodeName"] for n in nodes] == [f"gpu-node-{i:02d}" for i in range(1, len(case.ips))]
    assert [n["NodeAddr"] for n in nodes] == list(case.ips[1:])
    for n in nodes:
        assert n["CPUs"] == str(case.cpus)
        assert n["Gres"] == f"gpu:{case.gres}:{case.gpus}"
        assert 0.92 * case.memory_mib <= int(n["RealMemory"]) < case.memory_mib
    real_memory = int(nodes[0]["RealMemory"])

    facts = ClusterFacts(
        cluster_name=case.cluster,
        controller=Host("controller", case.ips[0]),
        gpu_nodes=tuple(Host(f"gpu-node-{i:02d}", ip) for i, ip in enumerate(case.ips[1:], 1)),
        shape=NodeShape(cpus=case.cpus, real_memory_mib=real_memory, gpu_count=case.gpus,
                        gpu_type=case.gres),
        subnet_cidr=case.subnet,
        ssh_user="ubuntu",
        efa=case.efa,
        nvlink=case.nvlink,
    )
    assert ctl_ud == render.user_data(facts, "controller")
    gpu_ud = render.user_data(facts, "gpu")
    for node in gpus:
        assert node.inputs["userData"] == gpu_ud
    assert ctl_ud != gpu_ud


def _decoded_files(doc: dict) -> dict[str, str]:
    """write_files path -> the text cloud-init writes (decoding b64 / gz+b64 entries)."""
    out = {}
    for f in doc.get("write_files", []):
        enc = f.get("encoding") or "text/plain"
        data = f["content"]
        if enc in ("b64", "base64"):
            data = base64.b64decode(data).decode()
        elif enc in ("gz+b64", "gzip+base64", "gz+base64"):
            data = gzip.decompress(base64.b64decode(data)).decode()
        else:
            assert enc == "text/plain", enc
        out[f["path"]] = data
    return out


def test_user_data_holds_no_munge_key(deployed):
    case, run = deployed
    for inst in run.of_type("instance"):
        ud = inst.inputs["userData"]
        assert len(ud.encode()) <= 16384  # EC2's user-data limit
        doc = yaml.safe_load(ud)
        files = _decoded_files(doc)
        assert not any("munge" in p for p in files), sorted(files)
        # No key material anywhere: the smallest munge key (mungekey's default,
        # 1024 bits) is a 172-character base64 or 256-character hex run. The key
        # is made on the controller at boot, never shipped in user-data.
        rest = {k: v for k, v in doc.items() if k != "write_files"}
        for text in [yaml.safe_dump(rest), *files.values()]:
            assert not re.search(r"[A-Za-z0-9+/]{100,}={0,2}", text)
            assert "PRIVATE KEY" not in text


def test_the_largest_cluster_a_small_subnet_holds_fits_in_user_data():
    # A /26 holds 52 GPU nodes: past the size where user-data files must be compressed.
    subnet = "10.0.1.0/26"
    count = max_gpu_nodes(subnet)
    run = run_program(stack_config(gpuNodeCount=count, subnetCidr=subnet, gpuInstanceType="p5.48xlarge"))
    controller, gpus = _instances(run)
    assert count == 52 and len(gpus) == 52
    assert gpus[-1].inputs["tags"]["Name"] == "mini-gpu-node-52"
    conf = _decoded_files(yaml.safe_load(controller[0].inputs["userData"]))[render.SLURM_CONF]
    lines = _node_lines(conf)
    assert len(lines) == 52 and lines[-1]["NodeAddr"] == "10.0.1.62"
    for inst in controller + gpus[:1]:
        assert len(inst.inputs["userData"].encode()) <= 16384


# ---------------------------------------------------------------- outputs

def test_outputs(deployed):
    case, run = deployed
    out = run.outputs
    controller, gpus = _instances(run)
    assert out["sshUser"] == "ubuntu"
    assert out["clusterName"] == case.cluster
    assert out["controllerPublicIp"] and out["controllerPublicIp"].startswith("198.51.100.")
    names = ["controller"] + [f"gpu-node-{i:02d}" for i in range(1, len(case.ips))]
    assert out["nodes"] == [
        {"name": n, "private_ip": ip, "role": "controller" if n == "controller" else "gpu"}
        for n, ip in zip(names, case.ips, strict=False)
    ]


def test_inventory_output_is_what_fab_reads(deployed):
    case, run = deployed
    inv = Inventory.from_dict(run.outputs["inventory"])
    assert inv.target == "aws" and inv.cluster_name == case.cluster and inv.ssh_user == "ubuntu"
    assert inv.controller.public_ip == run.outputs["controllerPublicIp"]
    assert (inv.controller.name, inv.controller.private_ip, inv.controller.role) == ("controller", case.ips[0], "controller")
    assert [(n.name, n.private_ip, n.role) for n in inv.gpu_nodes] == [
        (f"gpu-node-{i:02d}", ip, "gpu") for i, ip in enumerate(case.ips[1:], 1)
    ]
    assert all(n.public_ip for n in inv.gpu_nodes)
    assert (inv.gpus_per_node, inv.gpu_type, inv.nvlink, inv.efa) == (case.gpus, case.gres, case.nvlink, case.efa)
    assert inv.python == "/opt/slurm-gpu/venv/bin/python"
    assert inv.service_cmd.format(action="restart", service="slurmd") == "sudo systemctl restart slurmd"
    assert inv.extra["region"] == "ap-northeast-2"


# ---------------------------------------------------------------- structure

def test_components_own_their_resources(deployed):
    case, run = deployed
    comps = {r.urn: r for r in run.mocks.components if r.typ.startswith("slurm-gpu:infra:")}
    assert {c.typ for c in comps.values()} == {
        "slurm-gpu:infra:Cluster", "slurm-gpu:infra:Network", "slurm-gpu:infra:Security",
        "slurm-gpu:infra:Nodes",
    }
    owner = {
        "vpc": "Network", "igw": "Network", "subnet": "Network", "rt": "Network", "route": "Network",
        "rta": "Network", "sg": "Security", "ingress": "Security", "egress": "Security",
        "key": "Nodes", "pg": "Nodes", "instance": "Nodes", "eni": "Nodes", "eip": "Nodes",
    }
    for short, comp in owner.items():
        for res in run.of_type(short):
            assert comps[res.parent].typ == f"slurm-gpu:infra:{comp}", (res.name, res.parent)
    assert len(run.resources) == sum(len(run.of_type(s)) for s in owner)  # nothing else declared
    # Every component registered its outputs.
    assert set(comps) <= run.monitor.outputs_registered


# ---------------------------------------------------------------- refusals

BAD = [
    ("adminCidr", {"adminCidr": None}),
    ("adminCidr", {"adminCidr": "0.0.0.0/0"}),
    ("adminCidr", {"adminCidr": "::/0"}),
    ("adminCidr", {"adminCidr": "203.0.113.7"}),
    ("adminCidr", {"adminCidr": "not-an-ip/32"}),
    ("sshPublicKey", {"sshPublicKey": None}),
    ("sshPublicKey", {"sshPublicKey": "hello world"}),
    ("gpuNodeCount", {"gpuNodeCount": "0"}),
    ("gpuNodeCount", {"gpuNodeCount": "-2"}),
    ("gpuNodeCount", {"gpuNodeCount": "two"}),
    ("gpuNodeCount", {"gpuNodeCount": "300"}),
    ("gpuNodeCount", {"gpuNodeCount": "6", "subnetCidr": "10.0.1.0/28"}),
    ("gpuInstanceType", {"gpuInstanceType": "c6i.xlarge"}),
    ("gpuInstanceType", {"gpuInstanceType": "c7i.48xlarge"}),  # EFA but no GPU
    ("gpuInstanceType", {"gpuInstanceType": "g4dn.xlarge"}),  # GPU but no EFA, efa on
    ("gpuInstanceType", {"gpuInstanceType": "z9.huge"}),  # unknown to AWS
    ("controllerInstanceType", {"controllerInstanceType": "m7g.large"}),  # arm64
    ("rootVolumeGiB", {"rootVolumeGiB": "-10"}),
    ("rootVolumeGiB", {"rootVolumeGiB": "10"}),
    ("subnetCidr", {"subnetCidr": "10.1.0.0/24"}),
    ("vpcCidr", {"vpcCidr": "10.0.0.0/40"}),
    ("availabilityZone", {"availabilityZone": "ap-northeast-2d"}),  # g6.12xlarge not offered there
    ("clusterName", {"clusterName": "My Cluster"}),
    ("efa", {"efa": "maybe"}),
]


@pytest.mark.parametrize("setting,overrides", BAD, ids=[f"{s}={list(o.values())[-1]}" for s, o in BAD])
def test_bad_input_refused_before_any_resource(setting, overrides):
    mocks = ClusterMocks()
    with pytest.raises(ConfigError) as info:
        run_program(stack_config(**overrides), mocks)
    assert f"slurm-gpu:{setting}" in str(info.value)
    assert mocks.components == [] and mocks.resources == []


def test_ami_bigger_than_the_root_volume_refused():
    mocks = ClusterMocks(ami_root_gib=120)
    with pytest.raises(ConfigError, match=r"slurm-gpu:rootVolumeGiB is 100 .* at least 120"):
        run_program(stack_config(rootVolumeGiB=100), mocks)
    assert mocks.components == []


def test_default_ami_is_the_newest_dlami_for_ubuntu_22_04():
    run = run_program(stack_config())
    (call,) = [a for t, a in run.mocks.calls if t == "aws:ec2/getAmi:getAmi"]
    assert call["mostRecent"] is True and call["owners"] == ["amazon"]
    filters = {f["name"]: f["values"] for f in call["filters"]}
    assert filters["name"] == ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"]
    assert filters["architecture"] == ["x86_64"]
