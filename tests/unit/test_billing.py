"""What a stack still bills and what it has cost so far: the summary's last lines (the real summary code),
`fab status`'s money lines, EC2's answers through botocore's Stubber, the power log as the power
programs write it, and the mocked program's tags that the EC2 filters rely on."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from invoke import Context

import tests.support.pulumi_mocks as harness
from cluster.facts import STACK_TAG
from cluster.spec import AwsResources
from ops.actions import billing_status, nccl, options
from ops.actions import node_power as power
from ops.cost import estimate as est
from ops.cost import market_prices, spend, still_bills
from ops.finetune import pipeline, summary
from ops.ssh.remote import Cluster
from tests.support import inventories

REGION = "ap-northeast-2"
PRICES = json.loads((Path(est.DATA) / "prices.json").read_text())["regions"][REGION]
T0 = datetime(2026, 12, 1, tzinfo=UTC)
NOW = T0 + timedelta(hours=10)


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


def stamp(hours: float) -> str:
    return f"{at(hours):%Y-%m-%dT%H:%M:%SZ}"


# ---------------------------------------------------------------- the summary's last lines


def dev_plan() -> est.Estimate:
    """The estimate `fab train` makes for the repo's dev stack (2 x g6.12xlarge, c6i.xlarge, 200 GB, 30 min)."""
    return est.for_run(options.parse(target="aws", stack="dev", examples="256"), None)


def a_summary(closing: list[str]) -> summary.RunSummary:
    run = summary.RunSummary(job_id="12", slurm_runtime="00:05:00", metrics={"train_runtime": 280.0}, losses=[],
                             nccl=nccl.parse([]))
    run.closing = closing
    return run


def test_the_summary_ends_with_what_still_bills_per_hour_and_day_and_how_to_stop_it():
    plan = dev_plan()
    opts = options.parse(target="aws", stack="dev", examples="256")
    lines = a_summary(pipeline.closing_lines(opts, plan)).lines()
    ctl, gpu = PRICES["instance_per_h"]["c6i.xlarge"], PRICES["instance_per_h"]["g6.12xlarge"]
    gb_h = PRICES["gp3_per_gb_month"] / 730
    # The roots (200 GB each) and the shared /scratch's own volume (slurm-gpu:scratchSizeGiB's 100 GB).
    steady = ctl + PRICES["nat_per_h"] + 200 * gb_h + 100 * gb_h + 2 * 200 * gb_h
    idle = 2 * gpu
    assert lines[-2] == still_bills.IPV4_NOTE
    lines = lines[:-2] + lines[-1:]
    assert lines[-8] == (f"  still billing ${steady + idle:.3f}/h now, ${steady * 24 + idle * 0.5:.2f} over the next "
                         "24 h (list prices, ops/data/prices.json):")
    assert lines[-7] == f"    ${ctl:.3f}/h  controller c6i.xlarge (runs until the stack is destroyed)"
    assert lines[-6] == f"    ${PRICES['nat_per_h']:.3f}/h  NAT gateway (+ ${PRICES['nat_per_gb']}/GB it carries)"
    assert lines[-5] == f"    ${200 * gb_h:.3f}/h  controller: EBS gp3 200 GB at ${PRICES['gp3_per_gb_month']}/GB-month"
    assert lines[-4] == (f"    ${100 * gb_h:.3f}/h  controller: EBS gp3 /scratch volume 100 GB at "
                         f"${PRICES['gp3_per_gb_month']}/GB-month (kept while the stack lives, deleted by pulumi destroy)")
    assert lines[-3] == (f"    ${400 * gb_h:.3f}/h  2 GPU node(s) on: EBS gp3 400 GB at "
                         f"${PRICES['gp3_per_gb_month']}/GB-month")
    assert lines[-2] == (f"    ${idle:.3f}/h  2 GPU node(s) on, until power saving stops them 30 min after their "
                         f"last job (slurm-gpu:idleStopMinutes: ${idle * 0.5:.2f} once idle)")
    assert lines[-1].startswith("  stop it: `fab down --stack=dev` (pulumi destroy, once every finished run is home")


