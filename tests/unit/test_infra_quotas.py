"""The plan-time vCPU quota check: a stack the account's EC2 On-Demand quotas cannot hold is
refused before any resource is declared, with the request command; an unreadable quota is
reported and the stack goes on; the account's other running instances count, the stack's own
do not count twice.

Needs are written out from AWS's figures: g6.12xlarge 48 vCPUs, p5.48xlarge 192, c6i.xlarge 4.
"""

from __future__ import annotations

import logging

import pytest

from infra.config import PlanError
from infra.quotas import QUOTA_GROUPS, family, quota_group
from tests.support.pulumi_mocks import REGION, ClusterMocks, Running, run_program, stack_config

G, P, STANDARD = "L-DB2E81BA", "L-417A185B", "L-1216C47A"
QUOTA_CALL = "aws:servicequotas/getServiceQuota:getServiceQuota"
OURS = "slurm-gpu/test"  # the stack's name under the mocks (project/stack)


def request(code: str, value: int) -> str:
    return (f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
            f"--desired-value {value} --region {REGION}")


def refused(mocks: ClusterMocks, **config) -> str:
    with pytest.raises(PlanError) as info:
        run_program(stack_config(**config), mocks)
    assert mocks.components == [] and mocks.resources == []  # refused before anything is declared
    return str(info.value)


def test_gpu_quota_below_the_need_is_refused_with_the_request_command():
    # A new account's G and VT quota: 64 vCPUs; two g6.12xlarge need 96.
    msg = refused(ClusterMocks(quotas={G: 64.0}))
    assert '"Running On-Demand G and VT instances" (L-DB2E81BA)' in msg
    assert "2 GPU nodes (2 x g6.12xlarge, 48 vCPUs each) need 96 vCPUs" in msg
    assert "the quota is 64" in msg
    assert request(G, 96) in msg
    assert "slurm-gpu:gpuNodeCount" in msg and "slurm-gpu:gpuInstanceType" in msg


def test_p_quota_and_the_controllers_standard_quota():
    msg = refused(ClusterMocks(quotas={P: 191.0}), gpuInstanceType="p5.48xlarge", gpuNodeCount=1)
    assert '"Running On-Demand P instances" (L-417A185B)' in msg and request(P, 192) in msg
    msg = refused(ClusterMocks(quotas={STANDARD: 2.0}))
    assert '"Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances" (L-1216C47A)' in msg
    assert "the controller (1 x c6i.xlarge, 4 vCPUs each) needs 4 vCPUs" in msg
    assert request(STANDARD, 4) in msg and "slurm-gpu:controllerInstanceType" in msg


def test_enough_quota_goes_on_and_only_on_demand_quotas_are_read():
    mocks = ClusterMocks(quotas={G: 96.0, STANDARD: 4.0})  # exactly the need
    run = run_program(stack_config(), mocks)
    assert len(run.of_type("instance")) == 3
    read = sorted(a["quotaCode"] for t, a in mocks.calls if t == QUOTA_CALL)
    assert read == sorted([G, STANDARD])  # the spot quotas (L-3819A6DF...) are not checked yet


def test_unreadable_quota_is_reported_and_the_stack_goes_on(caplog):
    denied = ("getting Default Service Quota for (ec2/L-DB2E81BA): operation error Service Quotas: "
              "GetAWSDefaultServiceQuota, AccessDeniedException: User: arn:aws:iam::111122223333:"
              "user/deployer is not authorized to perform: servicequotas:GetAWSDefaultServiceQuota")
    mocks = ClusterMocks(quotas={G: denied})
    with caplog.at_level(logging.WARNING):
        run = run_program(stack_config(), mocks)
    assert len(run.of_type("instance")) == 3
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "could not read the EC2 quota" in warned and "(L-DB2E81BA)" in warned
    assert "AccessDeniedException" in warned and "servicequotas:GetServiceQuota" in warned


def test_other_running_instances_of_the_family_count():
    running = [
        Running("i-0a1", "g4dn.xlarge"),  # 4 vCPUs of G and VT
        Running("i-0a2", "g4dn.xlarge", {"Cluster": "prod", "slurm-gpu:stack": "acme/slurm-gpu/prod"}),  # 4
        Running("i-0a3", "g6.48xlarge", state="stopped"),  # a stopped instance counts for nothing
        Running("i-0a4", "p5.48xlarge"),  # another quota
        Running("i-0a5", "c6i.xlarge"),
    ]
    msg = refused(ClusterMocks(quotas={G: 100.0}, running=running))
    assert "other instances of this account already run 8 vCPUs against it: 104 in all" in msg
    assert request(G, 104) in msg
    # With room for both, it goes on.
    run = run_program(stack_config(), ClusterMocks(quotas={G: 104.0}, running=running))
    assert len(run.of_type("instance")) == 3


