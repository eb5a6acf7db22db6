"""EC2's vCPU quotas, checked at plan time, before anything is declared.

EC2 counts the vCPUs of running On-Demand instances against one quota per group of instance
families, per account and region (EC2 User Guide, "On-Demand Instance limits":
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-on-demand-instances.html), and RunInstances
fails with VcpuLimitExceeded beyond it. Found only then, the failure comes after the VPC, the NAT
gateway and its Elastic IP exist and bill; new accounts often have 0 to 64 vCPUs of G and VT,
less than two g6.12xlarge need. So the program reads each quota the stack draws on and what the
account's other instances already run against it, and refuses a stack that does not fit, with
the command that asks for more. A quota it cannot read (the deployer may lack the Service Quotas
permissions) is reported and not checked: the check only moves a failure forward.

Which instances are the stack's own (already counted in its need, so not again as "others" on a
later `pulumi up`): those tagged STACK_TAG with this stack's name; instances made before that tag
existed are recognised by their Cluster tag. A later `pulumi up` is refused only for growth: when
the stack's own instances (in any state: stopped ones start again) already cover its need, a full
quota is a warning, not a refusal (the instances exist; another team's may have filled the quota).

Only On-Demand instances count against an On-Demand quota: spot instances are under the Spot
quotas. Instances in a Capacity Block for ML are paid for by the block, under its own instance
limit (EC2 User Guide, "Capacity Blocks for ML": up to 64 instances a block, 256 across blocks);
whether EC2 also counts them against the On-Demand vCPU quota is not said in the EC2 User Guide pages
on Capacity Blocks or On-Demand Instance quotas that we could read (docs/AWS.md, "What AWS answers"),
so they are left out: counting ones that do not count would refuse a stack that fits, while leaving
out ones that do only moves the failure (VcpuLimitExceeded) to launch time. Both are left out
(DescribeInstances filter instance-lifecycle: spot | scheduled | capacity-block; EC2 API Reference,
DescribeInstances). So with slurm-gpu:gpuMarket spot the GPU nodes are checked
against their Spot quota ("All G and VT Spot Instance Requests", "All P5 Spot Instance Requests" ...:
EC2 User Guide, "Spot Instance quotas", https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/using-spot-limits.html),
counting the account's other running spot instances; with capacity-block they are not checked (the
block holds them); an On-Demand Capacity Reservation's instances are On-Demand ones and count as such.
The stack's own instances count only under their own market's quota: after a change of
slurm-gpu:gpuMarket the old nodes are under the other one until they are replaced. Leaving out one that
did count only moves a failure back to launch time; counting one that does not would refuse a stack
that fits.

The check counts running (and pending) instances only. A Spot quota also counts the vCPUs of open
spot requests not yet fulfilled, and of requests whose instances were terminated until EC2 closes
them (using-spot-limits.html): those are not listed here, so a launch may still fail with
MaxSpotInstanceCountExceeded where the check passed.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.facts import STACK_TAG
from cluster.settings import CAPACITY_BLOCK, NAMESPACE, SPOT
from cluster.stack_config import StackConfig
from infra.config import PlanError

SERVICE_CODE = "ec2"
# STACK_TAG (cluster/facts.py): on each instance, the Pulumi stack that owns it (stack_name()).
RUNNING = ["pending", "running"]  # what counts against a vCPU quota (pending: about to run)
EXISTING = [*RUNNING, "stopping", "stopped"]  # the stack's own instances: what it already has
# Instance lifecycles outside the On-Demand quotas (above); an On-Demand instance has none.
NOT_ON_DEMAND = ["spot", "capacity-block"]
# At most this many instances of the account are looked up one by one (the API lists ids, not
# types) per quota: each is a call at every preview.
MAX_LOOKUPS = 64


@dataclass(frozen=True)
class Quota:
    name: str  # as Service Quotas names it
    code: str  # its quota code under service code "ec2"


@dataclass(frozen=True)
class SpotQuota:
    quota: Quota
    generations: tuple[str, ...] = ()  # type prefixes it covers ("p5"); (): all of its group's families

    def covers(self, instance_type: str) -> bool:
        return not self.generations or generation(instance_type) in self.generations

    def patterns(self, group: QuotaGroup) -> list[str]:
        """DescribeInstances instance-type wildcards of what it covers."""
        return [f"{p}*" for p in sorted(self.generations or group.families)]


@dataclass(frozen=True)
class QuotaGroup:
    """Instance families that share one On-Demand vCPU quota, and their Spot quotas."""
    families: frozenset[str]  # an instance type's family: the letters before its generation
    on_demand: Quota
    spot: tuple[SpotQuota, ...]  # what spot GPU nodes (slurm-gpu:gpuMarket spot) count against

    def spot_quota(self, instance_type: str) -> SpotQuota | None:
        """The Spot quota of the type (None: a generation no quota here names, e.g. p6)."""
        return next((q for q in self.spot if q.covers(instance_type)), None)


# Every group a GPU node or the controller can fall in: a GPU node's type must have NVIDIA GPUs
# and be x86_64 (infra/instance_types.py), and every such EC2 type is G or P; the controller
# is usually a Standard type. Names: EC2 User Guide, "On-Demand Instance quotas" and "Spot
# Instance quotas" (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/using-spot-limits.html);
# codes: Service Quotas for ec2 (`aws service-quotas list-service-quotas --service-code ec2`;
# console.aws.amazon.com/servicequotas/home/services/ec2/quotas/<code>). A family in no group
# here (DL, F, Inf, Trn, X, U, HPC) is reported and not checked.
# The Spot quotas split P by generation ("All P4, P3 and P2 Spot Instance Requests", "All P5 Spot
# Instance Requests"), the On-Demand one does not ("Running On-Demand P instances"); a P generation
# neither Spot quota names (P6) is reported and not checked.
QUOTA_GROUPS = (
    QuotaGroup(frozenset({"g", "gr", "vt"}),
               Quota("Running On-Demand G and VT instances", "L-DB2E81BA"),
               (SpotQuota(Quota("All G and VT Spot Instance Requests", "L-3819A6DF")),)),
    QuotaGroup(frozenset({"p"}),
               Quota("Running On-Demand P instances", "L-417A185B"),
               (SpotQuota(Quota("All P4, P3 and P2 Spot Instance Requests", "L-7212CCBC"), ("p2", "p3", "p4")),
                SpotQuota(Quota("All P5 Spot Instance Requests", "L-C4BD4855"), ("p5",)))),
    # "im", "is": im4gn, is4gen (I family, storage optimised).
    QuotaGroup(frozenset({"a", "c", "d", "h", "i", "im", "is", "m", "r", "t", "z"}),
               Quota("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "L-1216C47A"),
               (SpotQuota(Quota("All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", "L-34B43A08")),)),
)


class QuotaError(PlanError):
    """The stack needs more vCPUs than a quota allows."""


def family(instance_type: str) -> str:
    """g6e.12xlarge -> g, gr6.4xlarge -> gr, p6-b200.48xlarge -> p, hpc7a.96xlarge -> hpc."""
    match = re.match(r"[a-z]+", instance_type)
    return match.group(0) if match else instance_type


def generation(instance_type: str) -> str:
    """p5en.48xlarge -> p5, p4d.24xlarge -> p4, p6-b200.48xlarge -> p6."""
    match = re.match(r"[a-z]+\d*", instance_type)
    return match.group(0) if match else instance_type


def quota_group(instance_type: str) -> QuotaGroup | None:
    fam = family(instance_type)
    return next((g for g in QUOTA_GROUPS if fam in g.families), None)


def stack_name() -> str:
    """organization/project/stack (without the organization where the engine names none)."""
    return "/".join(p for p in (pulumi.get_organization(), pulumi.get_project(), pulumi.get_stack()) if p)


def request_command(quota: Quota, desired: int, region: str | None) -> str:
    where = f" --region {region}" if region else ""
    return (f"aws service-quotas request-service-quota-increase --service-code {SERVICE_CODE} "
            f"--quota-code {quota.code} --desired-value {desired}{where}")


@dataclass(frozen=True)
class Need:
    what: str  # "2 GPU nodes" / "the controller"
    instance_type: str
    count: int
    vcpus: int  # per instance
    settings: tuple[str, ...]  # what lowers it
    spot: bool = False  # bought on the spot market: the group's Spot quota

    @property
    def total(self) -> int:
        return self.count * self.vcpus

    def describe(self) -> str:
        return f"{self.what} ({self.count} x {self.instance_type}, {self.vcpus} vCPUs each)"


def check_vcpu_quotas(cfg: StackConfig, *, gpu_vcpus: int, controller_vcpus: int,
                      region: str | None) -> None:
    """Refuse (QuotaError) a stack whose instances the account's On-Demand vCPU quotas cannot
    hold, counting the account's other running instances of the same quota."""
    spot = cfg.gpu_market == SPOT
    needs = [
        Need(f"{cfg.gpu_node_count} {'spot ' if spot else ''}GPU node{'s' if cfg.gpu_node_count > 1 else ''}",
             cfg.gpu_instance_type, cfg.gpu_node_count, gpu_vcpus,
             ("gpuNodeCount", "gpuInstanceType", *(("gpuMarket",) if spot else ())), spot=spot),
        Need("the controller", cfg.controller_instance_type, 1, controller_vcpus, ("controllerInstanceType",)),
    ]
    if cfg.gpu_market == CAPACITY_BLOCK:
        needs = needs[1:]  # under the block's own limit (module docstring)
    by_quota: dict[tuple[QuotaGroup, SpotQuota | None], list[Need]] = {}
    for need in needs:
        group = quota_group(need.instance_type)
        spot_quota = group.spot_quota(need.instance_type) if group and need.spot else None
        if group is None or (need.spot and spot_quota is None):
            pulumi.log.warn(f"{need.what}: {need.instance_type} is in no instance family whose "
                            f"{'Spot ' if need.spot else ''}vCPU quota this program knows; its quota is not checked")
            continue
        by_quota.setdefault((group, spot_quota), []).append(need)
    for (group, spot_quota), group_needs in by_quota.items():
        _check(group, group_needs, cluster_name=cfg.cluster_name, region=region, spot=spot_quota)


