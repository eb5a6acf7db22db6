"""`fab reconfigure`'s refusals that need no cluster (the real runs: test_reconfigure_cluster.py)."""

from __future__ import annotations

import pytest

from cluster.facts import ClusterFacts, NodeShape, plan_hosts
from cluster.inventory import Inventory, InventoryError
from cluster.spec import Access, AwsResources
from ops.actions import reconfigure
from ops.ssh import remote


def _inventory() -> Inventory:
    ctl, gpus = plan_hosts("10.0.1.0/24", 2, "10.0.0.0/24")
    facts = ClusterFacts("mini", ctl, gpus, NodeShape(48, 184800, 4, "l4"), "10.0.1.0/24", region="us-east-1")
    return Inventory(target="aws", facts=facts, aws=AwsResources(), access=Access(
        python="/opt/slurm-gpu/venv/bin/python", service_cmd="sudo systemctl {action} {service}",
        controller_public_ip="198.51.100.1"))


def test_facts_come_back_from_the_inventory():
    facts = reconfigure.facts_of(_inventory())
    assert [(h.name, h.ip) for h in facts.hosts] == [
        ("controller", "10.0.0.10"), ("gpu-node-01", "10.0.1.11"), ("gpu-node-02", "10.0.1.12")]


def test_an_inventory_without_facts_is_refused_with_the_fix():
    """Refused where it is read (cluster/spec.py), so `fab reconfigure` always has facts."""
    written = _inventory().to_dict()
    flat = {"target": "aws", "cluster_name": "mini", "python": "/p", "service_cmd": "x",
            "controller": {"name": "controller", "private_ip": "10.0.0.10", "role": "controller"}, "facts": {}}
    with pytest.raises(InventoryError, match=r"carries no cluster facts.*run `pulumi up`"):
        Inventory.from_dict(flat)
    del written["facts"]["shape"]
    with pytest.raises(InventoryError, match=r"cluster facts are malformed.*pulumi up"):
        Inventory.from_dict(written)


def test_inventory_json_round_trip_keeps_the_facts():
    inv = _inventory()
    import json
    assert Inventory.from_dict(json.loads(inv.to_json())) == inv


# ---------------------------------------------------------------- idleStopMinutes turned on later

def test_power_save_turned_on_later_installs_its_programs_with_slurm_conf():
    """The controller ignores user-data changes, so its power programs come with `fab reconfigure`
    (the same step that installs the slurm.conf naming them)."""
    from bootstrap import node_layout, render
    from tests.unit.test_power_save import EC2, facts

    off = reconfigure.controller_files(render.render_files(facts(None)))
    on = reconfigure.controller_files(render.render_files(facts(EC2)))
    assert not {node_layout.SUSPEND_PATH, node_layout.RESUME_PATH, node_layout.POWER_PATH} & set(off)
    assert "SuspendProgram" not in off[node_layout.SLURM_CONF]
    assert f"SuspendProgram={node_layout.SUSPEND_PATH}" in on[node_layout.SLURM_CONF]
    assert f"ResumeProgram={node_layout.RESUME_PATH}" in on[node_layout.SLURM_CONF]
    assert on[node_layout.POWER_PATH].startswith(f"#!{node_layout.POWER_VENV}/bin/python3") and "boto3" in on[node_layout.POWER_PATH]
    for path in (node_layout.SUSPEND_PATH, node_layout.RESUME_PATH, node_layout.POWER_PATH):
        assert node_layout.FILE_MODES[path] == 0o755
    for path in (node_layout.SUSPEND_PATH, node_layout.RESUME_PATH):
        assert f"exec {node_layout.POWER_VENV}/bin/python3 {node_layout.POWER_PATH} " in on[path], path


class _Here:
    """A Connection's put/run, carried out on this machine as root (what install_text needs of one)."""

    user = "root"

    def put(self, fileobj, remote):
        with open(remote, "wb") as f:
            f.write(fileobj.read())

    def run(self, cmd, **kwargs):
        import invoke

        return invoke.Context().run(cmd, **kwargs)


@pytest.mark.root
def test_install_text_writes_the_mode_it_is_given(tmp_path):
    import stat

    for name, mode in (("slurm-gpu-resume", 0o755), ("slurm.conf", 0o644)):
        path = tmp_path / "sbin" / name
        remote.install_text(_Here(), f"#!/bin/sh\necho {name}\n", str(path), mode)
        assert path.read_text() == f"#!/bin/sh\necho {name}\n"
        assert stat.S_IMODE(path.stat().st_mode) == mode and path.stat().st_uid == 0, (name, oct(path.stat().st_mode))
    # Rewritten in place (the local cluster bind-mounts some of these files): same inode.
    inode = path.stat().st_ino
    remote.install_text(_Here(), "changed\n", str(path))
    assert path.stat().st_ino == inode and path.read_text() == "changed\n"


@pytest.mark.root
def test_install_text_quotes_a_path_with_shell_characters(tmp_path):
    """The path goes inside `sh -c '...'`: quoted as a whole, a quote in it cannot end the string (issue 44)."""
    marker = tmp_path / "ran"
    path = tmp_path / f"a'; touch {marker}; echo '$(id)`id`" / "slurm.conf"
    remote.install_text(_Here(), "x\n", str(path))
    assert path.read_text() == "x\n" and not marker.exists()


class _Squeue:
    """The controller as check_removals sees it: squeue lists `listed` until scancel has run."""

    user = "root"

    def __init__(self, listed: str) -> None:
        self.listed, self.ran = listed, []

    def run(self, cmd, **kwargs):
        from types import SimpleNamespace

        self.ran.append(cmd)
        cancelled = any(c.startswith("scancel") for c in self.ran)
        return SimpleNamespace(ok=True, stdout="" if cancelled or not cmd.startswith("squeue") else self.listed)


def test_check_removals_cancels_only_job_ids_quoted():
    """squeue's output reaches scancel: only job ids (slurm.JOB_ID) and each quoted (issue 44)."""
    ctl = _Squeue("12\n13_[1-2]\n$(touch /tmp/x)\n;id\n`id`\n7_3\n")
    busy = reconfigure.check_removals(ctl, ["gpu-node-03"], force=True)
    assert busy == {"gpu-node-03": ["12", "13_[1-2]", "7_3"]}
    assert [c for c in ctl.ran if c.startswith("scancel")] == ["scancel 7_3 12 '13_[1-2]'"]
