"""What a stack has cost so far at list prices (`fab status`): instances, volumes, the NAT gateway.

Read from EC2 (boto3, with the AWS credentials `pulumi` uses, in the stack's region) and from the stack's
own record of its GPU nodes' stops and starts: the power programs' log on the controller
(bootstrap/scripts/power-ec2.py.j2 writes `TIME slurm-gpu-suspend: i-... running -> stopping` and
`TIME slurm-gpu-resume: i-... stopped -> pending`).

The basis, and its error:
- An instance's life starts when its primary network interface (device index 0) was attached
  (DescribeInstances' NetworkInterfaces[].Attachment.AttachTime): it stays attached across stop and start,
  unlike LaunchTime, which is the last start (botocore's ec2 service model, Instance.LaunchTime: "to find
  the original launch time, see the attachment time for the primary network interface"), and unlike a
  root volume's AttachTime, which a replaced root volume resets. Without it: LaunchTime.
- Only the stack's own resources are counted: instances and the NAT gateway tagged slurm-gpu:stack with the
  stack's name (cluster/facts.py STACK_TAG; the Cluster tag is shared by every stack of a cluster name),
  volumes attached to those instances. What no longer exists (terminated instances, replaced volumes,
  deleted NAT gateways) is not counted: EC2 forgets it within the hour.
- DescribeInstances tells only the last state transition (LaunchTime, StateTransitionReason), so the
  stops and starts before it come from the power log. EC2 bills `running` only (EC2 User Guide,
  "Instance state changes": pending, stopping and stopped are not billed,
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-lifecycle.html). A stop is logged when
  StopInstances answered `stopping` (exact to the second); a start when StartInstances answered
  `pending`, some tens of seconds before `running`: each start counts those seconds too (an over-count).
  EC2 charges at least 60 s per start (StopInstances' API reference); a node runs longer than that.
  A stop or start made outside the power programs (the console, a spot interruption) is not in the log:
  only EC2's last transition covers it, and the basis line says so.
- CloudTrail's Event history (90 days of management events, on by default) holds every
  StartInstances/StopInstances too, but needs cloudtrail:LookupEvents and is throttled; a trail that keeps
  them longer is not enabled by default. The power log needs nothing more than the controller.
- Volumes: size x the gp3 GB-month price x age since CreateTime (plus provisioned throughput and IOPS
  above gp3's baseline), https://aws.amazon.com/ebs/pricing/.
- NAT gateway: hours since CreateTime, each partial hour billed as a full one
  (https://aws.amazon.com/vpc/pricing/); the GB it processed are not known here (CloudWatch's
  BytesOutToDestination would tell; not read).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cluster import aws_session
from cluster.facts import STACK_TAG
from ops.cost import estimate as est

# One state change the power programs logged: bootstrap/scripts/power-ec2.py.j2 act(): log(f"{id} {prev} -> {cur}").
_EVENT = re.compile(r"^(?P<t>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) slurm-gpu-(?:suspend|resume): "
                    r"(?P<id>i-[0-9a-f]+) (?P<prev>[a-z-]+) -> (?P<cur>[a-z-]+)$")
# DescribeInstances' StateTransitionReason of a stop, e.g. "User initiated (2026-12-07 03:00:00 GMT)".
_TRANSITION = re.compile(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) GMT\)")
STOPPED = ("stopping", "stopped")


@dataclass
class Item:
    what: str
    usd: float
    basis: str = ""


@dataclass
class Spend:
    since: datetime | None
    items: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(i.usd for i in self.items)


def power_events(log_text: str) -> dict[str, list[tuple[datetime, str]]]:
    """instance id -> [(when, "stop" | "start")] from the power log, oldest first; other lines are skipped."""
    out: dict[str, list[tuple[datetime, str]]] = {}
    for line in log_text.splitlines():
        m = _EVENT.match(line.strip())
        if not m or m["cur"] not in ("stopping", "pending"):
            continue
        when = datetime.strptime(m["t"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        out.setdefault(m["id"], []).append((when, "stop" if m["cur"] == "stopping" else "start"))
    return {i: sorted(ev) for i, ev in out.items()}


def transition_time(reason: str) -> datetime | None:
    m = _TRANSITION.search(reason or "")
    return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC) if m else None


def running_seconds(first: datetime, now: datetime, events: list[tuple[datetime, str]], state: str,
                    last_start: datetime | None, transition: datetime | None) -> tuple[float, str]:
    """(seconds the instance ran since `first`, how that was found). `events`: its power-log stops and
    starts; `state`, `last_start` (LaunchTime) and `transition` (StateTransitionReason's time): EC2's now."""
    total, since, running = 0.0, first, True
    for when, kind in events:
        if when < first:
            continue
        if kind == "stop" and running:
            total += (when - since).total_seconds()
            running = False
        elif kind == "start" and not running:
            since, running = when, True
    basis = f"{len(events)} stop/start(s) in the power log" if events else "no stop in the power log"
    if running and state in STOPPED:  # stopped outside the power programs: EC2's last transition
        stop = transition if transition and transition >= since else since
        total += (stop - since).total_seconds()
        running = False
        basis += "; stopped outside it (EC2's StateTransitionReason" + (")" if transition else ": no time, 0 s)")
    elif not running and state not in STOPPED:  # started outside them: EC2's LaunchTime
        since = last_start if last_start and last_start >= since else since
        running = True
        basis += "; started outside it (EC2's LaunchTime)"
    if running:
        total += max(0.0, (now - since).total_seconds())
    return total, basis


def _tag(resource: dict, key: str) -> str:
    return next((t["Value"] for t in resource.get("Tags", []) if t["Key"] == key), "")


def first_start(inst: dict) -> datetime:
    """When the instance was first launched: its primary interface's attach time (module doc)."""
    for eni in inst.get("NetworkInterfaces", []):
        attachment = eni.get("Attachment") or {}
        if attachment.get("DeviceIndex") == 0 and attachment.get("AttachTime"):
            return attachment["AttachTime"]
    return inst["LaunchTime"]


def so_far(ec2, stack: str, region: str, power_log: str | None, now: datetime | None = None) -> Spend:
    """The spend at list prices (ops/data/prices.json) of the resources tagged STACK_TAG `stack` (the
    stack's organization/project/stack) from EC2's answers (an EC2 client: boto3's, or one under botocore's
    Stubber) and the power log's text (None: not readable)."""
    now = now or datetime.now(UTC)
    p = est.prices(region)
    events = power_events(power_log or "")
    spend = Spend(since=None)
    tagged = [{"Name": f"tag:{STACK_TAG}", "Values": [stack]}]
    alive = {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}
    ids = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=[*tagged, alive]):
        for inst in (i for r in page["Reservations"] for i in r["Instances"]):
            ids.append(inst["InstanceId"])
            first = first_start(inst)
            spend.since = min(spend.since or first, first)
            secs, basis = running_seconds(first, now, events.get(inst["InstanceId"], []), inst["State"]["Name"],
                                          inst.get("LaunchTime"),
                                          transition_time(inst.get("StateTransitionReason", "")))
            itype, name = inst["InstanceType"], _tag(inst, "Name") or inst["InstanceId"]
            try:
                rate = est.price_per_h(region, itype)
            except est.EstimateError:
                spend.notes.append(f"{name}: no list price for {itype} in ops/data/prices.json; not counted")
                continue
            spot = " (spot: billed at the spot price, below this)" if inst.get("InstanceLifecycle") == "spot" else ""
            spend.items.append(Item(f"{name} {itype}: {secs / 3600:.2f} h running at ${rate}/h{spot}",
                                    rate * secs / 3600, basis))
    if ids:
        for page in ec2.get_paginator("describe_volumes").paginate(
                Filters=[{"Name": "attachment.instance-id", "Values": ids}]):
            for vol in page["Volumes"]:
                spend.items.append(_volume(vol, p, now))
    for page in ec2.get_paginator("describe_nat_gateways").paginate(Filter=tagged):
        for nat in page["NatGateways"]:
            if nat.get("State") in ("deleted", "failed"):
                continue
            hours = math.ceil((now - nat["CreateTime"]).total_seconds() / 3600)
            spend.since = min(spend.since or nat["CreateTime"], nat["CreateTime"])
            spend.items.append(Item(f"NAT gateway {nat['NatGatewayId']}: {hours} h at ${p['nat_per_h']}/h "
                                    f"(+ ${p['nat_per_gb']}/GB processed: not known here)", hours * p["nat_per_h"],
                                    "CreateTime; partial hours billed whole"))
    return spend


