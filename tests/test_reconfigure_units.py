"""`fab reconfigure`'s refusals that need no cluster (the real runs: test_reconfigure_cluster.py)."""

from __future__ import annotations

import dataclasses

import pytest

from bootstrap.facts import ClusterFacts, NodeShape, facts_to_dict, plan_hosts
from bootstrap.inventory import Inventory, Node
from ops import reconfigure


def _inventory(**kw) -> Inventory:
    ctl, gpus = plan_hosts("10.0.1.0/24", 2, "10.0.0.0/24")
    facts = ClusterFacts("mini", ctl, gpus, NodeShape(48, 184800, 4, "l4"), "10.0.1.0/24")
    inv = Inventory(target="aws", cluster_name="mini", ssh_user="ubuntu",
                    controller=Node("controller", ctl.ip, "controller", "198.51.100.1"),
                    gpu_nodes=tuple(Node(h.name, h.ip, "gpu") for h in gpus), gpus_per_node=4,
                    gpu_type="l4", nvlink=False, efa=True, python="/opt/slurm-gpu/venv/bin/python",
                    service_cmd="sudo systemctl {action} {service}", facts=facts_to_dict(facts))
    return dataclasses.replace(inv, **kw)


def test_facts_come_back_from_the_inventory():
    facts = reconfigure.facts_of(_inventory())
    assert [(h.name, h.ip) for h in facts.hosts] == [
        ("controller", "10.0.0.10"), ("gpu-node-01", "10.0.1.11"), ("gpu-node-02", "10.0.1.12")]


def test_an_inventory_without_facts_is_refused_with_the_fix():
    with pytest.raises(reconfigure.ReconfigureError, match=r"carries no cluster facts.*run `pulumi up`"):
        reconfigure.facts_of(_inventory(facts={}))
    broken = _inventory()
    broken = dataclasses.replace(broken, facts={k: v for k, v in broken.facts.items() if k != "shape"})
    with pytest.raises(reconfigure.ReconfigureError, match=r"cluster facts are malformed.*pulumi up"):
        reconfigure.facts_of(broken)


def test_inventory_json_round_trip_keeps_the_facts():
    inv = _inventory()
    import json
    assert Inventory.from_dict(json.loads(inv.to_json())) == inv