def test_with_down_the_summary_says_the_stack_comes_down_and_the_local_cluster_bills_nothing():
    down = options.parse(target="aws", stack="dev", examples="256", down=True)
    assert a_summary(pipeline.closing_lines(down, dev_plan())).lines()[-1] == (
        "  stack         --down: `pulumi destroy` once the adapters are home and verified")
    local = options.parse(target="local")
    assert pipeline.closing_lines(local, est.for_run(local, None)) == []


def test_stopped_nodes_bill_their_volumes_and_nodes_that_never_stop_bill_all_day():
    cl = dev_plan().cluster
    bill = still_bills.still_billing(cl, nodes_on=0, nodes_stopped=2, stack=None)
    assert bill.idle_per_h == 0 and bill.down_command == "fab down"
    assert bill.steady[-1].what.startswith("2 GPU node(s) stopped: a stopped node keeps its volume: EBS gp3 400 GB")
    never = still_bills.still_billing(cl.__class__(**{**cl.__dict__, "idle_stop_min": 0}), 2, 0, None)
    gpu = PRICES["instance_per_h"]["g6.12xlarge"]
    assert never.steady[-1].what == "2 x g6.12xlarge on (power saving is off: slurm-gpu:idleStopMinutes 0)"
    assert never.per_day == pytest.approx(24 * never.per_h) and never.per_h > 2 * gpu


def market(cl: est.PricedCluster, name: str, **more) -> est.PricedCluster:
    return dataclasses.replace(cl, market=name, **more)


def test_spot_nodes_that_are_on_bill_the_recorded_spot_range_not_on_demand():
    cl = market(dev_plan().cluster, "spot")
    spot = market_prices.spot_range(json.loads((Path(est.DATA) / "prices.json").read_text()), REGION, cl.gpu_type)
    bill = still_bills.still_billing(cl, nodes_on=2, nodes_stopped=0, stack="dev")
    assert bill.idle_per_h == pytest.approx(2 * spot.high)
    text = "\n".join(still_bills.lines(bill))
    assert f"spot: ${spot.low}-${spot.high}/h recorded across {REGION}'s zones ({spot.date}, not a quote)" in text


def test_a_capacity_reservation_bills_stopped_nodes_and_outlives_the_stack():
    cl = market(dev_plan().cluster, "capacity-reservation", reservation_id="cr-0123456789abcdef0", idle_stop_min=0)
    gpu = PRICES["instance_per_h"]["g6.12xlarge"]
    bill = still_bills.still_billing(cl, nodes_on=0, nodes_stopped=2, stack=None)
    reservation = [c for c in bill.steady if c.what.startswith("Capacity Reservation cr-0123456789abcdef0")]
    assert [c.usd for c in reservation] == [pytest.approx(2 * gpu)]
    assert "running or not, until it is cancelled (pulumi destroy does not;" in reservation[0].what
    after = still_bills.after_destroy("capacity-reservation", "cr-0123456789abcdef0")
    assert after[0].startswith("still billing: the On-Demand Capacity Reservation cr-0123456789abcdef0")
    assert "aws ec2 cancel-capacity-reservation --capacity-reservation-id cr-0123456789abcdef0" in after[0]
    assert "`fab spot-requests`" in after[-2] and after[-1].startswith("nothing else of this stack bills")
    block = still_bills.still_billing(market(cl, "capacity-block"), nodes_on=2, nodes_stopped=0, stack=None)
    assert block.idle_per_h == 0 and any("Capacity Block cr-0123456789abcdef0: paid up front" in n
                                         for n in block.notes)
    assert "was paid up front" in still_bills.after_destroy("capacity-block", "cr-0123456789abcdef0")[0]


# ---------------------------------------------------------------- spend so far: the power log and EC2


POWER_LOG = "\n".join([
    f"{stamp(2)} slurm-gpu-suspend: suspend gpu-node-01 (mini-gpu-node-01)",
    f"{stamp(2)} slurm-gpu-suspend: i-0a01 running -> stopping",
    f"{stamp(2)} slurm-gpu-suspend: suspend requested for i-0a01",
    f"{stamp(1)} slurm-gpu-suspend: i-0a02 running -> stopping",
    f"{stamp(5)} slurm-gpu-resume: i-0a01 stopped -> pending",
    f"{stamp(6)} slurm-gpu-suspend: i-0a01 running -> stopping",
    "garbage line; i-0a01 stopped -> pending",
])


