"""The stack's availability zone is kept like its images (infra/network.py): the program run twice
under the mocks, the engine's stash state carried over as a later `pulumi up` would, once with
nothing set (the zone stays where the first up put it, whatever the first zone offering the types is
now) and once following docs/FAULTS.md's advice for InsufficientInstanceCapacity
(`pulumi config set slurm-gpu:availabilityZone ZONE`: the cluster moves, each subnet deleted before
its same-CIDR replacement is made). Resource options are read from the engine's own
RegisterResource requests."""

from __future__ import annotations

import logging

from tests.support.pulumi_mocks import ClusterMocks, Run, run_program, stack_config

FIRST = "ap-northeast-2b"  # the first zone offering g6.48xlarge (and c6i.xlarge) under the mocks
NOW_FIRST = "ap-northeast-2a"  # ... and g6.12xlarge: where a recomputed zone would move


def _later_up(first: Run, config: dict) -> Run:
    return run_program(config, ClusterMocks(stashed=first.mocks.stashed))


def _zones(run: Run) -> dict[str, str]:
    return {s.name: s.inputs["availabilityZone"] for s in run.of_type("subnet")}


def test_the_zone_stays_put_when_the_first_zone_changes():
    """A new GPU type (or a zone AWS adds for it) makes another zone the first: nothing moves."""
    first = run_program(stack_config(gpuInstanceType="g6.48xlarge"))
    assert set(_zones(first).values()) == {FIRST}
    later = _later_up(first, stack_config(gpuInstanceType="g6.12xlarge"))
    # The look-up did pick the other zone now (not a vacuous pass) ...
    (zone_stash,) = [s for s in later.of_type("stash") if s.name.endswith("-zone")]
    assert zone_stash.inputs["input"] == NOW_FIRST
    # ... yet the subnets are declared in the stack's zone, and told to keep it.
    assert set(_zones(later).values()) == {FIRST}
    for subnet in later.of_type("subnet"):
        assert "availabilityZone" in subnet.ignore_changes, subnet.name
    assert later.outputs["gpuTypeZones"]["zone"] == FIRST


def test_faults_advice_moves_the_cluster_and_the_move_can_succeed():
    """`pulumi config set slurm-gpu:availabilityZone ZONE` moves both subnets; the replacements
    reuse the CIDRs, so each old subnet goes first (else EC2: InvalidSubnet.Conflict), and so does
    everything it cascades to (NAT gateway, interfaces, instances: fixed addresses)."""
    first = run_program(stack_config())
    moved = _later_up(first, stack_config(availabilityZone="ap-northeast-2c"))
    assert set(_zones(moved).values()) == {"ap-northeast-2c"}
    assert not [s for s in moved.of_type("stash") if s.name.endswith("-zone")]
    subnets = moved.of_type("subnet")
    assert len(subnets) == 2
    for subnet in subnets:
        assert subnet.delete_before_replace, subnet.name
        assert "availabilityZone" not in subnet.ignore_changes, subnet.name
    # What a subnet replacement replaces (subnet_id / interfaces ForceNew) also goes first.
    for typ in ("nat", "eni", "instance"):
        for res in moved.of_type(typ):
            assert res.delete_before_replace, res.name
    # A cluster placement group lies in one zone: a new one comes with the new GPU subnet.
    (gpu_subnet,) = [s for s in subnets if "-gpu-" in s.name]
    assert moved.one("pg").replace_with == (gpu_subnet.urn,)
    assert moved.outputs["gpuTypeZones"]["zone"] == "ap-northeast-2c"
    # The new zone is kept from then on.
    again = _later_up(moved, stack_config(availabilityZone="ap-northeast-2c"))
    assert set(_zones(again).values()) == {"ap-northeast-2c"}


def test_a_new_gpu_type_not_offered_in_the_kept_zone_is_warned_about_with_the_fix(caplog):
    """The zone stays put, so a GPU type its zone does not offer cannot launch there: say how to move."""
    first = run_program(stack_config(gpuInstanceType="g6.48xlarge"))
    with caplog.at_level(logging.WARNING):
        later = _later_up(first, stack_config(gpuInstanceType="p5.48xlarge"))  # only ap-northeast-2c
    assert set(_zones(later).values()) == {FIRST}
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"slurm-gpu:gpuInstanceType p5.48xlarge is not offered in this stack's zone {FIRST}" in warned
    assert "`pulumi config set slurm-gpu:availabilityZone ZONE`" in warned