def test_the_stacks_own_instances_are_not_counted_twice():
    """A later `pulumi up`: the stack's running nodes are in its need already, whether they carry
    the stack tag or (made before it) only the cluster's tag."""
    own = [
        Running("i-0b1", "g6.12xlarge", {"Cluster": "mini", "slurm-gpu:stack": OURS}),
        Running("i-0b2", "g6.12xlarge", {"Cluster": "mini"}),
        Running("i-0b3", "c6i.xlarge", {"Cluster": "mini", "slurm-gpu:stack": OURS}),
    ]
    run = run_program(stack_config(), ClusterMocks(quotas={G: 96.0, STANDARD: 4.0}, running=own))
    assert len(run.of_type("instance")) == 3
    # Another stack's instances are not ours.
    other = [Running("i-0b4", "g6.12xlarge", {"Cluster": "dev", "slurm-gpu:stack": "slurm-gpu/dev"})]
    msg = refused(ClusterMocks(quotas={G: 96.0}, running=other))
    assert "already run 48 vCPUs" in msg and request(G, 144) in msg


def test_quota_groups_as_data_with_their_spot_quotas():
    """Every family a GPU node can be (G, P: NVIDIA and x86_64) and the Standard families, each with
    its On-Demand and Spot quota codes."""
    expect = {
        "g6.12xlarge": (G, "L-3819A6DF"), "gr6.4xlarge": (G, "L-3819A6DF"), "g4dn.xlarge": (G, "L-3819A6DF"),
        # The Spot quotas split P by generation: P5 has its own, P6 none yet (using-spot-limits.html).
        "p5.48xlarge": (P, "L-C4BD4855"), "p5en.48xlarge": (P, "L-C4BD4855"), "p6-b200.48xlarge": (P, None),
        "p4d.24xlarge": (P, "L-7212CCBC"), "p3.2xlarge": (P, "L-7212CCBC"), "c6i.xlarge": (STANDARD, "L-34B43A08"),
        "t3.large": (STANDARD, "L-34B43A08"), "m7i-flex.large": (STANDARD, "L-34B43A08"),
    }
    for itype, codes in expect.items():
        group = quota_group(itype)
        spot = group and group.spot_quota(itype)
        assert group and (group.on_demand.code, spot.quota.code if spot else None) == codes, itype
    # Families with quotas of their own are not mistaken for Standard ones (d*, h*, i*, t*).
    for itype in ("dl1.24xlarge", "hpc7a.96xlarge", "inf2.xlarge", "trn1.32xlarge", "x2idn.16xlarge"):
        assert quota_group(itype) is None, itype
    assert family("u-6tb1.metal") == "u"
    codes = [q.code for g in QUOTA_GROUPS for q in (g.on_demand, *(s.quota for s in g.spot))]
    assert len(set(codes)) == len(codes)


def test_spot_and_capacity_block_instances_do_not_count():
    """Only On-Demand instances count against an On-Demand quota: spot ones are under the Spot
    quotas, Capacity Block ones under the block's own limit (infra/quotas.py)."""
    running = [
        Running("i-0c1", "g6.12xlarge", lifecycle="spot"),
        Running("i-0c2", "g6.48xlarge", lifecycle="capacity-block"),
        Running("i-0c3", "g4dn.xlarge"),  # On-Demand: 4 vCPUs
    ]
    msg = refused(ClusterMocks(quotas={G: 96.0}, running=running))
    assert "other instances of this account already run 4 vCPUs against it: 100 in all" in msg
    run = run_program(stack_config(), ClusterMocks(quotas={G: 100.0}, running=running))
    assert len(run.of_type("instance")) == 3