STACK = "slurm-gpu/dev"  # the stack's STACK_TAG value (organization/project/stack)
BY_STACK = [{"Name": f"tag:{STACK_TAG}", "Values": [STACK]}]
ALIVE = {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}


def instance(iid: str, name: str, itype: str, state: str, launch: datetime, reason: str = "",
             lifecycle: str | None = None, root_attached: datetime = T0) -> dict:
    """As DescribeInstances answers: the primary interface attached at launch (T0), the root volume at
    `root_attached` (later when the root volume was replaced)."""
    inst = {"InstanceId": iid, "InstanceType": itype, "State": {"Name": state, "Code": 16}, "LaunchTime": launch,
            "RootDeviceName": "/dev/sda1", "StateTransitionReason": reason,
            "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"AttachTime": root_attached,
                                                                      "VolumeId": f"vol-{iid}", "Status": "attached"}}],
            "NetworkInterfaces": [{"NetworkInterfaceId": f"eni-{iid}", "Attachment": {
                "AttachTime": T0, "DeviceIndex": 0, "AttachmentId": f"eni-attach-{iid}", "Status": "attached"}}],
            "Tags": [{"Key": "Name", "Value": name}, {"Key": "Cluster", "Value": "mini"},
                     {"Key": STACK_TAG, "Value": STACK}]}
    if lifecycle:
        inst["InstanceLifecycle"] = lifecycle
    return inst


def stubbed_ec2():
    """EC2 of a stack made at T0: the controller ran throughout (its root volume replaced at T0+3h);
    gpu-node-01 was stopped and started by the power programs (in the log) and is stopped now; gpu-node-02
    was stopped by them and started by hand at T0+8h (not in the log: EC2's LaunchTime tells). The
    instances come in two pages (NextToken)."""
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(ec2)
    tagged = BY_STACK
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [
        instance("i-0c", "mini-controller", "c6i.xlarge", "running", T0, root_attached=at(3)),
        instance("i-0a01", "mini-gpu-node-01", "g6.12xlarge", "stopped", at(5),
                 f"User initiated ({at(6):%Y-%m-%d %H:%M:%S} GMT)")]}], "NextToken": "page-2"},
        {"Filters": [*tagged, ALIVE]})
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [
        instance("i-0a02", "mini-gpu-node-02", "g6.12xlarge", "running", at(8), lifecycle="spot"),
    ]}]}, {"Filters": [*tagged, ALIVE], "NextToken": "page-2"})
    vols = [{"VolumeId": f"vol-{i}", "Size": 200, "VolumeType": "gp3", "CreateTime": T0, "Iops": 3000,
             "Throughput": 125, "Tags": [{"Key": "Name", "Value": n}]}
            for i, n in (("i-0a01", "mini-gpu-node-01"), ("i-0a02", "mini-gpu-node-02"))]
    vols.append({"VolumeId": "vol-i-0c", "Size": 200, "VolumeType": "gp3", "CreateTime": T0, "Iops": 4000,
                 "Throughput": 500})
    stub.add_response("describe_volumes", {"Volumes": vols},
                      {"Filters": [{"Name": "attachment.instance-id", "Values": ["i-0c", "i-0a01", "i-0a02"]}]})
    stub.add_response("describe_nat_gateways", {"NatGateways": [
        {"NatGatewayId": "nat-0abc", "State": "available", "CreateTime": T0 - timedelta(minutes=30)},
        {"NatGatewayId": "nat-0old", "State": "deleted", "CreateTime": T0 - timedelta(days=3)}]},
        {"Filter": tagged})
    stub.activate()
    return ec2, stub


def test_running_time_comes_from_the_power_log_and_ec2s_last_transition():
    events = spend.power_events(POWER_LOG)
    assert events["i-0a01"] == [(at(2), "stop"), (at(5), "start"), (at(6), "stop")]
    secs, basis = spend.running_seconds(T0, NOW, events["i-0a01"], "stopped", at(5), at(6))
    assert secs == 3 * 3600 and basis == "3 stop/start(s) in the power log"
    secs, basis = spend.running_seconds(T0, NOW, events["i-0a02"], "running", at(8), None)
    assert secs == 3 * 3600 and basis.endswith("; started outside it (EC2's LaunchTime)")
    # Stopped by hand, never in the log: from creation to EC2's StateTransitionReason time.
    secs, basis = spend.running_seconds(T0, NOW, [], "stopped", T0, at(4))
    assert secs == 4 * 3600 and "stopped outside it" in basis