def _check(group: QuotaGroup, needs: list[Need], *, cluster_name: str, region: str | None,
           spot: SpotQuota | None = None) -> None:
    quota = spot.quota if spot else group.on_demand
    need = sum(n.total for n in needs)
    try:
        found = aws.servicequotas.get_service_quota(service_code=SERVICE_CODE, quota_code=quota.code)
        value = None if found.value is None else float(found.value)
        problem = "Service Quotas answered without a value" if value is None else ""
    except Exception as exc:  # e.g. AccessDeniedException: the deployer may not read quotas
        problem = _first_line(exc)
    if problem:
        pulumi.log.warn(
            f"could not read the EC2 quota \"{quota.name}\" ({quota.code}): {problem}. "
            f"Its check needs servicequotas:GetServiceQuota and servicequotas:GetAWSDefaultServiceQuota; "
            f"going on without it (if the quota is below the {need} vCPUs the stack needs, launching "
            f"the instances fails with VcpuLimitExceeded once the network exists)")
        return
    usage = _usage(group, cluster_name, quota, spot=spot)
    others = usage.others
    if need + others <= value:
        return
    total = need + others
    parts = " and ".join(n.describe() for n in needs)
    verb = "need" if len(needs) > 1 or needs[0].count > 1 else "needs"
    running = (f", and other instances of this account already run {others} vCPUs against it"
               if others else "")
    name = found.quota_name or quota.name
    where = f" in {region}" if region else ""
    command = request_command(quota, math.ceil(total), region)
    if usage.own_count >= sum(n.count for n in needs) and usage.own_vcpus >= need:
        # The stack has these instances already: this `pulumi up` adds no vCPUs to refuse.
        pulumi.log.warn(
            f"starting every node would exceed the quota \"{name}\" ({quota.code}){where}: {parts} "
            f"{verb} {need} vCPUs{running}, {total} in all, but the quota is {value:g}. The stack has "
            f"these instances already, so this update goes on; a stopped node that power saving starts "
            f"fails with VcpuLimitExceeded until others stop or the quota is raised: `{command}`")
        return
    settings = ", ".join(f"{NAMESPACE}:{s}" for n in needs for s in n.settings)
    raise QuotaError(
        f"{parts} {verb} {need} vCPUs of the EC2 quota \"{name}\" "
        f"({quota.code}){where}{running}: {total} in all, but the quota "
        f"is {value:g}. Nothing was created. Ask AWS to raise it (approval can take a day or more): "
        f"`{command}`; or need fewer vCPUs ({settings})"
    )


