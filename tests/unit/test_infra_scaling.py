"""Scaling without touching what runs, on the Pulumi program under mocks.

The engine compares each resource's new inputs with the old ones: a resource whose inputs
are equal is left alone. So growing 2 -> 3 -> 2 GPU nodes must only add or remove the
third node's own resources, with every resource the runs share declared with exactly the
same inputs and options; and the same config twice must declare identical stacks (a
second `pulumi up` is a no-op). The one input that changes is the controller's user-data
(it holds the node list), which the program tells the engine to ignore: the node list
reaches the controller by `fab reconfigure`.
"""

from __future__ import annotations

import pytest

from tests.support.pulumi_mocks import TYPES, Run, run_program, stack_config

CONTROLLER = ("aws:ec2/instance:Instance", "mini-nodes-controller")


def _declared(run: Run) -> dict[tuple[str, str], tuple[dict, tuple, tuple, str]]:
    """(type, name) -> (inputs, ignore_changes, replace_on_changes, parent) of each resource."""
    out = {}
    for r in run.resources:
        key = (r.typ, r.name)
        assert key not in out, f"{key} declared twice"
        out[key] = (r.inputs, r.ignore_changes, r.replace_on_changes, r.parent)
    return out


def _node_resources(declared, node: str) -> set[tuple[str, str]]:
    return {k for k in declared if f"-{node}" in k[1]}


@pytest.fixture(scope="module", params=[{}, {"gpuInstanceType": "p5.48xlarge"}], ids=["g6.12xlarge", "p5.48xlarge"])
def runs(request):
    """The same stack at 2, 3 and again 2 GPU nodes, and at 2 once more."""
    cfg = request.param
    return [_declared(run_program(stack_config(gpuNodeCount=n, **cfg))) for n in (2, 3, 2, 2)]


def _changed(old: dict, new: dict) -> list[str]:
    """What differs between the resources two runs share (empty: the engine sees no change)."""
    diffs = []
    for key in sorted(set(old) & set(new)):
        (a_in, a_ign, a_rep, a_par), (b_in, b_ign, b_rep, b_par) = old[key], new[key]
        if key == CONTROLLER:
            # Its user-data holds the node list; its image is kept (infra/ami.py).
            assert a_ign == b_ign == ("userData", "userDataBase64", "ami")
            a_in = {k: v for k, v in a_in.items() if k != "userDataBase64"}
            b_in = {k: v for k, v in b_in.items() if k != "userDataBase64"}
        if (a_in, a_ign, a_rep, a_par) != (b_in, b_ign, b_rep, b_par):
            fields = sorted(k for k in set(a_in) | set(b_in) if a_in.get(k) != b_in.get(k))
            diffs.append(f"{key[1]}: {fields or 'options'}")
    return diffs


def test_growing_changes_no_existing_resource(runs):
    two, three, _, _ = runs
    assert _changed(two, three) == []
    added = set(three) - set(two)
    assert set(two) - set(three) == set()
    assert added == _node_resources(three, "gpu-node-03") and added
    # The new node: its instance and interfaces, nothing shared (no subnet, group, address).
    kinds = {typ for typ, _ in added}
    assert kinds == {TYPES["instance"], TYPES["eni"]}


def test_shrinking_removes_only_that_nodes_resources(runs):
    _, three, two_again, _ = runs
    assert _changed(three, two_again) == []
    assert set(two_again) <= set(three)
    assert set(three) - set(two_again) == _node_resources(three, "gpu-node-03")


def test_the_common_resources_cover_what_scaling_must_not_touch(runs):
    """The comparison above is not vacuous: the shared resources include every existing
    instance, network interface, address, subnet and placement group."""
    two, three, _, _ = runs
    shared = {typ for typ, _ in set(two) & set(three)}
    assert {TYPES[k] for k in ("instance", "eni", "eip", "subnet", "pg", "nat", "sg")} <= shared
    # And a change would be seen: the controller's user-data does differ.
    assert two[CONTROLLER][0]["userDataBase64"] != three[CONTROLLER][0]["userDataBase64"]


def test_the_same_config_twice_declares_the_same_stack(runs):
    two, _, two_again, once_more = runs
    assert two == two_again == once_more


def test_the_comparison_sees_a_changed_input(runs):
    two, _, _, _ = runs
    node = (TYPES["instance"], "mini-nodes-gpu-node-01")
    changed = dict(two)
    changed[node] = ({**two[node][0], "userDataBase64": "I2Nsb3VkLWNvbmZpZwo="}, *two[node][1:])
    assert _changed(two, changed) == ["mini-nodes-gpu-node-01: ['userDataBase64']"]