def test_spend_so_far_prices_instances_volumes_and_nat_hours_from_ec2():
    ec2, stub = stubbed_ec2()
    result = spend.so_far(ec2, STACK, REGION, POWER_LOG, now=NOW)
    stub.assert_no_pending_responses()
    p = PRICES
    gpu, ctl = p["instance_per_h"]["g6.12xlarge"], p["instance_per_h"]["c6i.xlarge"]
    months = 10 / 730
    volumes = 3 * 200 * p["gp3_per_gb_month"] * months + (500 - 125) * p["gp3_per_mbps_month"] * months \
        + (4000 - 3000) * p["gp3_per_iops_month"] * months
    nat = 11 * p["nat_per_h"]  # 10.5 h: partial hours bill whole
    assert result.total == pytest.approx(10 * ctl + 3 * gpu + 3 * gpu + volumes + nat)
    assert result.since == T0 - timedelta(minutes=30)
    text = "\n".join(spend.lines(result))
    assert text.startswith(f"  spent so far since 2026-11-30 23:30 UTC: ${result.total:.2f} at list prices")
    assert "mini-gpu-node-02 g6.12xlarge: 3.00 h running at $5.752/h (spot: billed at the spot price, below this)" \
        in text
    assert "NAT gateway nat-0abc: 11 h at $0.059/h (+ $0.059/GB processed: not known here)" in text
    assert "nat-0old" not in text
    assert "volume vol-i-0c gp3 200 GB +375 MB/s +1000 IOPS for 0.42 d" in text
    for differs in ("credits", "Savings Plans", "spot price", "data transfer", "public IPv4",
                    "what no longer exists is not counted"):
        assert differs in text
    # The controller's root volume was replaced at T0+3h: its life still counts from its interface's T0.
    assert "mini-controller c6i.xlarge: 10.00 h running" in text


