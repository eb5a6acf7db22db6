"""How the GPU nodes are bought (slurm-gpu:gpuMarket): what each market sets on the instances,
and the plan-time check of a reservation.

- on-demand: nothing (EC2's default market).
- spot: `instance_market_options` market `spot` with a persistent request that stops on
  interruption. A spot instance can stop (on interruption, or when power saving stops it) only
  with a persistent request, and "while an interrupted Spot Instance is stopped, you are charged
  only for the EBS volumes, which are preserved" (EC2 User Guide, "Behavior of Spot Instance
  interruptions": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/interruption-behavior.html;
  pulumi_aws 7.x InstanceInstanceMarketOptionsSpotOptionsArgs: "Persistent Spot Instance requests
  are only supported when the instance interruption behavior is either hibernate or stop"). No
  maximum price: AWS advises against one (it only adds interruptions; EC2 API Reference,
  SpotMarketOptions.MaxPrice), and the price is then at most the On-Demand one. Such an instance
  cannot be in a placement group ("You can't launch a Spot Instance that is configured to stop or
  hibernate on interruption in a placement group": EC2 User Guide, "Placement group rules and
  limitations"), so spot GPU nodes are launched without the cluster's. The request has no end date:
  RunInstances' SpotMarketOptions.ValidUntil is "supported only for persistent requests ... For a
  persistent request, the request remains active until the ValidUntil date and time is reached.
  Otherwise, the request remains active until you cancel it" (EC2 API Reference, SpotMarketOptions:
  https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_SpotMarketOptions.html; the "7 days"
  default is documented for launch templates only, LaunchTemplateSpotMarketOptionsRequest). The stack
  cancels it before the node is deleted (infra/spot_guard.py).
- capacity-reservation (an On-Demand Capacity Reservation): `capacity_reservation_specification`
  targeting the id, market on-demand.
- capacity-block (Capacity Blocks for ML): market `capacity-block` and the same target (EC2 User
  Guide, "Launch instances using Capacity Blocks": run-instances --instance-market-options
  MarketType='capacity-block' --capacity-reservation-specification CapacityReservationTarget=...).
  Instances in a block may be stopped and started while it is active ("When you stop or terminate
  an instance in a Capacity Block, it takes several minutes to clean up ... the available capacity
  ... will update"). EC2 begins terminating them 30 minutes before the block's end time (EC2 User
  Guide, "Use Capacity Blocks": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-using.html).
Reservations place the nodes themselves: the stack's placement group is left off, unless the Capacity
Block reports one of its own, which the nodes then join.

A change of market replaces every GPU node, through the replacement_trigger option (market_key):
in terraform-provider-aws's aws_instance schema (internal/service/ec2/ec2_instance.go)
instance_market_options and placement_group are Optional+Computed+ForceNew and
capacity_reservation_specification is Optional+Computed, and a Computed block the program leaves
out shows no diff (terraform-provider-aws#38141, "Revert from spot doesn't work"): without the
trigger, spot -> capacity-reservation would keep the spot instances, and on-demand ->
capacity-reservation would keep them in the placement group the program deletes. infra/nodes.py
lists these inputs as deliberate config changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.settings import CAPACITY_BLOCK, CAPACITY_RESERVATION, NAMESPACE, SPOT
from cluster.stack_config import StackConfig
from infra.config import PlanError

# Capacity Block states in which instances can run now / later (EC2 API Reference,
# CapacityReservation.State: active, expired, cancelled, pending, failed, scheduled, payment-pending,
# payment-failed, assessing, delayed, unsupported).
RUNNABLE = "active"
LATER = ("scheduled", "payment-pending", "pending", "assessing", "delayed")
# EC2 starts terminating a Capacity Block's instances this long before its end time (capacity-blocks-using.html).
BLOCK_END_LEAD_MINUTES = 30
# The platform the GPU nodes' images run (the DLAMI: Linux/UNIX); a block reserved for another
# platform cannot take them (CapacityReservation.InstancePlatform).
LINUX_PLATFORM = "Linux/UNIX"
# Capacity Block nodes ignore changes to instance_market_options: the provider may read back no market
# options for an instance launched into a block, and the block is Optional+Computed+ForceNew in
# aws_instance's schema, so the declared market_type="capacity-block" would replace every block node on
# each `pulumi up` (hashicorp/terraform-provider-aws PR #48701, "perpetual diff"; whether the pulumi-aws
# 7.51.1 build carries that fix could not be read: docs/AWS.md, "What AWS answers"). A real market
# change still replaces the nodes: it goes by replacement_trigger (market_key), not by this input.
# Only while every GPU node of the stack is already a block one: on a replacement the engine keeps the
# old inputs of ignored properties (pulumi/pulumi#2657; infra/nodes.py), so a node moving into the
# block from another market must not ignore it, or it would launch with its old market options.
BLOCK_IGNORED = ("instanceMarketOptions",)


@dataclass(frozen=True)
class Reservation:
    """What the plan learnt of the reservation (None fields: not readable at plan time)."""
    id: str
    availability_zone: str | None = None
    placement_group: str | None = None  # the block's own cluster placement group, by name


def instance_args(cfg: StackConfig) -> dict:
    """The aws.ec2.Instance keyword arguments of the GPU nodes' market ({} for on-demand)."""
    target = None
    if cfg.capacity_reservation_id:
        target = aws.ec2.InstanceCapacityReservationSpecificationArgs(
            capacity_reservation_target=aws.ec2.InstanceCapacityReservationSpecificationCapacityReservationTargetArgs(
                capacity_reservation_id=cfg.capacity_reservation_id))
    if cfg.gpu_market == SPOT:
        return {"instance_market_options": aws.ec2.InstanceInstanceMarketOptionsArgs(
            market_type="spot",
            spot_options=aws.ec2.InstanceInstanceMarketOptionsSpotOptionsArgs(
                spot_instance_type="persistent", instance_interruption_behavior="stop")),
        }
    if cfg.gpu_market == CAPACITY_RESERVATION:
        return {"capacity_reservation_specification": target}
    if cfg.gpu_market == CAPACITY_BLOCK:
        return {"instance_market_options": aws.ec2.InstanceInstanceMarketOptionsArgs(market_type="capacity-block"),
                "capacity_reservation_specification": target}
    return {}


