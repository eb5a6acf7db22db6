"""The cluster spec (cluster/spec.py): each target's plan builds one, the inventory is its written form,
and it reads back equal; each fact is stated once and nothing is left untyped (no `extra`)."""

from __future__ import annotations

import json

import pytest

from boottest.boot_cluster import BootCluster
from cluster.facts import facts_to_dict
from cluster.inventory import Inventory, InventoryError
from cluster.platform import BOOT_DEBIAN13
from cluster.spec import SCHEMA, Access, AwsResources, ClusterSpec, ScratchVolume
from localcluster import plan as local_plan
from tests.support.pulumi_mocks import run_program, stack_config


@pytest.fixture(scope="module")
def aws_spec() -> ClusterSpec:
    """The stack's `inventory` output under the Pulumi mocks (power saving on: idleStopMinutes 30)."""
    return Inventory.from_dict(run_program(stack_config(idleStopMinutes="30")).outputs["inventory"])


@pytest.fixture
def specs(aws_spec, tmp_path) -> dict[str, ClusterSpec]:
    return {"aws": aws_spec, "local": local_plan.make_inventory(2, 2, idle_stop_s=120),
            "boot": BootCluster(BOOT_DEBIAN13, state=tmp_path).inventory()}


def keys(value, where: str = "") -> list[str]:
    """Every key of a JSON value, as a dotted path."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in [f"{where}{key}", *keys(v, f"{where}{key}.")]]
    if isinstance(value, list):
        return [k for v in value for k in keys(v, where)]
    return []


def test_each_targets_plan_writes_a_spec_that_reads_back_equal(specs):
    for target, spec in specs.items():
        assert spec.target == target
        written = json.loads(spec.to_json())
        assert written["schema"] == SCHEMA
        assert ClusterSpec.from_dict(written) == spec, target
    aws = specs["aws"]
    assert aws.facts.region and aws.facts.stack == "slurm-gpu/test"
    assert set(aws.aws.instance_ids) == {n.name for n in aws.nodes}
    assert isinstance(aws.aws.scratch_volume, ScratchVolume)
    assert specs["local"].aws is None and specs["boot"].aws is None
    assert specs["boot"].facts.platform == BOOT_DEBIAN13  # the platform lives in the facts, not beside them


def test_the_inventory_states_each_fact_once_and_nothing_untyped(specs):
    for target, spec in specs.items():
        written = spec.to_dict()
        assert set(written) == {"schema", "target", "facts", "access", "aws"}, target
        assert not [k for k in keys(written) if k.split(".")[-1] == "extra"], target
        facts = set(written["facts"])
        assert not facts & set(written["access"]), target
        assert not facts & set(written["aws"] or {}), target
        # What the inventory used to copy out of the facts is read from them.
        assert (spec.cluster_name, spec.gpus_per_node, spec.gpu_type, spec.scratch) == (
            spec.facts.cluster_name, spec.facts.shape.gpu_count, spec.facts.shape.gpu_type, spec.facts.scratch)
        assert spec.gpu_device_prefix == spec.facts.platform.gpu_device_prefix
    assert specs["aws"].idle_stop_s == 1800 and specs["local"].idle_stop_s == 120
    assert specs["boot"].idle_stop_s is None


def old_form(spec: ClusterSpec, extra: dict) -> dict:
    """An inventory as fab wrote it before SCHEMA 2: the facts' fields copied flat beside the facts
    as a dict (with their own empty `extra`), and `extra`."""
    f = spec.facts
    return {
        "target": spec.target, "cluster_name": f.cluster_name, "ssh_user": f.ssh_user,
        "controller": {"name": f.controller.name, "private_ip": f.controller.ip, "role": "controller",
                       "public_ip": spec.access.controller_public_ip},
        "gpu_nodes": [{"name": h.name, "private_ip": h.ip, "role": "gpu", "public_ip": None} for h in f.gpu_nodes],
        "gpus_per_node": f.shape.gpu_count, "gpu_type": f.shape.gpu_type, "nvlink": f.nvlink, "efa": f.efa,
        "python": spec.access.python, "service_cmd": spec.access.service_cmd, "scratch": f.scratch,
        "job_user": f.job_user, "ssh_key_file": spec.access.ssh_key_file, "extra": extra,
        "facts": old_facts(f),
    }


def old_facts(f) -> dict:
    """The facts as fab wrote them before the region and stack were the cluster's own: the power-save
    part held them (and an empty `extra`)."""
    d = facts_to_dict(f)
    region, stack = d.pop("region"), d.pop("stack")
    if d.get("power_save"):
        d["power_save"] = {**d["power_save"], "region": region, "stack": stack}
    return {**d, "extra": {}}


def test_an_inventory_written_before_the_schema_is_read_as_it_was_meant(aws_spec):
    """A stack brought up by an older fab keeps working (status, down, train) without a `pulumi up`."""
    aws = aws_spec.aws
    extra = {"region": aws_spec.facts.region, "stack": aws_spec.facts.stack, "instance_ids": aws.instance_ids,
             "scratch_volume": json.loads(json.dumps(aws.scratch_volume.__dict__)),
             "idle_stop_s": 1800, "power_up_time": "~2-4 minutes", "resume_timeout_s": 900}
    assert ClusterSpec.from_dict(old_form(aws_spec, extra)) == aws_spec
    local = local_plan.make_inventory(2, 2)
    assert ClusterSpec.from_dict(old_form(local, {"known_hosts": local.access.known_hosts})) == local
    before_job_users = {**old_form(local, {}), "job_user": ""}
    assert ClusterSpec.from_dict(before_job_users).job_user == local.ssh_user


def test_an_unknown_or_broken_inventory_names_the_fix(aws_spec):
    with pytest.raises(InventoryError, match=r"schema 3, this fab reads 2: update slurm-gpu"):
        ClusterSpec.from_dict({**aws_spec.to_dict(), "schema": 3})
    broken = aws_spec.to_dict()
    del broken["access"]
    with pytest.raises(InventoryError, match=r"inventory is malformed \('access'\); re-run `pulumi up`"):
        ClusterSpec.from_dict(broken)
    with pytest.raises(InventoryError, match="not a JSON object"):
        ClusterSpec.from_dict([])


def test_access_and_aws_parts_are_typed():
    spec = Inventory.from_dict(local_plan.make_inventory(1, 1).to_dict())
    assert isinstance(spec.access, Access) and spec.access.known_hosts
    assert AwsResources().instance_ids == {} and spec.controller.public_ip == spec.facts.controller.ip


def test_a_schema_2_inventory_with_the_region_and_stack_under_aws_reads_into_the_facts(aws_spec):
    """The first schema 2 form kept the stack's region and name under `aws`; they are facts now."""
    written = aws_spec.to_dict()
    facts = dict(written["facts"])
    region, stack = facts.pop("region"), facts.pop("stack")
    older = {**written, "facts": facts, "aws": {**written["aws"], "region": region, "stack": stack}}
    assert ClusterSpec.from_dict(older) == aws_spec


@pytest.mark.parametrize("bad", [{"aws": "x"}, {"access": 3}, {"facts": {"controller": "x"}}])
def test_a_part_of_the_wrong_type_is_a_one_line_error(aws_spec, bad):
    with pytest.raises(InventoryError, match="inventory is malformed"):
        ClusterSpec.from_dict({**aws_spec.to_dict(), **bad})


def test_an_older_inventory_with_a_part_of_the_wrong_type_is_a_one_line_error(aws_spec):
    with pytest.raises(InventoryError, match="inventory is malformed"):
        ClusterSpec.from_dict({**old_form(aws_spec, {}), "controller": "x"})