def test_spend_unknown_without_credentials_or_when_ec2_refuses(tmp_path, monkeypatch):
    """botocore's errors are said on the spend's line, never raised: no credentials at all (the SDK's chain
    finds none: no variables, files or instance metadata), and an EC2 refusal (Stubber's client error)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    said = status_lines(tmp_path, monkeypatch, ec2=None)
    assert any(line.startswith("  spent so far: unknown (NoCredentialsError: Unable to locate credentials)")
               for line in said), said
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(ec2)
    stub.add_client_error("describe_instances", "UnauthorizedOperation", "not allowed: ec2:DescribeInstances")
    stub.activate()
    said = status_lines(tmp_path, monkeypatch, ec2=ec2)
    assert any(line.startswith("  spent so far: unknown (ClientError: An error occurred (UnauthorizedOperation)")
               and "it needs ec2:DescribeInstances" in line for line in said), said


def test_the_spend_asks_ec2_with_the_stacks_aws_profile(tmp_path, monkeypatch):
    """aws:profile in Pulumi.<stack>.yaml: the credentials `pulumi` uses, also for the spend (as the Spot
    request guard: one helper, cluster/aws_session.py)."""
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = d\n"
                                          "[team]\naws_access_key_id = AKIATEAM\naws_secret_access_key = t\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "Pulumi.team.yaml").write_text(f"config:\n  aws:region: {REGION}\n  aws:profile: team\n")
    assert est.stack_settings("team", repo=tmp_path).profile == "team"
    real_settings = est.stack_settings
    monkeypatch.setattr(est, "stack_settings", lambda stack: real_settings(stack, repo=tmp_path))
    made = []  # the client the spend asks EC2 with (the asking itself: the tests above)
    monkeypatch.setattr(spend, "so_far", lambda ec2, *a: made.append(ec2) or spend.Spend(since=None))
    status_lines(tmp_path, monkeypatch, ec2=None, stack="team")
    assert made[0].meta.region_name == REGION
    assert made[0]._request_signer._credentials.access_key == "AKIATEAM"


# ---------------------------------------------------------------- fab status


class LocalController(Context):
    user = "root"  # ops.ssh.remote.sudo runs the command as is

    def run(self, command, **kwargs):
        kwargs.setdefault("in_stream", False)  # pytest's stdin is not a terminal
        return super().run(command, **kwargs)

    def close(self) -> None:
        pass


def status_lines(tmp_path, monkeypatch, ec2, stack: str = "dev") -> list[str]:
    """`fab status`'s money lines: node power from sinfo (a stand-in printing sinfo's format), the power
    log read on the controller, EC2 as given (None: the stack's own client)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sinfo").write_text("#!/bin/sh\nprintf 'gpu-node-01|idle~|none\\ngpu-node-02|idle|none\\n'\n")
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    log = tmp_path / "slurm-gpu-power.log"
    log.write_text(POWER_LOG + "\n")
    monkeypatch.setattr(power, "POWER_LOG", str(log))
    monkeypatch.setattr(spend, "datetime", type("Frozen", (datetime,), {"now": staticmethod(lambda tz=None: NOW)}))
    inv = inventories.make(public_ip="198.51.100.7", gpu_nodes=(("gpu-node-01", "10.0.1.11"), ("gpu-node-02", "10.0.1.12")),
                           python="/usr/bin/python3", idle_stop_s=1800, aws=AwsResources(), region=REGION, stack=STACK)
    said: list[str] = []
    billing_status.show(Cluster(inv, LocalController(), {}), options.parse_cluster(stack=stack), said.append, ec2=ec2)
    return said


def test_fab_status_shows_what_still_bills_and_what_was_spent(tmp_path, monkeypatch):
    ec2, stub = stubbed_ec2()
    said = status_lines(tmp_path, monkeypatch, ec2)
    stub.assert_no_pending_responses()
    text = "\n".join(said)
    assert "1 GPU node(s) on: EBS gp3 200 GB" in text
    assert "1 GPU node(s) stopped: a stopped node keeps its volume: EBS gp3 200 GB" in text
    assert "1 GPU node(s) on, until power saving stops them 30 min after their last job" in text
    assert "stop it: `fab down --stack=dev`" in text
    assert "spent so far since 2026-11-30 23:30 UTC" in text
    assert "power log" in text and "was not readable" not in text


def test_fab_status_on_the_local_cluster_says_nothing_bills():
    inv = inventories.make("local", cluster_name="local", controller=("controller", "10.213.0.10"),
                           gpu_nodes=(("gpu-node-01", "10.213.0.11"),), gpus_per_node=2,
                           python="/usr/bin/python3", service_cmd="hostctl {action} {service}")
    said: list[str] = []
    billing_status.show(Cluster(inv, LocalController(), {}), options.parse_cluster(target="local"), said.append)
    assert said == ["  billing: nothing (the local cluster runs on this machine)"]


# ---------------------------------------------------------------- the program's tags the filters rely on


def test_every_instance_and_the_nat_gateway_carry_the_stack_tag_spend_filters_by():
    """The Cluster tag is shared by every stack of a cluster name (mini by default); the spend is looked up
    by STACK_TAG, which the inventory names."""
    run = harness.run_program(harness.stack_config(clusterName="mini"))
    stack = run.outputs["inventory"]["facts"]["stack"]
    assert stack == "slurm-gpu/test"  # stack_name() under the mocks (no organization)
    tagged = run.of_type("instance") + run.of_type("nat") + run.of_type("eip")
    assert len(run.of_type("instance")) >= 2 and len(run.of_type("nat")) == 1
    for res in tagged:
        assert res.inputs["tags"][STACK_TAG] == stack, res.name


def test_an_inventory_without_the_stack_tag_says_the_spend_is_unknown(tmp_path, monkeypatch):
    said: list[str] = []
    inv = inventories.make(public_ip="198.51.100.7", python="/usr/bin/python3", service_cmd="x",
                           aws=AwsResources(), region=REGION)
    monkeypatch.setattr(billing_status, "node_counts", lambda cl: (0, 0))
    billing_status.show(Cluster(inv, LocalController(), {}), options.parse_cluster(stack="dev"), said.append,
                        ec2=object())
    assert said[-1].startswith(f"  spent so far: unknown (this stack's inventory does not name its {STACK_TAG} tag")