@dataclass
class Usage:
    others: int = 0  # vCPUs of the account's other running On-Demand instances in the group
    own_count: int = 0  # the stack's own instances in the group, in any state but terminated
    own_vcpus: int = 0


def _ids(filters: list[dict], states: list[str]) -> list[str]:
    return aws.ec2.get_instances(filters=filters, instance_state_names=states).ids or []


def _usage(group: QuotaGroup, cluster_name: str, quota: Quota, *, spot: SpotQuota | None = None) -> Usage:
    """What the account runs against this quota besides the stack (On-Demand, or spot, pending and
    running), and what the stack itself already has under it: its own instances of the quota's
    market only (a market change leaves the old nodes under another quota until they are replaced)."""
    patterns = spot.patterns(group) if spot else [f"{f}*" for f in sorted(group.families)]
    types = {"name": "instance-type", "values": patterns}  # wildcards
    me = stack_name()
    try:
        # Spot ones (the Spot quota), or those outside the On-Demand quota (module docstring).
        marked = set(_ids([types, {"name": "instance-lifecycle", "values": ["spot"] if spot else NOT_ON_DEMAND}],
                          EXISTING))

        def of_market(ids: set[str]) -> set[str]:
            return ids & marked if spot else ids - marked

        running = of_market(set(_ids([types], RUNNING)))
        # The stack's own, in any state: by its stack tag, or (made before that tag) its cluster's.
        own = set(_ids([types, {"name": f"tag:{STACK_TAG}", "values": own_stack_tags()}], EXISTING))
        own |= set(_ids([types, {"name": "tag:Cluster", "values": [cluster_name]}], EXISTING))
        own = of_market(own)
    except Exception as exc:
        pulumi.log.warn(f"could not list the instances for the quota \"{quota.name}\" "
                        f"({_first_line(exc)}); only this stack's own vCPUs are counted against it")
        return Usage()
    ids = sorted(own) + sorted(running - own)
    if len(ids) > MAX_LOOKUPS:
        pulumi.log.warn(f"{len(ids)} instances run against the quota \"{quota.name}\"; "
                        f"the check counts the first {MAX_LOOKUPS} of them")
    vcpus_of: dict[str, int] = {}
    usage = Usage()
    for instance_id in ids[:MAX_LOOKUPS]:
        try:
            inst = aws.ec2.get_instance(instance_id=instance_id)
        except Exception:  # gone since it was listed
            continue
        # The wildcards match too much (d* matches dl1, t* trn1): keep the group's own families.
        if family(inst.instance_type) not in group.families or (spot and not spot.covers(inst.instance_type)):
            continue
        if inst.instance_type not in vcpus_of:
            vcpus_of[inst.instance_type] = int(aws.ec2.get_instance_type(
                instance_type=inst.instance_type).default_vcpus)
        vcpus = vcpus_of[inst.instance_type]
        if _ours(inst.tags or {}, me, cluster_name):
            usage.own_count += 1
            usage.own_vcpus += vcpus
        elif instance_id in running:
            usage.others += vcpus
    return usage