def ignored_on_update(cfg: StackConfig) -> list[str]:
    """GPU node inputs the market makes the engine ignore on update (BLOCK_IGNORED): for a Capacity
    Block stack none of whose GPU instances was launched in another market."""
    if cfg.gpu_market != CAPACITY_BLOCK or _nodes_outside_blocks():
        return []
    return list(BLOCK_IGNORED)


def _nodes_outside_blocks() -> bool:
    """Whether this stack has GPU instances (any state but terminated) outside a Capacity Block
    (DescribeInstances filter instance-lifecycle capacity-block: EC2 API Reference, DescribeInstances)."""
    from cluster.facts import STACK_TAG
    from infra.quotas import EXISTING, stack_name

    mine = [{"name": f"tag:{STACK_TAG}", "values": [stack_name()]}, {"name": "tag:Role", "values": ["gpu"]}]
    try:
        every = set(aws.ec2.get_instances(filters=mine, instance_state_names=EXISTING).ids or [])
        block = set(aws.ec2.get_instances(
            filters=[*mine, {"name": "instance-lifecycle", "values": ["capacity-block"]}],
            instance_state_names=EXISTING).ids or [])
    except Exception as exc:
        # Not ignoring is the safe side: at worst the preview shows a visible replacement of the block
        # nodes; ignoring could launch nodes moved into the block with their old market options.
        pulumi.log.warn(f"could not list this stack's GPU instances ({_first_line(exc)}); Capacity Block nodes "
                        "do not ignore their market options this time (infra/market.py BLOCK_IGNORED): "
                        "if the preview replaces them, cancel and run `pulumi up` again")
        return True
    return bool(every - block)


def market_key(cfg: StackConfig) -> str:
    """What replaces every GPU node when it changes (ResourceOptions.replacement_trigger): the market
    and the reservation (module docstring)."""
    return f"{cfg.gpu_market}|{cfg.capacity_reservation_id or ''}"


def uses_placement_group(cfg: StackConfig) -> bool:
    """Whether the GPU nodes join the stack's cluster placement group (module docstring)."""
    return cfg.gpu_market not in (SPOT, CAPACITY_RESERVATION, CAPACITY_BLOCK)


