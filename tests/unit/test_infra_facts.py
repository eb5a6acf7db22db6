"""Instance-type facts -> NodeShape, NVLink, and the refusals, through the SDK's real
result types (the mocks answer get_instance_type as the provider would)."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws
import pytest

from infra.config import PlanError
from infra.instance_types import gpu_node_facts, gres_type, real_memory_mib
from tests.support.pulumi_mocks import INSTANCE_TYPES, ClusterMocks


@pytest.fixture
def info():
    pulumi.runtime.set_mocks(ClusterMocks(), project="slurm-gpu", stack="test", preview=False)
    return lambda itype: aws.ec2.get_instance_type(instance_type=itype)


@pytest.mark.parametrize("itype,cpus,gpus,gres,nvlink", [
    ("g6.12xlarge", 48, 4, "l4", False),
    ("g6.48xlarge", 192, 8, "l4", False),
    ("p5.48xlarge", 192, 8, "h100", True),
    ("p4d.24xlarge", 96, 8, "a100", True),
    ("g4dn.xlarge", 4, 1, "t4", False),
])
def test_shape_follows_the_instance_type(info, itype, cpus, gpus, gres, nvlink):
    facts = gpu_node_facts(info(itype), efa=INSTANCE_TYPES[itype][3])
    assert facts.shape.cpus == cpus
    assert facts.shape.gpu_count == gpus
    assert facts.shape.gpu_type == gres
    assert facts.nvlink is nvlink
    advertised = INSTANCE_TYPES[itype][1]
    # A little under the real memory: never above, never wastefully far below.
    assert 0.92 * advertised <= facts.shape.real_memory_mib < advertised


def test_seed_node_real_memory_matches_what_worked():
    # The baseline ran g6.12xlarge (196608 MiB advertised) with RealMemory=185000.
    assert 180000 <= real_memory_mib(196608) <= 185000


def test_small_nodes_keep_at_least_a_gib_back():
    assert real_memory_mib(8192) <= 8192 - 1024
    assert real_memory_mib(16384) <= 16384 - 1024


@pytest.mark.parametrize("name,expected", [
    ("L4", "l4"), ("H100", "h100"), ("A10G", "a10g"), ("L40S", "l40s"), ("Radeon Pro V520", "radeonprov520"),
])
def test_gres_type_is_the_model_lower_case(name, expected):
    assert gres_type(name) == expected


def test_cpu_only_type_refused(info):
    with pytest.raises(PlanError, match="slurm-gpu:gpuInstanceType is c6i.xlarge, which has no GPU"):
        gpu_node_facts(info("c6i.xlarge"), efa=False)


def test_type_without_efa_refused_while_efa_is_on(info):
    with pytest.raises(PlanError) as exc:
        gpu_node_facts(info("g4dn.xlarge"), efa=True)
    assert "slurm-gpu:gpuInstanceType" in str(exc.value) and "slurm-gpu:efa" in str(exc.value)
    assert gpu_node_facts(info("g4dn.xlarge"), efa=False).efa_supported is False


def test_arm_type_refused(info):
    with pytest.raises(PlanError, match="slurm-gpu:gpuInstanceType.*arm64"):
        gpu_node_facts(info("g5g.xlarge"), efa=False)


def test_non_nvidia_gpu_refused(info):
    with pytest.raises(PlanError, match="slurm-gpu:gpuInstanceType.*NVIDIA"):
        gpu_node_facts(info("g4ad.16xlarge"), efa=True)


@pytest.mark.parametrize("itype,efa,expected", [
    ("g6.12xlarge", True, 1), ("g6.48xlarge", True, 1), ("p4d.24xlarge", True, 4),
    ("p5.48xlarge", True, 32), ("p5.48xlarge", False, 0), ("g4dn.xlarge", False, 0),
])
def test_one_efa_interface_per_network_card(info, itype, efa, expected):
    assert gpu_node_facts(info(itype), efa=efa).efa_interfaces == expected


def test_efa_interfaces_are_capped_by_what_the_type_allows():
    from types import SimpleNamespace

    from infra.instance_types import efa_interface_count

    # More cards than EFA interfaces (or no card figure at all): the smaller number, at least 1.
    assert efa_interface_count(SimpleNamespace(efa_supported=True, maximum_network_cards=8,
                                               efa_maximum_interfaces=2), efa=True) == 2
    assert efa_interface_count(SimpleNamespace(efa_supported=True, maximum_network_cards=None,
                                               efa_maximum_interfaces=None), efa=True) == 1
    assert efa_interface_count(SimpleNamespace(efa_supported=False, maximum_network_cards=4,
                                               efa_maximum_interfaces=0), efa=True) == 0
