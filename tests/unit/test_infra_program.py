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

from bootstrap import node_layout, render, shipped_form, user_data
from cluster.facts import ClusterFacts, Host, NodeShape, PowerSave, max_gpu_nodes
from cluster.inventory import Inventory
from cluster.spec import ScratchVolume
from infra.config import PlanError
from tests.support.pulumi_mocks import (
    ADMIN_CIDR,
    DLAMI_ID,
    SSH_KEY,
    UBUNTU_ID,
    ClusterMocks,
    Run,
    run_program,
    stack_config,
    user_data_of,
    user_data_size,
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
    ips: tuple[str, ...]  # controller (public subnet) first, then the GPU nodes (private subnet)
    cpus: int
    gpus: int
    gres: str
    memory_mib: int  # advertised by EC2
    nvlink: bool
    efa: bool
    root_gib: int
    cluster: str
    efa_cards: int  # EFA interfaces per GPU node (one per network card)
    public: str = "10.0.0.0/24"  # the controller's subnet
    ami: str = DLAMI_ID  # the GPU nodes'
    controller_ami: str = UBUNTU_ID
    scratch: tuple[int, int] = (125, 3000)  # the controller's volume (the shared /scratch): MiB/s, IOPS
    nat_ip: str = "10.0.0.4"  # the NAT gateway's, in the public subnet


CASES = [
    Case("default-2x-g6.12xlarge", {}, "g6.12xlarge", "c6i.xlarge", "10.0.1.0/24", "10.0.0.0/16",
         "ap-northeast-2a", ("10.0.0.10", "10.0.1.11", "10.0.1.12"), 48, 4, "l4", 196608, False, True,
         200, "mini", 1),
    Case("3x-g6.48xlarge", {"gpuNodeCount": 3, "gpuInstanceType": "g6.48xlarge",
                             "scratchThroughputMBps": "500", "scratchIops": "6000"}, "g6.48xlarge",
         "c6i.xlarge", "10.0.1.0/24", "10.0.0.0/16", "ap-northeast-2b",
         ("10.0.0.10", "10.0.1.11", "10.0.1.12", "10.0.1.13"), 192, 8, "l4", 786432, False, True, 200,
         "mini", 1, scratch=(500, 6000)),
    Case("4x-p5.48xlarge", {"gpuNodeCount": "4", "gpuInstanceType": "p5.48xlarge", "rootVolumeGiB": 500,
                             "clusterName": "h100s", "vpcCidr": "10.20.0.0/16", "subnetCidr": "10.20.4.0/24",
                             "controllerInstanceType": "t3.large", "amiId": "ami-0a1b2c3d4e5f60718",
                             "controllerAmiId": "ami-0c1d2e3f4a5b6c7d8", "scratchThroughputMBps": 1000},
         "p5.48xlarge", "t3.large", "10.20.4.0/24", "10.20.0.0/16", "ap-northeast-2c",
         ("10.20.0.10", "10.20.4.11", "10.20.4.12", "10.20.4.13", "10.20.4.14"), 192, 8, "h100", 2097152,
         True, True, 500, "h100s", 32, "10.20.0.0/24", "ami-0a1b2c3d4e5f60718", "ami-0c1d2e3f4a5b6c7d8",
         scratch=(1000, 4000), nat_ip="10.20.0.4"),
    Case("2x-p4d.24xlarge", {"gpuInstanceType": "p4d.24xlarge", "publicSubnetCidr": "10.0.200.0/28"},
         "p4d.24xlarge", "c6i.xlarge", "10.0.1.0/24", "10.0.0.0/16", "ap-northeast-2a",
         ("10.0.200.10", "10.0.1.11", "10.0.1.12"), 96, 8, "a100", 1179648, True, True, 200, "mini", 4,
         "10.0.200.0/28", nat_ip="10.0.200.4"),
    Case("1x-g4dn-no-efa", {"gpuNodeCount": 1, "gpuInstanceType": "g4dn.xlarge", "efa": False,
                             "availabilityZone": "ap-northeast-2d", "subnetCidr": "10.0.128.0/28"},
         "g4dn.xlarge", "c6i.xlarge", "10.0.128.0/28", "10.0.0.0/16", "ap-northeast-2d",
         ("10.0.0.10", "10.0.128.11"), 4, 1, "t4", 16384, False, False, 200, "mini", 0),
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


def _enis_of(run: Run, instance) -> list[tuple[int, int, object]]:
    """(network card, device index, interface) attached to an instance at launch, card 0 first."""
    if "primaryNetworkInterface" in instance.inputs:
        assert "networkInterfaces" not in instance.inputs
        attached = [(0, 0, instance.inputs["primaryNetworkInterface"]["networkInterfaceId"])]
    else:
        attached = [(a.get("networkCardIndex", 0), a["deviceIndex"], a["networkInterfaceId"])
                    for a in instance.inputs["networkInterfaces"]]
    by_id = {_id(e): e for e in run.of_type("eni")}
    return sorted((card, dev, by_id[eni_id]) for card, dev, eni_id in attached)


def _eni_of(run: Run, instance):
    """The primary interface (network card 0, device 0)."""
    card, dev, eni = _enis_of(run, instance)[0]
    assert (card, dev) == (0, 0)
    return eni


def _subnets(run: Run):
    subnets = {r.inputs["tags"]["Name"].split("-", 1)[1]: r for r in run.of_type("subnet")}
    assert set(subnets) == {"public", "gpu-private"}
    return subnets["public"], subnets["gpu-private"]


# ---------------------------------------------------------------- network

def test_public_and_private_subnets_with_their_routes(deployed):
    case, run = deployed
    vpc, igw, nat = run.one("vpc"), run.one("igw"), run.one("nat")
    public, private = _subnets(run)
    assert vpc.inputs["cidrBlock"] == case.vpc
    assert (public.inputs["cidrBlock"], private.inputs["cidrBlock"]) == (case.public, case.subnet)
    for subnet in (public, private):
        assert subnet.inputs["vpcId"] == _id(vpc)
        # Both in the placement group's zone; neither hands out public IPs by itself.
        assert subnet.inputs["availabilityZone"] == case.zone
        assert subnet.inputs["mapPublicIpOnLaunch"] is False
    assert igw.inputs["vpcId"] == _id(vpc)
    # The NAT gateway sits in the public subnet with the stack's one Elastic IP.
    (eip,) = run.of_type("eip")
    assert eip.inputs["domain"] == "vpc" and "networkInterface" not in eip.inputs and "instance" not in eip.inputs
    assert nat.inputs["subnetId"] == _id(public)
    assert nat.inputs["allocationId"] == f"eipalloc-{eip.name}"  # the allocation id the mocks gave it
    assert nat.inputs["connectivityType"] == "public"
    assert run.one("igw").urn in nat.dependencies
    routes = {r.inputs["routeTableId"]: r for r in run.of_type("route")}
    rtas = {r.inputs["subnetId"]: r.inputs["routeTableId"] for r in run.of_type("rta")}
    assert set(rtas) == {_id(public), _id(private)} and len(set(rtas.values())) == 2
    public_route, private_route = routes[rtas[_id(public)]], routes[rtas[_id(private)]]
    assert public_route.inputs == {"routeTableId": rtas[_id(public)], "destinationCidrBlock": "0.0.0.0/0",
                                   "gatewayId": _id(igw)}
    assert private_route.inputs == {"routeTableId": rtas[_id(private)], "destinationCidrBlock": "0.0.0.0/0",
                                    "natGatewayId": _id(nat)}
    for rt in run.of_type("rt"):
        assert rt.inputs["vpcId"] == _id(vpc)


def test_every_fixed_address_has_its_own_place(deployed):
    """The NAT gateway gets a fixed address too: given none, EC2 picks a random free one, and the
    gateway is made before the controller, whose .10 it could take. In each subnet no two fixed
    addresses are the same and none is one AWS reserves (the first four and the last)."""
    case, run = deployed
    nat = run.one("nat")
    assert nat.inputs.get("privateIp") == case.nat_ip
    assert nat.delete_before_replace  # a replacement needs the address (and the Elastic IP) free
    fixed: dict[str, list[str]] = {_id(s): [] for s in run.of_type("subnet")}
    fixed[nat.inputs["subnetId"]].append(nat.inputs["privateIp"])
    for inst in run.of_type("instance"):
        if "privateIp" in inst.inputs:
            fixed[inst.inputs["subnetId"]].append(inst.inputs["privateIp"])
    for eni in run.of_type("eni"):
        fixed[eni.inputs["subnetId"]].extend(eni.inputs.get("privateIps") or [])
    cidrs = {_id(s): s.inputs["cidrBlock"] for s in run.of_type("subnet")}
    for subnet_id, ips in fixed.items():
        net = ipaddress.ip_network(cidrs[subnet_id])
        reserved = {net[0], net[1], net[2], net[3], net[-1]}
        assert len(set(ips)) == len(ips), (cidrs[subnet_id], ips)
        for ip in map(ipaddress.ip_address, ips):
            assert ip in net and ip not in reserved, (cidrs[subnet_id], ip)
    assert sum(map(len, fixed.values())) == len(case.ips) + 1  # every host and the NAT gateway


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


def test_every_host_and_interface_is_in_the_group(deployed):
    case, run = deployed
    sg_id = _id(run.one("sg"))
    controller, gpus = _instances(run)
    assert controller[0].inputs["vpcSecurityGroupIds"] == [sg_id]
    for node in gpus:
        for _, _, eni in _enis_of(run, node):
            assert eni.inputs["securityGroups"] == [sg_id]
    assert all(e.inputs["securityGroups"] == [sg_id] for e in run.of_type("eni"))


# ---------------------------------------------------------------- hosts

def test_node_count_types_and_fixed_ips(deployed):
    case, run = deployed
    controller, gpus = _instances(run)
    public, private = _subnets(run)
    assert len(controller) == 1 and len(gpus) == len(case.ips) - 1
    ctl = controller[0].inputs
    assert ctl["instanceType"] == case.controller_type
    assert ctl["privateIp"] == case.ips[0]
    assert ctl["subnetId"] == _id(public)
    got = [ctl["privateIp"]]
    for node, ip in zip(gpus, case.ips[1:], strict=False):
        assert node.inputs["instanceType"] == case.gpu_type
        assert "subnetId" not in node.inputs and "privateIp" not in node.inputs  # from the interface
        eni = _eni_of(run, node)
        assert eni.inputs["privateIps"] == [ip]
        assert eni.inputs["subnetId"] == _id(private)
        got.append(eni.inputs["privateIps"][0])
    assert got == list(case.ips)
    assert len(set(got)) == len(got)
    for ips, cidr in ((got[:1], case.public), (got[1:], case.subnet)):
        net = ipaddress.ip_network(cidr)
        reserved = {net.network_address + i for i in range(4)} | {net.broadcast_address}
        for ip in map(ipaddress.ip_address, ips):
            assert ip in net and ip not in reserved


def test_one_efa_interface_per_network_card_and_none_on_the_controller(deployed):
    """Card 0: the primary interface (type efa, the node's IP); every other card: an EFA-only
    interface (no IP) at device index 1, all attached at launch in the private subnet."""
    case, run = deployed
    controller, gpus = _instances(run)
    _, private = _subnets(run)
    assert "primaryNetworkInterface" not in controller[0].inputs
    assert "networkInterfaces" not in controller[0].inputs
    assert len(run.of_type("eni")) == len(gpus) * max(case.efa_cards, 1)  # the controller gets none
    for node in gpus:
        attached = _enis_of(run, node)
        assert [(card, dev) for card, dev, _ in attached] == \
            [(0, 0)] + [(card, 1) for card in range(1, case.efa_cards)]
        types = [eni.inputs.get("interfaceType") for _, _, eni in attached]
        if case.efa:
            assert types == ["efa"] + ["efa-only"] * (case.efa_cards - 1)
        else:
            assert types == [None]
        for card, _, eni in attached:
            assert eni.inputs["subnetId"] == _id(private)
            assert ("privateIps" in eni.inputs) == (card == 0)
            assert eni.inputs["tags"]["Name"] == node.inputs["tags"]["Name"]
        # One card: the primary interface only (no deprecated launch-time list).
        assert ("primaryNetworkInterface" in node.inputs) == (max(case.efa_cards, 1) == 1)


def test_gpu_nodes_share_one_cluster_placement_group(deployed):
    case, run = deployed
    pg = run.one("pg")
    assert pg.inputs["strategy"] == "cluster"
    controller, gpus = _instances(run)
    pg_name = f"{pg.name}-4d5e6f"  # the name the mocks gave it
    assert {n.inputs["placementGroup"] for n in gpus} == {pg_name}
    assert "placementGroup" not in controller[0].inputs


def test_only_the_controller_has_a_public_address(deployed):
    """The controller has a public IP in the public subnet; GPU nodes have none: no Elastic
    IP but the NAT gateway's, and they boot once the private subnet routes out through it."""
    case, run = deployed
    controller, gpus = _instances(run)
    assert controller[0].inputs["associatePublicIpAddress"] is True
    (eip,) = run.of_type("eip")
    assert _id(eip) not in str([e.inputs for e in run.of_type("eni")])
    for node in gpus:
        assert not node.inputs.get("associatePublicIpAddress")
        for _, _, eni in _enis_of(run, node):
            assert "associatePublicIpAddress" not in eni.inputs
    public_way = {run.one("igw").urn} | {r.urn for r in run.of_type("route") if "gatewayId" in r.inputs}
    nat_way = {run.one("nat").urn} | {r.urn for r in run.of_type("route") if "natGatewayId" in r.inputs}
    assert public_way <= set(controller[0].dependencies)
    for node in gpus:
        assert nat_way <= set(node.dependencies)


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
        assert i["ami"] == (case.controller_ami if name == "controller" else case.ami)
        assert i["keyName"] == f"{key.name}-1a2b3c"
        role = "controller" if name == "controller" else "gpu"
        # The owning stack too (project/stack: the mocks name no organization); see test_infra_quotas.
        assert i["tags"] == {"Cluster": case.cluster, "Role": role, "Name": f"{case.cluster}-{name}",
                             "slurm-gpu:stack": "slurm-gpu/test"}
    for res in run.resources:
        if "tags" in res.inputs:
            assert res.inputs["tags"]["Cluster"] == case.cluster


def test_shared_scratch_is_its_own_gp3_volume_attached_to_the_controller(deployed):
    """/scratch is its own encrypted gp3 volume in the controller's zone with slurm-gpu:scratchSizeGiB,
    scratchThroughputMBps and the IOPS gp3 needs (1000 MiB/s: 4000, at 0.25 MiB/s per IOPS), attached
    to the controller; every root volume keeps gp3's baseline, said explicitly. The volume keeps its
    key when ebsKmsKeyId changes (a replaced volume would be empty). The controller's user-data does
    not name the volume: a replaced controller boots it whatever the volume's id. The inventory
    carries what the volume got, for `fab estimate`."""
    case, run = deployed
    controller, gpus = _instances(run)
    vol = run.one("volume")
    assert vol.inputs["type"] == "gp3" and vol.inputs["encrypted"] is True
    assert vol.inputs["size"] == 100  # the default
    assert (vol.inputs["throughput"], vol.inputs["iops"]) == case.scratch
    zones = {s.inputs["availabilityZone"] for s in run.of_type("subnet")}
    assert zones == {vol.inputs["availabilityZone"]} == {run.outputs["gpuTypeZones"]["zone"]}
    assert vol.inputs["tags"] == {"Cluster": case.cluster, "Role": "scratch", "Name": f"{case.cluster}-scratch",
                                  "slurm-gpu:stack": "slurm-gpu/test"}
    att = run.one("attachment")
    assert att.inputs["volumeId"].startswith("vol-") and att.inputs["instanceId"] == f"{controller[0].name}-id"
    assert att.inputs["stopInstanceBeforeDetaching"] is True and not att.inputs.get("forceDetach")
    assert not att.inputs.get("skipDestroy")
    vol_id = att.inputs["volumeId"]
    assert list(vol.ignore_changes) == ["kmsKeyId"]
    assert vol_id.replace("-", "") not in user_data_of(controller[0])
    assert "nvme-Amazon_Elastic_Block_Store_vol" in user_data_of(controller[0])  # how it is found instead
    for node in [*controller, *gpus]:
        assert (node.inputs["rootBlockDevice"]["throughput"], node.inputs["rootBlockDevice"]["iops"]) == (125, 3000)
    inv = Inventory.from_dict(run.outputs["inventory"])
    assert inv.aws.scratch_volume == ScratchVolume(throughput_mbps=case.scratch[0], iops=case.scratch[1],
                                                   size_gib=100, volume_id=vol_id)


def test_scratch_volume_size_is_the_setting_and_its_parent_the_nodes():
    run = run_program(stack_config(scratchSizeGiB="300"))
    vol, att = run.one("volume"), run.one("attachment")
    assert vol.inputs["size"] == 300
    for res in (vol, att):  # children of the Nodes component, like the controller
        assert res.parent.split("::")[-1] == "mini-nodes" and "slurm-gpu:infra:Nodes" in res.parent, res.parent
    assert att.delete_before_replace


# ---------------------------------------------------------------- user-data

# Sockets, threads per core (2 on every type here: 2 vCPUs a core) and NVSwitch of each type: the
# whole-host types have two sockets; p4d (HGX A100) and p5 (HGX H100) join their GPUs by NVSwitch.
TOPOLOGY = {"g6.12xlarge": (1, 2, False), "g6.48xlarge": (2, 2, False), "p5.48xlarge": (2, 2, True),
            "p4d.24xlarge": (2, 2, True), "g4dn.xlarge": (1, 2, False)}


def _node_lines(slurm_conf: str) -> list[dict[str, str]]:
    """Each node's keys, NodeName=DEFAULT's (the shape) under its own."""
    lines = [dict(tok.split("=", 1) for tok in ln.split()) for ln in slurm_conf.splitlines()
             if re.match(r"^NodeName=", ln)]
    default = next((ln for ln in lines if ln["NodeName"] == "DEFAULT"), {})
    return [{**default, **ln} for ln in lines if ln["NodeName"] != "DEFAULT"]


def test_user_data_is_rendered_from_the_cluster_facts(deployed):
    case, run = deployed
    controller, gpus = _instances(run)
    ctl_ud = user_data_of(controller[0])
    doc = yaml.safe_load(ctl_ud)
    files = _decoded_files(doc)
    nodes = _node_lines(files[node_layout.SLURM_CONF])
    # Slurm node lines follow config (names, IPs, count) and instance facts.
    assert [n["NodeName"] for n in nodes] == [f"gpu-node-{i:02d}" for i in range(1, len(case.ips))]
    assert [n["NodeAddr"] for n in nodes] == list(case.ips[1:])
    sockets, threads, nvswitch = TOPOLOGY[case.gpu_type]
    for n in nodes:
        assert n["CPUs"] == str(case.cpus)
        assert (n["Sockets"], n["ThreadsPerCore"]) == (str(sockets), str(threads))
        assert int(n["CoresPerSocket"]) * sockets * threads == case.cpus
        assert n["Gres"] == f"gpu:{case.gres}:{case.gpus}"
        assert 0.92 * case.memory_mib <= int(n["RealMemory"]) < case.memory_mib
    real_memory = int(nodes[0]["RealMemory"])

    facts = ClusterFacts(
        cluster_name=case.cluster,
        controller=Host("controller", case.ips[0]),
        gpu_nodes=tuple(Host(f"gpu-node-{i:02d}", ip) for i, ip in enumerate(case.ips[1:], 1)),
        shape=NodeShape(cpus=case.cpus, real_memory_mib=real_memory, gpu_count=case.gpus,
                        gpu_type=case.gres, sockets=sockets, threads_per_core=threads),
        subnet_cidr=case.subnet,
        ssh_user="ubuntu",
        efa=case.efa,
        nvlink=case.nvlink,
        nvswitch=nvswitch,
        # idleStopMinutes' default (30 min), the EC2 programs, the stack's region.
        power_save=PowerSave(suspend_time=1800, suspend_program="/usr/local/sbin/slurm-gpu-suspend",
                             resume_program="/usr/local/sbin/slurm-gpu-resume", suspend_timeout=180,
                             resume_timeout=900, provider="ec2"),
        region="ap-northeast-2", stack="slurm-gpu/test",  # the stack tag the power programs look for
    )
    assert ctl_ud == user_data.user_data(facts, "controller")
    # Each GPU node gets its own user-data, made from the controller and itself only.
    for node, host in zip(gpus, facts.gpu_nodes, strict=True):
        assert user_data_of(node) == user_data.user_data(facts, "gpu", host.name)
        files = _decoded_files(yaml.safe_load(user_data_of(node)))
        assert node_layout.SLURM_CONF not in files and node_layout.GRES_CONF not in files  # configless
    assert len({user_data_of(n) for n in gpus}) == len(gpus)
    # The controller's user-data is read at first boot only: node-list changes go by
    # `fab reconfigure`, so the program never stops the controller to change it.
    # (`ami` is ignored too unless the config names the image: tests/unit/test_infra_images.py.)
    assert {"userData", "userDataBase64"} <= set(controller[0].ignore_changes)
    assert not controller[0].replace_on_changes
    assert set(controller[0].ignore_changes) <= {"userData", "userDataBase64", "ami"}


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
        ud = user_data_of(inst)
        assert user_data_size(inst) <= 16384  # EC2's user-data limit
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
    conf = _decoded_files(yaml.safe_load(user_data_of(controller[0])))[node_layout.SLURM_CONF]
    lines = _node_lines(conf)
    assert len(lines) == 52 and lines[-1]["NodeAddr"] == "10.0.1.62"
    for inst in controller + gpus[:1]:
        assert user_data_size(inst) <= 16384


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
    assert not any(n.public_ip for n in inv.gpu_nodes)  # reached through the controller only
    facts = inv.facts  # what `fab reconfigure` renders slurm.conf from
    assert [(h.name, h.ip) for h in facts.hosts] == [(n.name, n.private_ip) for n in inv.nodes]
    assert (facts.subnet_cidr, facts.shape.gpu_count, facts.efa) == (case.subnet, case.gpus, case.efa)
    ctl_files = _decoded_files(yaml.safe_load(user_data_of(_instances(run)[0][0])))
    assert shipped_form.shipped_slurm_config(render.render_slurm_conf(facts)) == ctl_files[node_layout.SLURM_CONF]
    assert (inv.gpus_per_node, inv.gpu_type, inv.nvlink, inv.efa) == (case.gpus, case.gres, case.nvlink, case.efa)
    assert inv.python == "/opt/slurm-gpu/venv/bin/python"
    assert inv.service_cmd.format(action="restart", service="slurmd") == "sudo systemctl restart slurmd"
    assert inv.facts.region == "ap-northeast-2"
    assert set(inv.aws.instance_ids) == {n.name for n in inv.nodes}


# ---------------------------------------------------------------- structure

def test_components_own_their_resources(deployed):
    case, run = deployed
    comps = {r.urn: r for r in run.mocks.components if r.typ.startswith("slurm-gpu:infra:")}
    assert {c.typ for c in comps.values()} == {
        "slurm-gpu:infra:Cluster", "slurm-gpu:infra:Network", "slurm-gpu:infra:Security",
        "slurm-gpu:infra:Nodes", "slurm-gpu:infra:PowerSave", "slurm-gpu:infra:Images",
    }
    owner = {
        "vpc": "Network", "igw": "Network", "subnet": "Network", "rt": "Network", "route": "Network",
        "rta": "Network", "nat": "Network", "eip": "Network", "sg": "Security", "ingress": "Security",
        "egress": "Security", "key": "Nodes", "pg": "Nodes", "instance": "Nodes", "eni": "Nodes",
        "volume": "Nodes", "attachment": "Nodes",
        "role": "PowerSave", "role_policy": "PowerSave", "instance_profile": "PowerSave",
        "stash": "Images",
    }
    for short, comp in owner.items():
        for res in run.of_type(short):
            # The zone's stash is the network's (infra/network.py); the images' are Images'.
            want = "Network" if short == "stash" and res.name.endswith("-zone") else comp
            assert comps[res.parent].typ == f"slurm-gpu:infra:{want}", (res.name, res.parent)
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
    ("publicSubnetCidr", {"publicSubnetCidr": "10.0.1.128/25"}),  # overlaps the GPU subnet
    ("publicSubnetCidr", {"publicSubnetCidr": "10.9.0.0/24"}),  # outside the VPC
    ("publicSubnetCidr", {"publicSubnetCidr": "8.8.8.0/24"}),  # not private
    ("vpcCidr", {"vpcCidr": "10.0.0.0/40"}),
    ("availabilityZone", {"availabilityZone": "ap-northeast-2d"}),  # g6.12xlarge not offered there
    ("clusterName", {"clusterName": "My Cluster"}),
    ("efa", {"efa": "maybe"}),
    ("scratchThroughputMBps", {"scratchThroughputMBps": "100"}),  # under gp3's 125
    ("scratchThroughputMBps", {"scratchThroughputMBps": "1001"}),
    ("scratchThroughputMBps", {"scratchThroughputMBps": "fast"}),
    ("scratchIops", {"scratchThroughputMBps": "1000", "scratchIops": "3500"}),  # 0.25 MiB/s per IOPS: 4000
    ("scratchIops", {"scratchIops": "20000"}),
]


@pytest.mark.parametrize("setting,overrides", BAD, ids=[f"{s}={list(o.values())[-1]}" for s, o in BAD])
def test_bad_input_refused_before_any_resource(setting, overrides):
    mocks = ClusterMocks()
    with pytest.raises(PlanError) as info:
        run_program(stack_config(**overrides), mocks)
    assert f"slurm-gpu:{setting}" in str(info.value)
    assert mocks.components == [] and mocks.resources == []


def test_ami_bigger_than_the_root_volume_refused():
    mocks = ClusterMocks(ami_root_gib=120)
    with pytest.raises(PlanError, match=r"slurm-gpu:rootVolumeGiB is 100 .* at least 120"):
        run_program(stack_config(rootVolumeGiB=100), mocks)
    assert mocks.components == []


def test_default_images_are_the_newest_dlami_and_ubuntu_24_04_server():
    run = run_program(stack_config())
    calls = {tuple(a["owners"]): a for t, a in run.mocks.calls if t == "aws:ec2/getAmi:getAmi"}
    assert set(calls) == {("amazon",), ("099720109477",)}  # AWS's DLAMI; Canonical's Ubuntu
    gpu, controller = calls[("amazon",)], calls[("099720109477",)]
    for call in (gpu, controller):
        assert call["mostRecent"] is True
        assert {f["name"]: f["values"] for f in call["filters"]}["architecture"] == ["x86_64"]
    # Ubuntu 24.04: Python 3.12 meets the pins' Requires-Python >= 3.11 (22.04 has 3.10).
    assert {f["name"]: f["values"] for f in gpu["filters"]}["name"] == \
        ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *"]
    # The controller: the same release without the GPU stack (the DLAMI does not list C6i).
    assert {f["name"]: f["values"] for f in controller["filters"]}["name"] == \
        ["ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-*"]