def check_reservation(cfg: StackConfig, *, own_nodes: int | None = None) -> Reservation | None:
    """Refuse a reservation whose AZ, instance type or free instances do not fit the stack; warn and
    go on where it cannot be read. `own_nodes`: GPU nodes of this stack that run in the block already
    (they hold places that its free count leaves out)."""
    if cfg.gpu_market not in (CAPACITY_RESERVATION, CAPACITY_BLOCK):
        return None
    rid = cfg.capacity_reservation_id
    assert rid is not None
    if cfg.gpu_market == CAPACITY_RESERVATION:
        # pulumi_aws 7.x has a data source for Capacity Blocks (aws.ec2.get_capacity_block_reservation,
        # which "returns only Capacity Reservations whose reservation_type is capacity-block") but none
        # for On-Demand Capacity Reservations: EC2 itself refuses a mismatch at launch.
        pulumi.log.warn(f"{NAMESPACE}:capacityReservationId {rid}: an On-Demand Capacity Reservation cannot be "
                        f"read at plan time; its instance type ({cfg.gpu_instance_type}), availability zone and "
                        f"{cfg.gpu_node_count} free instances are checked by EC2 when the nodes launch")
        return Reservation(rid, cfg.availability_zone)
    try:
        found = aws.ec2.get_capacity_block_reservation(id=rid)
    except Exception as exc:  # e.g. not authorised for ec2:DescribeCapacityReservations
        pulumi.log.warn(f"could not read the Capacity Block {rid} ({_first_line(exc)}); going on without "
                        "checking its zone, instance type and free instances (EC2 checks them at launch)")
        return Reservation(rid, cfg.availability_zone)
    fix = f"`pulumi config set {NAMESPACE}:capacityReservationId cr-...` (`aws ec2 describe-capacity-reservations`)"
    if found.instance_type and found.instance_type != cfg.gpu_instance_type:
        raise PlanError(
            f"{NAMESPACE}:capacityReservationId {rid} reserves {found.instance_type} but "
            f"{NAMESPACE}:gpuInstanceType is {cfg.gpu_instance_type}; set "
            f"`pulumi config set {NAMESPACE}:gpuInstanceType {found.instance_type}` or name another block: {fix}")
    zone = found.availability_zone
    if zone and cfg.availability_zone and zone != cfg.availability_zone:
        raise PlanError(
            f"{NAMESPACE}:capacityReservationId {rid} is in {zone} but {NAMESPACE}:availabilityZone is "
            f"{cfg.availability_zone} (an instance cannot launch into a Capacity Block of another zone); set "
            f"`pulumi config set {NAMESPACE}:availabilityZone {zone}` or remove it to follow the block")
    state = found.state or ""
    if state in LATER:
        raise PlanError(
            f"{NAMESPACE}:capacityReservationId {rid} is {state} (it starts {found.start_date}); instances can "
            f"launch into it only once it is active: run `pulumi up` then")
    if state and state != RUNNABLE:
        raise PlanError(f"{NAMESPACE}:capacityReservationId {rid} is {state}; no instance can launch into "
                          f"it: buy another block and {fix}")
    platform = getattr(found, "instance_platform", None)
    if platform and platform != LINUX_PLATFORM:
        raise PlanError(
            f"{NAMESPACE}:capacityReservationId {rid} is reserved for the {platform} platform but the GPU "
            f"nodes' image is {LINUX_PLATFORM} (an instance launches into a reservation only of its own "
            f"platform); name a {LINUX_PLATFORM} block: {fix}")
    free = found.available_instance_count
    if own_nodes is None:
        own_nodes = _own_nodes_in(rid)
    if free is not None and int(free) + own_nodes < cfg.gpu_node_count:
        raise PlanError(
            f"{NAMESPACE}:gpuNodeCount is {cfg.gpu_node_count} but Capacity Block {rid} has {int(free)} free "
            f"instance{'s' if free != 1 else ''} of {found.instance_count}"
            + (f" (and {own_nodes} of this stack's nodes run in it)" if own_nodes else "")
            + f"; lower it with `pulumi config set {NAMESPACE}:gpuNodeCount "
            f"{int(free) + own_nodes}` or use a larger block")
    pulumi.log.info(f"Capacity Block {rid}: {found.instance_type} in {zone}, ends {found.end_date} "
                    f"(EC2 begins terminating its instances {BLOCK_END_LEAD_MINUTES} minutes before then)")
    group = found.placement_group_arn.rsplit("/", 1)[-1] if found.placement_group_arn else None
    return Reservation(rid, zone, group)


def zones_offering(instance_type: str) -> list[str]:
    """The region's availability zones that offer the type (DescribeInstanceTypeOfferings): where to
    move the stack when its zone has no capacity. Exported as gpuTypeZones, so `pulumi preview`
    lists them (docs/FAULTS.md)."""
    found = aws.ec2.get_instance_type_offerings(
        location_type="availability-zone", filters=[{"name": "instance-type", "values": [instance_type]}])
    return sorted(set(found.locations or []))


def _own_nodes_in(rid: str) -> int:
    """This stack's GPU instances that hold a place in the reservation now: pending or running in it
    (DescribeInstances filter capacity-reservation-id). A stopped one has freed its place, which
    AvailableInstanceCount already counts; one outside the block (another market) holds none."""
    from cluster.facts import STACK_TAG
    from infra.quotas import RUNNING, stack_name

    try:
        return len(aws.ec2.get_instances(filters=[{"name": f"tag:{STACK_TAG}", "values": [stack_name()]},
                                                  {"name": "tag:Role", "values": ["gpu"]},
                                                  {"name": "capacity-reservation-id", "values": [rid]}],
                                         instance_state_names=RUNNING).ids or [])
    except Exception:
        return 0


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
