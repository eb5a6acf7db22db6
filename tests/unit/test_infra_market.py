"""slurm-gpu:gpuMarket: each market renders the GPU instances it needs (and on-demand none of it),
the controller stays On-Demand, bad combinations are refused naming the setting, a Capacity Block is
checked at plan time, spot nodes are checked against the Spot quota, and the power role and the
policy pack stay as scoped as before.

AWS facts relied on are cited in infra/market.py.
"""

from __future__ import annotations

import functools
import json
import logging

import pytest

import tests.support.pulumi_mocks as harness
from cluster.stack_config import ConfigError, StackConfig
from tests.support.pulumi_mocks import (
    ADMIN_CIDR,
    SSH_KEY,
    ClusterMocks,
    Running,
    capacity_block_result,
    run_program,
    stack_config,
    user_data_of,
)

CR = "cr-0123456789abcdef0"
CB = "cr-0fedcba9876543210"
MARKET_KEYS = ("instanceMarketOptions", "capacityReservationSpecification")


def parse(**overrides) -> StackConfig:
    raw = {"adminCidr": ADMIN_CIDR, "sshPublicKey": SSH_KEY, **overrides}
    return StackConfig.from_mapping({k: v for k, v in raw.items() if v is not None})


def gpu_and_controller(run):
    instances = run.of_type("instance")
    gpu = [i for i in instances if i.inputs["tags"]["Role"] == "gpu"]
    ctl = [i for i in instances if i.inputs["tags"]["Role"] == "controller"]
    assert len(ctl) == 1 and gpu
    return gpu, ctl[0]


def blocks(**kw) -> ClusterMocks:
    return ClusterMocks(capacity_blocks={CB: capacity_block_result(CB, **kw)})


# ------------------------------------------------------------------ config

def test_market_defaults_to_on_demand_and_parses_each_market():
    assert parse().gpu_market == "on-demand" and parse().capacity_reservation_id is None
    assert parse(gpuMarket="spot").gpu_market == "spot"
    cfg = parse(gpuMarket="capacity-reservation", capacityReservationId=CR, availabilityZone="ap-northeast-2a")
    assert (cfg.gpu_market, cfg.capacity_reservation_id) == ("capacity-reservation", CR)
    assert parse(gpuMarket="capacity-block", capacityReservationId=CB).gpu_market == "capacity-block"


def test_bad_market_settings_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"slurm-gpu:gpuMarket is 'reserved'; it must be one of on-demand, "
                                          r"spot, capacity-reservation, capacity-block.*pulumi config set"):
        parse(gpuMarket="reserved")
    for market in ("capacity-reservation", "capacity-block"):
        with pytest.raises(ConfigError, match=rf"slurm-gpu:capacityReservationId is required when "
                                              rf"slurm-gpu:gpuMarket is {market}"):
            parse(gpuMarket=market)
    with pytest.raises(ConfigError, match=r"slurm-gpu:capacityReservationId \('cr-123'\) is not a capacity "
                                          r"reservation id"):
        parse(gpuMarket="capacity-block", capacityReservationId="cr-123")
    # An On-Demand Capacity Reservation cannot be read at plan time: the stack cannot follow its zone.
    with pytest.raises(ConfigError, match=r"slurm-gpu:availabilityZone is required when slurm-gpu:gpuMarket is "
                                          r"capacity-reservation.*pulumi config set slurm-gpu:availabilityZone"):
        parse(gpuMarket="capacity-reservation", capacityReservationId=CR)
    for market in ("on-demand", "spot"):
        with pytest.raises(ConfigError, match=rf"capacityReservationId is set but slurm-gpu:gpuMarket is {market}"
                                              r".*pulumi config rm slurm-gpu:capacityReservationId"):
            parse(gpuMarket=market, capacityReservationId=CR)


def test_reserved_capacity_keeps_idle_nodes_up_unless_told():
    """Reserved capacity bills whether it runs or not: power saving is off by default there, and on
    when the user sets it (instances in a reservation can stop and start)."""
    assert parse(gpuMarket="capacity-block", capacityReservationId=CB).idle_stop_minutes == 0
    assert parse(gpuMarket="capacity-reservation", capacityReservationId=CR,
                 availabilityZone="ap-northeast-2a").idle_stop_minutes == 0
    assert parse(gpuMarket="capacity-block", capacityReservationId=CB, idleStopMinutes="15").idle_stop_minutes == 15
    assert parse(gpuMarket="spot").idle_stop_minutes == 30