def own_stack_tags() -> list[str]:
    """The STACK_TAG values (DescribeInstances filter values, where `*` is a wildcard: EC2 API Reference,
    DescribeInstances, Filters) that are this stack's: its name, and its project/stack under any
    organization. A stack moved to another organization or backend (`pulumi stack rename org/...`, DIY's
    "organization" vs Pulumi Cloud's) keeps its instances' old tag until its next up retags them."""
    me = stack_name()
    tail = _project_stack(me)
    return sorted({me, tail, f"*/{tail}"})


def _project_stack(name: str) -> str:
    return "/".join(name.split("/")[-2:])


def _ours(tags: dict[str, str], me: str, cluster_name: str) -> bool:
    if STACK_TAG in tags:
        return _project_stack(tags[STACK_TAG]) == _project_stack(me)
    # Made before instances carried STACK_TAG: this cluster's, by the tag they have had since.
    return tags.get("Cluster") == cluster_name


def check_cluster_name_is_ours(cfg: StackConfig) -> None:
    """Refuse (PlanError) a cluster name that another live stack of this account and region uses.

    The power programs and the controller's role find the GPU nodes by their tags; the Cluster tag
    (slurm-gpu:clusterName, "mini" by default) is shared by every stack that keeps the default, so
    they also check STACK_TAG (infra/power_role.py, bootstrap/scripts/power-ec2.py.j2). Refusing
    the name as well keeps the two stacks' Name tags, host names and `fab` output apart. Another
    stack's instances: tagged Cluster=<name> and STACK_TAG of another value, in any state but
    terminated (DescribeInstances filters tag:<key> and tag-key, EC2 API Reference,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeInstances.html). Instances
    made before STACK_TAG existed carry no such tag and are not counted. A list that cannot be read
    is a warning: the check only moves a conflict forward."""
    me = stack_name()
    named = {"name": "tag:Cluster", "values": [cfg.cluster_name]}
    try:
        tagged = set(_ids([named, {"name": "tag-key", "values": [STACK_TAG]}], EXISTING))
        others = sorted(tagged - set(_ids([named, {"name": f"tag:{STACK_TAG}", "values": own_stack_tags()}],
                                          EXISTING)))
        owner = (aws.ec2.get_instance(instance_id=others[0]).tags or {}).get(STACK_TAG, "?") if others else ""
    except Exception as exc:
        pulumi.log.warn(f"could not list the instances of cluster name {cfg.cluster_name!r} "
                        f"({_first_line(exc)}); not checking that no other stack uses it")
        return
    if others:
        raise PlanError(
            f"{NAMESPACE}:clusterName is {cfg.cluster_name!r}, which stack {owner} already uses in this "
            f"account and region ({len(others)} instance(s), e.g. {others[0]}); two clusters of one name "
            f"would share host names and tags. Nothing was created. Pick another: "
            f"`pulumi config set {NAMESPACE}:clusterName {_suggest(cfg.cluster_name)}`; or, if {owner} is this "
            f"stack before a `pulumi stack rename`, give its instances this stack's tag: {_retag(others, me)}")


def _retag(ids: list[str], me: str) -> str:
    """The AWS CLI command that tags those instances as this stack's (ids as EC2 answered, checked)."""
    safe = [i for i in ids if re.fullmatch(r"i-[0-9a-f]{1,40}", i)]
    return (f"`aws ec2 create-tags --resources {' '.join(safe) or 'INSTANCE_IDS'} "
            f"--tags {shlex.quote(f'Key={STACK_TAG},Value={me}')}`")


def _suggest(name: str) -> str:
    """A cluster name of this stack's own that config.py accepts: NAME-STACK, cut to 32 characters."""
    stack = re.sub(r"[^a-z0-9-]+", "-", (pulumi.get_stack() or "2").lower())
    return f"{name}-{stack}"[:32].strip("-")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
