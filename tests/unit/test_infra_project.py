"""Pulumi.yaml, Pulumi.dev.yaml and __main__.py: the files `pulumi up` starts from."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import yaml

from cluster.settings import SETTINGS
from cluster.stack_config import ConfigError, StackConfig
from tests.support.pulumi_mocks import ADMIN_CIDR, REGION, SSH_KEY, ClusterMocks, RecordingMonitor

REPO = Path(__file__).resolve().parents[2]


def test_project_file():
    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    assert project["name"] == "slurm-gpu"
    assert project["runtime"]["name"] == "python"
    assert project["runtime"]["options"]["virtualenv"] == ".venv"


def test_an_engine_too_old_for_replacement_trigger_is_refused_before_anything_is_declared(monkeypatch):
    """An engine before 3.208.0 drops replacement_trigger (a market change would keep the old nodes) and
    Stash without a word: the CLI is told the range in Pulumi.yaml and the program asks the engine too."""
    from infra import program

    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    assert project["requiredPulumiVersion"] == f">={program.MIN_PULUMI_CLI}" == ">=3.208.0"

    class TooOld(Exception):
        pass

    def engine_check(rg):  # what the real engine answers when it is older than the range
        raise TooOld(f"Pulumi CLI version 3.207.0 does not satisfy the version range {rg!r}")

    monkeypatch.setattr(program.pulumi.runtime, "require_pulumi_version", engine_check)
    declared = []
    monkeypatch.setattr(program.stack_config, "load", lambda: declared.append("config read") or None)
    with pytest.raises(TooOld, match=">=3.208.0"):
        program.main()
    assert declared == []  # refused before the config is read or anything declared


def _dev_settings() -> dict:
    stack = yaml.safe_load((REPO / "Pulumi.dev.yaml").read_text())["config"]
    assert stack["aws:region"] == "ap-northeast-2"
    return {k.split(":", 1)[1]: v for k, v in stack.items() if k.startswith("slurm-gpu:")}


def test_dev_stack_is_the_seed_cluster_without_personal_settings():
    raw = _dev_settings()
    # The two personal settings are the user's to set; the stack file must not carry them.
    assert "adminCidr" not in raw and "sshPublicKey" not in raw
    assert set(raw) <= set(SETTINGS)
    with pytest.raises(ConfigError, match="slurm-gpu:adminCidr"):
        StackConfig.from_mapping(raw)
    cfg = StackConfig.from_mapping({**raw, "adminCidr": ADMIN_CIDR, "sshPublicKey": SSH_KEY})
    assert (cfg.gpu_node_count, cfg.gpu_instance_type, cfg.root_volume_gib) == (2, "g6.12xlarge", 200)
    assert (cfg.cluster_name, cfg.vpc_cidr, cfg.subnet_cidr, cfg.efa) == ("mini", "10.0.0.0/16", "10.0.1.0/24", True)
    text = (REPO / "Pulumi.dev.yaml").read_text()
    assert "pulumi config set slurm-gpu:adminCidr" in text and "pulumi config set slurm-gpu:sshPublicKey" in text


def test_main_entry_point_declares_the_stack():
    """`pulumi up` runs __main__.py: under mocks it must declare the cluster and export
    every output (config as the CLI passes it: strings, via the stack's settings)."""
    import pulumi

    mocks = ClusterMocks()
    pulumi.runtime.set_mocks(mocks, project="slurm-gpu", stack="dev", preview=False,
                             monitor=RecordingMonitor(mocks))
    config = {f"slurm-gpu:{k}": str(v).lower() if isinstance(v, bool) else str(v)
              for k, v in _dev_settings().items()}
    config.update({"aws:region": REGION, "slurm-gpu:adminCidr": ADMIN_CIDR, "slurm-gpu:sshPublicKey": SSH_KEY})
    pulumi.runtime.set_all_config(config)
    stack = pulumi.runtime.settings.get_root_resource()
    stack.outputs.clear()  # the root stack outlives set_mocks; start from no exports

    @pulumi.runtime.test
    def entry():
        runpy.run_path(str(REPO / "__main__.py"), run_name="__main__")

    entry()
    instances = mocks.of_type("aws:ec2/instance:Instance")
    assert sorted(i.inputs["tags"]["Name"] for i in instances) == ["mini-controller", "mini-gpu-node-01", "mini-gpu-node-02"]
    assert set(stack.outputs) >= {"controllerPublicIp", "nodes", "sshUser", "clusterName", "inventory"}