# ------------------------------------------------------------------ rendering

def test_spot_is_a_persistent_request_that_stops_and_has_no_placement_group():
    # On-demand (the default) renders none of the market inputs and keeps the placement group.
    run = run_program(stack_config(gpuMarket="on-demand"))
    gpu, ctl = gpu_and_controller(run)
    for inst in [*gpu, ctl]:
        assert not any(inst.inputs.get(k) for k in MARKET_KEYS), inst.name
    assert run.one("pg") and all(i.inputs["placementGroup"] for i in gpu)
    run = run_program(stack_config(gpuMarket="spot"))
    gpu, ctl = gpu_and_controller(run)
    for inst in gpu:
        assert inst.inputs["instanceMarketOptions"] == {
            "marketType": "spot",
            # No end date: RunInstances' persistent request stays active until cancelled
            # (SpotMarketOptions.ValidUntil); the stack cancels it (infra/spot_guard.py).
            "spotOptions": {"spotInstanceType": "persistent", "instanceInterruptionBehavior": "stop"},
        }
        assert "maxPrice" not in inst.inputs["instanceMarketOptions"]["spotOptions"]
        assert not inst.inputs.get("capacityReservationSpecification")
        # AWS refuses a stop-on-interruption spot instance in a placement group.
        assert not inst.inputs.get("placementGroup")
    assert run.of_type("pg") == []
    assert not any(ctl.inputs.get(k) for k in MARKET_KEYS)  # the controller stays On-Demand
    # Power saving stays on for spot: a stopped spot node pays only for its volume.
    assert run.of_type("role_policy")


def test_only_spot_gpu_nodes_boot_the_interruption_watcher():
    """The market reaches first boot: a spot stack's GPU nodes install and enable the watcher
    (bootstrap/spot_watch.py); on-demand nodes and the controller never carry it."""
    for market, want in (("on-demand", False), ("spot", True)):
        gpu, ctl = gpu_and_controller(run_program(stack_config(gpuMarket=market)))
        for inst in gpu:
            assert ("slurm-gpu-spot-watch" in user_data_of(inst)) is want, (market, inst.name)
        assert "slurm-gpu-spot-watch" not in user_data_of(ctl), market


def test_capacity_reservation_targets_the_id(caplog):
    with caplog.at_level(logging.WARNING):
        run = run_program(stack_config(gpuMarket="capacity-reservation", capacityReservationId=CR,
                                       availabilityZone="ap-northeast-2a"))
    gpu, ctl = gpu_and_controller(run)
    for inst in gpu:
        assert inst.inputs["capacityReservationSpecification"] == {
            "capacityReservationTarget": {"capacityReservationId": CR}}
        assert not inst.inputs.get("instanceMarketOptions") and not inst.inputs.get("placementGroup")
    assert not any(ctl.inputs.get(k) for k in MARKET_KEYS)
    assert run.of_type("role_policy") == []  # idle nodes stay up: no power role at all
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert f"capacityReservationId {CR}: an On-Demand Capacity Reservation cannot be read at plan time" in warned


def test_capacity_block_is_the_capacity_block_market_and_its_target():
    mocks = blocks(placement_group_arn=f"arn:aws:ec2:{harness.REGION}:{harness.ACCOUNT}:placement-group/ml-block")
    run = run_program(stack_config(gpuMarket="capacity-block", capacityReservationId=CB,
                                   gpuInstanceType="p5.48xlarge"), mocks)
    gpu, ctl = gpu_and_controller(run)
    for inst in gpu:
        assert inst.inputs["instanceMarketOptions"] == {"marketType": "capacity-block"}
        assert inst.inputs["capacityReservationSpecification"] == {
            "capacityReservationTarget": {"capacityReservationId": CB}}
        assert inst.inputs["placementGroup"] == "ml-block"  # the block's own group
    assert run.of_type("pg") == []
    assert not any(ctl.inputs.get(k) for k in MARKET_KEYS)
    # The stack follows the block's zone when it names none.
    assert {s.inputs["availabilityZone"] for s in run.of_type("subnet")} == {"ap-northeast-2c"}


