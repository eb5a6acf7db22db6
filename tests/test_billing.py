"""What a stack still bills and what it has cost so far: the summary's last lines (the real summary code),
`fab status`'s money lines, EC2's answers through botocore's Stubber, the power log as the power
programs write it, and the mocked program's tags that the EC2 filters rely on."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from invoke import Context

import tests.test_infra_mocks as harness
from cluster.inventory import Inventory, Node
from ops.actions import billing_status, nccl, options
from ops.actions import node_power as power
from ops.cost import estimate as est
from ops.cost import spend, still_bills
from ops.finetune import pipeline, summary
from ops.ssh.remote import Cluster

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
    steady = ctl + PRICES["nat_per_h"] + 200 * gb_h + 2 * 200 * gb_h
    idle = 2 * gpu
    assert lines[-7] == (f"  still billing ${steady + idle:.3f}/h now, ${steady * 24 + idle * 0.5:.2f} over the next "
                         "24 h (list prices, ops/data/prices.json):")
    assert lines[-6] == f"    ${ctl:.3f}/h  controller c6i.xlarge (runs until the stack is destroyed)"
    assert lines[-5] == f"    ${PRICES['nat_per_h']:.3f}/h  NAT gateway (+ ${PRICES['nat_per_gb']}/GB it carries)"
    assert lines[-4] == f"    ${200 * gb_h:.3f}/h  controller: EBS gp3 200 GB at ${PRICES['gp3_per_gb_month']}/GB-month"
    assert lines[-3] == (f"    ${400 * gb_h:.3f}/h  2 GPU node(s) on: EBS gp3 400 GB at "
                         f"${PRICES['gp3_per_gb_month']}/GB-month")
    assert lines[-2] == (f"    ${idle:.3f}/h  2 GPU node(s) on, until power saving stops them 30 min after their "
                         f"last job (slurm-gpu:idleStopMinutes: ${idle * 0.5:.2f} once idle)")
    assert lines[-1].startswith("  stop it: `fab down --stack dev` (pulumi destroy, once every finished run is home")


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


def instance(iid: str, name: str, itype: str, state: str, launch: datetime, reason: str = "",
             lifecycle: str | None = None) -> dict:
    inst = {"InstanceId": iid, "InstanceType": itype, "State": {"Name": state, "Code": 16}, "LaunchTime": launch,
            "RootDeviceName": "/dev/sda1", "StateTransitionReason": reason,
            "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"AttachTime": T0, "VolumeId": f"vol-{iid}",
                                                                      "Status": "attached"}}],
            "Tags": [{"Key": "Name", "Value": name}, {"Key": "Cluster", "Value": "mini"}]}
    if lifecycle:
        inst["InstanceLifecycle"] = lifecycle
    return inst


def stubbed_ec2():
    """EC2 of a stack made at T0: the controller ran throughout; gpu-node-01 was stopped and started by the
    power programs (in the log) and is stopped now; gpu-node-02 was stopped by them and started by hand at
    T0+8h (not in the log: EC2's LaunchTime tells)."""
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(ec2)
    tagged = [{"Name": "tag:Cluster", "Values": ["mini"]}]
    alive = {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [
        instance("i-0c", "mini-controller", "c6i.xlarge", "running", T0),
        instance("i-0a01", "mini-gpu-node-01", "g6.12xlarge", "stopped", at(5),
                 f"User initiated ({at(6):%Y-%m-%d %H:%M:%S} GMT)"),
        instance("i-0a02", "mini-gpu-node-02", "g6.12xlarge", "running", at(8), lifecycle="spot"),
    ]}]}, {"Filters": [*tagged, alive]})
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
    result = spend.so_far(ec2, "mini", REGION, POWER_LOG, now=NOW)
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
    for differs in ("credits", "Savings Plans", "spot price", "data transfer"):
        assert differs in text


# ---------------------------------------------------------------- fab status


class LocalController(Context):
    user = "root"  # ops.ssh.remote.sudo runs the command as is

    def run(self, command, **kwargs):
        kwargs.setdefault("in_stream", False)  # pytest's stdin is not a terminal
        return super().run(command, **kwargs)

    def close(self) -> None:
        pass


def test_fab_status_shows_what_still_bills_and_what_was_spent(tmp_path, monkeypatch):
    """The money lines of `fab status`: node power from sinfo (a stand-in printing sinfo's format), the
    power log read on the controller, EC2 through the Stubber."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/sh\nprintf 'gpu-node-01|idle~|none\\ngpu-node-02|idle|none\\n'\n")
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    log = tmp_path / "slurm-gpu-power.log"
    log.write_text(POWER_LOG + "\n")
    monkeypatch.setattr(power, "POWER_LOG", str(log))
    monkeypatch.setattr(spend, "datetime", type("Frozen", (datetime,), {"now": staticmethod(lambda tz=None: NOW)}))
    inv = Inventory(target="aws", cluster_name="mini", ssh_user="ubuntu",
                    controller=Node("controller", "10.0.0.10", "controller", "198.51.100.7"),
                    gpu_nodes=(Node("gpu-node-01", "10.0.1.11", "gpu"), Node("gpu-node-02", "10.0.1.12", "gpu")),
                    gpus_per_node=4, gpu_type="l4", nvlink=False, efa=True, python="/usr/bin/python3",
                    service_cmd="sudo systemctl {action} {service}",
                    extra={"region": REGION, "idle_stop_s": 1800})
    ec2, stub = stubbed_ec2()
    said: list[str] = []
    billing_status.show(Cluster(inv, LocalController(), {}), options.parse_cluster(stack="dev"), said.append, ec2=ec2)
    stub.assert_no_pending_responses()
    text = "\n".join(said)
    assert "1 GPU node(s) on: EBS gp3 200 GB" in text
    assert "1 GPU node(s) stopped: a stopped node keeps its volume: EBS gp3 200 GB" in text
    assert "1 GPU node(s) on, until power saving stops them 30 min after their last job" in text
    assert "stop it: `fab down --stack dev`" in text
    assert "spent so far since 2026-11-30 23:30 UTC" in text
    assert "power log" in text and "was not readable" not in text


def test_fab_status_on_the_local_cluster_says_nothing_bills():
    inv = Inventory(target="local", cluster_name="local", ssh_user="root",
                    controller=Node("controller", "10.213.0.10", "controller"),
                    gpu_nodes=(Node("gpu-node-01", "10.213.0.11", "gpu"),), gpus_per_node=2, gpu_type="l4",
                    nvlink=False, efa=False, python="/usr/bin/python3", service_cmd="hostctl {action} {service}")
    said: list[str] = []
    billing_status.show(Cluster(inv, LocalController(), {}), options.parse_cluster(target="local"), said.append)
    assert said == ["  billing: nothing (the local cluster runs on this machine)"]


# ---------------------------------------------------------------- the program's tags the filters rely on


def test_every_instance_and_the_nat_gateway_carry_the_cluster_tag_spend_filters_by():
    run = harness.run_program(harness.stack_config(clusterName="mini"))
    cluster = run.outputs["inventory"]["cluster_name"]
    tagged = run.of_type("instance") + run.of_type("nat")
    assert len(run.of_type("instance")) >= 2 and len(run.of_type("nat")) == 1
    for res in tagged:
        assert res.inputs["tags"][spend.CLUSTER_TAG] == cluster, res.name