def test_a_later_up_that_adds_no_vcpus_warns_instead_of_refusing(caplog):
    """Another team filled the quota after the stack was made: a `pulumi up` that adds nothing goes on
    with a warning (its own nodes count in any state: a stopped one starts again); growth is refused."""
    own = [
        Running("i-0d1", "g6.12xlarge", {"Cluster": "mini", "slurm-gpu:stack": OURS}),
        Running("i-0d2", "g6.12xlarge", {"Cluster": "mini"}, state="stopped"),  # power saving stopped it
        Running("i-0d3", "c6i.xlarge", {"Cluster": "mini", "slurm-gpu:stack": OURS}),
    ]
    team = [Running("i-0d4", "g6.12xlarge", {"Cluster": "their-cluster"})]
    mocks = ClusterMocks(quotas={G: 96.0, STANDARD: 4.0}, running=own + team)
    with caplog.at_level(logging.WARNING):
        run = run_program(stack_config(), mocks)
    assert len(run.of_type("instance")) == 3
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "starting every node would exceed the quota" in warned and "(L-DB2E81BA)" in warned
    assert "already run 48 vCPUs against it, 144 in all" in warned and request(G, 144) in warned
    # One more node: growth beyond what the stack has is refused.
    msg = refused(ClusterMocks(quotas={G: 96.0}, running=own + team), gpuNodeCount=3)
    assert "3 GPU nodes (3 x g6.12xlarge, 48 vCPUs each) need 144 vCPUs" in msg and request(G, 192) in msg


def test_a_quota_without_a_value_is_reported_and_a_zero_quota_refuses(caplog):
    with caplog.at_level(logging.WARNING):
        run = run_program(stack_config(), ClusterMocks(quotas={G: None}))
    assert len(run.of_type("instance")) == 3
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert 'could not read the EC2 quota "Running On-Demand G and VT instances" (L-DB2E81BA): ' \
           "Service Quotas answered without a value" in warned
    msg = refused(ClusterMocks(quotas={G: 0.0}))
    assert "the quota is 0." in msg and request(G, 96) in msg


def test_a_stack_moved_to_another_organization_is_not_refused_by_its_own_instances():
    """After `pulumi stack rename neworg/slurm-gpu/test` (or a move between the DIY backend, whose
    organization is "organization", and Pulumi Cloud) the stack's instances still carry the old stack tag
    until this up retags them: the same project/stack is this stack."""
    moved = [Running("i-0e1", "g6.12xlarge", {"Cluster": "mini", "Role": "gpu",
                                               "slurm-gpu:stack": f"oldorg/{OURS}"}, state="stopped")]
    assert len(run_program(stack_config(), ClusterMocks(running=moved)).of_type("instance")) == 3
    # Renamed to another stack name: refused, naming how to give the instances this stack's tag.
    renamed = [Running("i-0e1", "g6.12xlarge", {"Cluster": "mini", "slurm-gpu:stack": "slurm-gpu/old-name"},
                       state="stopped")]
    msg = refused(ClusterMocks(running=renamed))
    assert f"`aws ec2 create-tags --resources i-0e1 --tags Key=slurm-gpu:stack,Value={OURS}`" in msg


def test_im_and_is_families_are_standard():
    for itype in ("im4gn.large", "is4gen.medium", "i4i.xlarge"):
        group = quota_group(itype)
        assert group and group.on_demand.code == STANDARD, itype


def test_a_cluster_name_another_stack_uses_is_refused():
    """Two stacks of one account and region that keep the default clusterName "mini" would share the
    Cluster tag and host names: the second is refused before anything is declared, naming the stack."""
    theirs = [Running("i-0e1", "g6.12xlarge", {"Cluster": "mini", "slurm-gpu:stack": "slurm-gpu/dev"},
                      state="stopped")]
    msg = refused(ClusterMocks(running=theirs))
    assert msg.startswith("slurm-gpu:clusterName is 'mini', which stack slurm-gpu/dev already uses")
    assert "`pulumi config set slurm-gpu:clusterName mini-test`" in msg
    # Its own instances (a later `pulumi up`), untagged ones made before the stack tag, and another
    # name's are no conflict.
    fine = [Running("i-0e2", "g6.12xlarge", {"Cluster": "mini", "slurm-gpu:stack": OURS}),
            Running("i-0e3", "g6.12xlarge", {"Cluster": "mini"}),
            Running("i-0e4", "g6.12xlarge", {"Cluster": "other", "slurm-gpu:stack": "slurm-gpu/dev"})]
    assert len(run_program(stack_config(), ClusterMocks(running=fine)).of_type("instance")) == 3
    assert len(run_program(stack_config(clusterName="mini-test"), ClusterMocks(running=theirs)).of_type("instance")) == 3