def planned_changes(declared: dict, read_back: dict, ignored: tuple[str, ...]) -> set[str]:
    """The top-level inputs a `pulumi up` would find changed: declared here but read back otherwise by the
    provider, less those the engine ignores (ResourceOptions.ignore_changes)."""
    return {k for k, v in declared.items() if v and read_back.get(k) != v} - set(ignored)


def test_a_second_up_of_a_capacity_block_stack_plans_no_change_to_its_nodes():
    """The provider may read back no market options for a block instance (terraform-provider-aws PR
    #48701); instance_market_options is ForceNew, so a diff on it would replace every block node on each
    up. The mocks read back what that provider does; the block nodes ignore that input, and a market
    change still replaces them through replacement_trigger."""
    run = run_program(stack_config(gpuMarket="capacity-block", capacityReservationId=CB,
                                   gpuInstanceType="p5.48xlarge"), blocks())
    gpu, _ = gpu_and_controller(run)
    for inst in gpu:
        read_back = run.mocks.read_back[inst.name]
        assert read_back["instanceMarketOptions"] is None  # what the provider may read back
        assert "instanceMarketOptions" not in planned_changes(inst.inputs, read_back, inst.ignore_changes)
        assert inst.replacement_trigger == f"capacity-block|{CB}"
    # A second up: the stack's nodes now run in the block; still nothing planned.
    own = [Running(f"i-0e{n}", "p5.48xlarge", OWN_TAGS, lifecycle="capacity-block", reservation=CB) for n in (1, 2)]
    mocks = blocks()
    mocks.running = own
    run = run_program(stack_config(gpuMarket="capacity-block", capacityReservationId=CB,
                                   gpuInstanceType="p5.48xlarge"), mocks)
    for inst in gpu_and_controller(run)[0]:
        assert "instanceMarketOptions" in inst.ignore_changes
        assert "instanceMarketOptions" not in planned_changes(inst.inputs, run.mocks.read_back[inst.name],
                                                              inst.ignore_changes)
    # Moving on-demand nodes into the block: they are replaced (the trigger) and must launch with the
    # block's market, so the input is not ignored while any node is outside the block (the engine keeps
    # an ignored property's old input on a replacement).
    mocks = blocks()
    mocks.running = [Running(f"i-0d{n}", "p5.48xlarge", OWN_TAGS) for n in (1, 2)]
    run = run_program(stack_config(gpuMarket="capacity-block", capacityReservationId=CB,
                                   gpuInstanceType="p5.48xlarge"), mocks)
    for inst in gpu_and_controller(run)[0]:
        assert "instanceMarketOptions" not in inst.ignore_changes
        assert inst.inputs["instanceMarketOptions"] == {"marketType": "capacity-block"}
    # Spot nodes read their market back: nothing of it is ignored there.
    run = run_program(stack_config(gpuMarket="spot"))
    for inst in gpu_and_controller(run)[0]:
        assert "instanceMarketOptions" not in inst.ignore_changes
        assert planned_changes(inst.inputs, run.mocks.read_back[inst.name], inst.ignore_changes) == set()