def _volume(vol: dict, p: dict, now: datetime) -> Item:
    age = (now - vol["CreateTime"]).total_seconds()
    name = _tag(vol, "Name") or vol["VolumeId"]
    if vol.get("VolumeType") != "gp3":
        return Item(f"volume {name} ({vol.get('VolumeType')}, {vol['Size']} GB): not priced (gp3 only)", 0.0)
    throughput, iops_total = vol.get("Throughput") or est.GP3_BASE_MBPS, vol.get("Iops") or est.GP3_BASE_IOPS
    usd = est.gp3_per_month(p, vol["Size"], throughput, iops_total) * age / est.MONTH_S
    mbps, iops = max(0.0, throughput - est.GP3_BASE_MBPS), max(0, iops_total - est.GP3_BASE_IOPS)
    extra = (f" +{mbps:.0f} MB/s" if mbps else "") + (f" +{iops} IOPS" if iops else "")
    return Item(f"volume {name} gp3 {vol['Size']} GB{extra} for {age / 86400:.2f} d", usd, "CreateTime")


# Where the real bill differs from these list prices.
DIFFERS = ("credits and the free tier, Savings Plans and Reserved Instances lower it",
           "spot nodes pay the spot price, not the list price counted here",
           "data transfer is not counted: NAT gateway GB, traffic out to the internet",
           "public IPv4 addresses (the controller's, the NAT gateway's) bill per hour and are not counted",
           "the account's own EBS key, snapshots and taxes are not counted",
           "what no longer exists is not counted: terminated or replaced instances, replaced volumes, "
           "deleted NAT gateways (EC2 lists them for an hour at most)")


BASIS = ("the resources tagged with this stack that exist now; instances from their primary network interface's "
         "attach time, less the stops the power log shows (a start counts from `pending`, tens of seconds before "
         "EC2 bills `running`); volumes and the NAT gateway from CreateTime")


def lines(spend: Spend) -> list[str]:
    since = f" since {spend.since:%Y-%m-%d %H:%M} UTC" if spend.since else ""
    out = [f"  spent so far{since}: ${spend.total:.2f} at list prices (ops/data/prices.json)",
           f"    basis: {BASIS}"]
    for i in spend.items:
        out.append(f"    {'$' + format(i.usd, '.2f'):>9}  {i.what}" + (f" [{i.basis}]" if i.basis else ""))
    out += [f"    note: {n}" for n in spend.notes]
    out.append("    the real bill differs:")
    out += [f"      - {d}" for d in DIFFERS]
    return out


def ec2_client(region: str, profile: str | None = None):
    """EC2 in the stack's region with the credentials `pulumi` uses for it (aws:profile, else the AWS SDK's
    chain): cluster/aws_session.py, as infra/spot_guard.py."""
    return aws_session.ec2_client(region, profile)
