"""One object per target (cluster/targets/): the rest of fab asks it, never compares target names."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from cluster import targets
from cluster.inventory import Inventory, InventoryError
from cluster.targets import Target
from ops.finetune import sbatch as jobs
from tests.support import inventories
from tests.unit.test_jobs_render import inventory as make_inventory

REPO = Path(__file__).resolve().parents[2]


def test_no_target_name_comparisons_outside_the_targets():
    pattern = re.compile(r"target *(==|!=)|target +(not +)?in +\(")
    files = [REPO / "fabfile.py", *(REPO / "jobs").glob("*.j2"),
             *(p for p in (REPO / "ops").rglob("*.py") if "targets" not in p.parts)]
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_registry_and_default():
    assert set(targets.names()) == {"aws", "boot", "local"}
    assert targets.get(None).name == "aws" and targets.get(" Local ").name == "local"
    assert targets.get("stack").name == "aws"
    with pytest.raises(targets.TargetError, match=r"--target must be 'aws' .* or 'local' .*not 'gcp'"):
        targets.get("gcp")
    with pytest.raises(InventoryError, match="not 'gcp'"):
        targets.load("gcp")


def test_local_inventory_missing_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr("cluster.targets.local.LOCAL_INVENTORY", tmp_path / "inventory.json")
    with pytest.raises(InventoryError, match="fab local.up"):
        targets.load("local")


@pytest.mark.parametrize("answer", ["warning: A new version of Pulumi is available\n{}", "[1, 2]", ""])
def test_pulumi_stack_output_that_is_not_a_json_object_names_the_fix(monkeypatch, tmp_path, answer):
    """A `pulumi` CLI (a stand-in script on PATH) whose `stack output --json` is not a JSON object."""
    fake = tmp_path / "pulumi"
    (tmp_path / "answer").write_text(answer)
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'answer'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(InventoryError, match=r"`pulumi stack output --json` did not answer a JSON object"):
        targets.load("aws")


def test_flags_and_efa():
    aws, local = targets.get("aws"), targets.get("local")
    assert aws.flag() == "" and local.flag() == " --target local"
    assert aws.expects_efa(make_inventory()) and not aws.expects_efa(inventories.make(efa=False))
    assert not local.expects_efa(inventories.make("local", efa=True))


def test_device_prefix_comes_from_the_facts_alone():
    """One source: the spec's facts (their platform's prefix); targets state none of their own."""
    local = make_inventory(target="local")
    assert local.gpu_device_prefix == "/var/lib/slurm/gpu-standin/nvidia"
    moved = replace(local, facts=replace(local.facts, gpu_device_prefix="/dev/fake"))
    assert jobs.base_spec(moved, jobs.SANITY_NAME, 2, 2, "/scratch/j").device_prefix == "/dev/fake"
    for name in targets.names():
        assert not hasattr(targets.get(name), "device_prefix"), name
        assert not hasattr(targets.get(name), "gpu_device_prefix"), name


def test_a_third_target_is_one_registration(monkeypatch):
    class OnPrem(Target):
        name = "onprem"
        describe = "a test platform"
        real_gpus = True
        nccl_efa = False
        hub_offline = False
        cloud_init = False
        takes_stack = False

        def load(self, stack):
            return replace(make_inventory(), target="onprem")

    monkeypatch.setitem(targets.base._REGISTRY, "onprem", OnPrem())
    inv: Inventory = targets.load("onprem")
    spec = jobs.base_spec(inv, jobs.SANITY_NAME, 2, 4, "/scratch/j", script_path="/scratch/j/sanity.sbatch")
    assert spec.real_gpus and not spec.nccl_efa and spec.device_prefix == "/dev/nvidia"
    assert "nvidia-smi -L" in jobs.render_sanity(spec)
    finetune = jobs.render_finetune(replace(spec, job_name=jobs.FINETUNE_NAME))
    assert "FI_PROVIDER" not in finetune and "OMP_NUM_THREADS=1" in finetune


def test_each_target_names_its_platforms_and_a_spec_takes_their_device_prefix():
    for name in targets.names():
        tgt = targets.get(name)
        assert tgt.platforms, name
        for platform in tgt.platforms:
            assert inventories.make(name, platform=platform).gpu_device_prefix == platform.gpu_device_prefix


def test_gpu_and_nccl_flags_come_from_the_platforms():
    """A target states no GPU or NCCL flag of its own: its platforms (cluster/platform.py) say it."""
    for name in targets.names():
        tgt = targets.get(name)
        assert "real_gpus" not in vars(type(tgt)) and "nccl_efa" not in vars(type(tgt)), name
        assert tgt.real_gpus == all(p.real_gpus for p in tgt.platforms), name
    assert targets.get("aws").nccl_efa and not targets.get("local").nccl_efa and not targets.get("boot").nccl_efa