def test_block_nodes_keep_their_market_options_when_the_stacks_instances_cannot_be_listed(caplog):
    """A failed list must not ignore the market options: nodes moved into the block would launch with their
    old ones. Not ignoring costs at most a visible replacement in the preview."""
    class Unlisted(ClusterMocks):
        def call(self, args):
            if args.token == "aws:ec2/getInstances:getInstances":
                return {}, [("filters", "UnauthorizedOperation: You are not authorized to perform this operation.")]
            return super().call(args)

    mocks = Unlisted(capacity_blocks={CB: capacity_block_result(CB)})
    with caplog.at_level(logging.WARNING):
        run = run_program(stack_config(gpuMarket="capacity-block", capacityReservationId=CB,
                                       gpuInstanceType="p5.48xlarge"), mocks)
    for inst in gpu_and_controller(run)[0]:
        assert "instanceMarketOptions" not in inst.ignore_changes
        assert inst.inputs["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert "do not ignore their market options" in caplog.text


@pytest.mark.parametrize("config,mocks", [
    ({"ebsKmsKeyId": harness.CMK}, {}),
    ({"idleStopMinutes": 0}, {"default_ebs_key": harness.CMK}),  # the account's default is the CMK
], ids=["named-key", "default-key"])
def test_spot_on_a_customer_managed_key_warns_with_the_spot_roles_grant(config, mocks, caplog):
    """EC2 restarts an interrupted spot instance through AWSServiceRoleForEC2Spot, which needs the key."""
    with caplog.at_level(logging.WARNING):
        run_program(stack_config(gpuMarket="spot", **config), ClusterMocks(**mocks))
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    role = f"arn:aws:iam::{harness.ACCOUNT}:role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"
    assert f"aws kms create-grant --region {harness.REGION} --key-id {harness.CMK} --grantee-principal {role}" in warned
    assert "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com" in warned
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # On-Demand nodes, or the AWS-managed key: no grant to make
        run_program(stack_config(**config), ClusterMocks(**mocks))
        run_program(stack_config(gpuMarket="spot"))
    assert "AWSServiceRoleForEC2Spot" not in caplog.text


# ------------------------------------------------------------------ changing market on a stack

@pytest.mark.parametrize("market", [
    {}, {"gpuMarket": "spot"}, {"gpuMarket": "capacity-reservation", "capacityReservationId": CR,
                                "availabilityZone": "ap-northeast-2a"},
    {"gpuMarket": "capacity-block", "capacityReservationId": CB, "gpuInstanceType": "p5.48xlarge"},
], ids=["on-demand", "spot", "odcr", "block"])
def test_a_market_change_replaces_every_gpu_node(market):
    """The provider shows no diff when a Computed market block or placement group is left out
    (terraform-provider-aws#38141): each GPU node carries a replacement_trigger of its market and
    reservation, deleted first (its fixed IP); the controller carries none."""
    run = run_program(stack_config(**market), blocks())
    gpu, ctl = gpu_and_controller(run)
    want = f"{market.get('gpuMarket', 'on-demand')}|{market.get('capacityReservationId', '')}"
    assert [(i.replacement_trigger, i.delete_before_replace) for i in gpu] == [(want, True)] * len(gpu)
    assert ctl.replacement_trigger is None


def test_the_trigger_differs_for_each_market_and_reservation():
    other = "cr-0aaaaaaaaaaaaaaaa"
    configs = [{}, {"gpuMarket": "spot"},
               {"gpuMarket": "capacity-reservation", "capacityReservationId": CR, "availabilityZone": "ap-northeast-2a"},
               {"gpuMarket": "capacity-reservation", "capacityReservationId": other,
                "availabilityZone": "ap-northeast-2a"}]
    triggers = {gpu_and_controller(run_program(stack_config(**c)))[0][0].replacement_trigger for c in configs}
    assert len(triggers) == len(configs)


# ------------------------------------------------------------------ plan-time checks of a block

def refused(mocks: ClusterMocks, **config) -> str:
    with pytest.raises(ConfigError) as info:
        run_program(stack_config(**config), mocks)
    assert mocks.resources == []  # refused before anything is declared
    return str(info.value)


P5_BLOCK = {"gpuMarket": "capacity-block", "capacityReservationId": CB, "gpuInstanceType": "p5.48xlarge"}


def test_a_block_of_another_type_zone_state_or_size_is_refused():
    msg = refused(blocks(instance_type="p4d.24xlarge"), **P5_BLOCK)
    assert f"capacityReservationId {CB} reserves p4d.24xlarge but slurm-gpu:gpuInstanceType is p5.48xlarge" in msg
    assert "pulumi config set slurm-gpu:gpuInstanceType p4d.24xlarge" in msg
    msg = refused(blocks(), **P5_BLOCK, availabilityZone="ap-northeast-2a")
    assert "is in ap-northeast-2c but slurm-gpu:availabilityZone is ap-northeast-2a" in msg
    msg = refused(blocks(available=1), **P5_BLOCK)
    assert "slurm-gpu:gpuNodeCount is 2 but Capacity Block" in msg and "has 1 free instance of 2" in msg
    assert "pulumi config set slurm-gpu:gpuNodeCount 1" in msg
    msg = refused(blocks(state="scheduled"), **P5_BLOCK)
    assert "is scheduled (it starts 2026-12-07T11:30:00Z)" in msg
    msg = refused(blocks(state="expired"), **P5_BLOCK)
    assert f"{CB} is expired; no instance can launch into it" in msg


OWN_TAGS = {"Cluster": "mini", "Role": "gpu", "slurm-gpu:stack": "slurm-gpu/test"}


def test_a_block_already_holding_the_stacks_nodes_is_not_short():
    own = [Running(f"i-0e{n}", "p5.48xlarge", OWN_TAGS, lifecycle="capacity-block", reservation=CB)
           for n in range(2)]
    mocks = ClusterMocks(capacity_blocks={CB: capacity_block_result(CB, available=0)}, running=own)
    run = run_program(stack_config(**P5_BLOCK), mocks)
    assert len(run.of_type("instance")) == 3


def test_own_nodes_that_hold_no_place_in_the_block_are_not_counted_as_free():
    """Stopped ones freed their place (AvailableInstanceCount counts it already), and nodes outside the
    block (another market, about to be replaced) hold none: only pending/running ones in it add."""
    stopped = [Running(f"i-0e{n}", "p5.48xlarge", OWN_TAGS, state="stopped", lifecycle="capacity-block",
                       reservation=CB) for n in range(2)]
    elsewhere = [Running(f"i-0d{n}", "p5.48xlarge", OWN_TAGS) for n in range(2)]
    for own in (stopped, elsewhere):
        msg = refused(ClusterMocks(capacity_blocks={CB: capacity_block_result(CB, available=0)}, running=own),
                      **P5_BLOCK)
        assert "has 0 free instances of 2; lower it" in msg


def test_a_block_of_another_platform_is_refused():
    block = {**capacity_block_result(CB), "instancePlatform": "Windows"}
    msg = refused(ClusterMocks(capacity_blocks={CB: block}), **P5_BLOCK)
    assert f"capacityReservationId {CB} is reserved for the Windows platform" in msg


def test_an_unreadable_block_is_reported_and_the_stack_goes_on(caplog):
    denied = "UnauthorizedOperation: You are not authorized to perform: ec2:DescribeCapacityReservations"
    with caplog.at_level(logging.WARNING):
        run = run_program(stack_config(**P5_BLOCK), ClusterMocks(capacity_blocks={CB: denied}))
    assert len(run.of_type("instance")) == 3
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"could not read the Capacity Block {CB}" in warned and "UnauthorizedOperation" in warned


# ------------------------------------------------------------------ quotas

QUOTA_CALL = "aws:servicequotas/getServiceQuota:getServiceQuota"


def test_spot_nodes_are_checked_against_the_spot_quota():
    running = [Running("i-0f1", "g4dn.xlarge", lifecycle="spot"),  # 4 spot vCPUs of G and VT
               Running("i-0f2", "g6.12xlarge")]  # On-Demand: not in the spot quota
    mocks = ClusterMocks(quotas={"L-3819A6DF": 96.0, "L-DB2E81BA": 0.0}, running=running)
    msg = refused(mocks, gpuMarket="spot")
    assert '"All G and VT Spot Instance Requests" (L-3819A6DF)' in msg
    assert "2 spot GPU nodes (2 x g6.12xlarge, 48 vCPUs each) need 96 vCPUs" in msg
    assert "already run 4 vCPUs against it: 100 in all" in msg
    assert "--quota-code L-3819A6DF --desired-value 100" in msg and "slurm-gpu:gpuMarket" in msg
    mocks = ClusterMocks(quotas={"L-3819A6DF": 100.0, "L-DB2E81BA": 0.0}, running=running)
    run = run_program(stack_config(gpuMarket="spot"), mocks)
    assert len(run.of_type("instance")) == 3
    read = sorted(a["quotaCode"] for t, a in mocks.calls if t == QUOTA_CALL)
    assert read == ["L-1216C47A", "L-3819A6DF"]  # the On-Demand G quota is not the spot nodes'


def test_p5_spot_nodes_are_checked_against_the_p5_spot_quota():
    """P5 has a Spot quota of its own, apart from P4, P3 and P2's (EC2 User Guide, using-spot-limits.html)."""
    p5 = {"gpuMarket": "spot", "gpuInstanceType": "p5.48xlarge"}
    msg = refused(ClusterMocks(quotas={"L-C4BD4855": 0.0}), **p5)
    assert '"All P5 Spot Instance Requests" (L-C4BD4855)' in msg and "--quota-code L-C4BD4855" in msg
    # A p4d spot instance of the account is under the other P Spot quota: it leaves the P5 one alone.
    other = [Running("i-0f3", "p4d.24xlarge", lifecycle="spot")]
    mocks = ClusterMocks(quotas={"L-C4BD4855": 384.0, "L-7212CCBC": 0.0}, running=other)
    run = run_program(stack_config(**p5), mocks)
    assert len(run.of_type("instance")) == 3
    assert sorted(a["quotaCode"] for t, a in mocks.calls if t == QUOTA_CALL) == ["L-1216C47A", "L-C4BD4855"]


@pytest.mark.parametrize("before,after,quota", [
    ("", {"gpuMarket": "spot"}, "L-3819A6DF"),  # on-demand -> spot: checked as new spot vCPUs
    ("spot", {}, "L-DB2E81BA"),  # spot -> on-demand: checked as new On-Demand vCPUs
], ids=["to-spot", "to-on-demand"])
def test_the_stacks_nodes_of_another_market_do_not_cover_the_new_one(before, after, quota):
    """A market change replaces every node: the stack's old ones, under the other market's quota, do not
    make it an update that adds no vCPUs."""
    own = [Running(f"i-0c{n}", "g6.12xlarge", {"Cluster": "mini", "Role": "gpu", "slurm-gpu:stack": "slurm-gpu/test"},
                   lifecycle=before) for n in range(2)]
    msg = refused(ClusterMocks(quotas={quota: 0.0}, running=own), **after)
    assert f"({quota})" in msg and "need 96 vCPUs" in msg


def test_capacity_block_nodes_are_not_checked_against_a_vcpu_quota():
    mocks = ClusterMocks(quotas={"L-417A185B": 0.0, "L-7212CCBC": 0.0},
                         capacity_blocks={CB: capacity_block_result(CB)})
    run = run_program(stack_config(**P5_BLOCK), mocks)
    assert len(run.of_type("instance")) == 3
    assert sorted(a["quotaCode"] for t, a in mocks.calls if t == QUOTA_CALL) == ["L-1216C47A"]


# ------------------------------------------------------------------ IAM and the policy pack

@pytest.mark.parametrize("config", [
    {"gpuMarket": "spot"},
    {"gpuMarket": "spot", "gpuInstanceType": "p5.48xlarge", "gpuNodeCount": 2},
    {"gpuMarket": "capacity-reservation", "capacityReservationId": CR, "availabilityZone": "ap-northeast-2a",
     "idleStopMinutes": 30},
    {**P5_BLOCK, "idleStopMinutes": 30},
], ids=["spot", "spot-p5", "odcr", "block"])
def test_each_market_passes_the_policy_pack_with_the_same_power_role(config, monkeypatch):
    """No market widens the power role: StartInstances/StopInstances on the cluster's tagged GPU nodes
    serves a persistent spot instance too (a stopped one's request reopens when it is started: EC2 User
    Guide, "Get the status of a Spot Instance request"), and the EFA placement-group rule allows the
    nodes AWS places."""
    from tests.unit import test_policy_pack as pack

    monkeypatch.setattr(harness, "ClusterMocks", functools.partial(
        ClusterMocks, capacity_blocks={CB: capacity_block_result(CB)}))
    stack = pack.declare(**config)
    assert pack.analyze(stack) == [] and pack.analyze_stack(stack) == []
    baseline = pack.declare()
    policy = [json.loads(r.inputs["policy"]) for r in stack if r.typ == pack.rules.IAM_ROLE_POLICY]
    assert policy == [json.loads(r.inputs["policy"]) for r in baseline if r.typ == pack.rules.IAM_ROLE_POLICY]
    # The rule still holds for an On-Demand EFA node outside the group.
    base = pack.declare()
    node = next(r for r in base if r.typ == pack.rules.INSTANCE and r.inputs["tags"]["Role"] == "gpu")
    for props in (node.inputs, node.outputs):
        props.pop("placementGroup")
    node.property_dependencies.pop("placementGroup", None)
    assert any("no placementGroup" in f.message for f in pack.analyze_stack(base))


def test_preview_lists_the_zones_that_offer_the_gpu_type():
    run = run_program(stack_config(gpuInstanceType="g6.48xlarge"))
    assert run.outputs["gpuTypeZones"] == {"instanceType": "g6.48xlarge", "zone": "ap-northeast-2b",
                                           "zones": ["ap-northeast-2b", "ap-northeast-2d"]}
