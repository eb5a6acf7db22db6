"""Prices per market (ops/cost/market_prices.py): the estimate shows On-Demand and spot side by side (spot
as the recorded range, said to be one), a Capacity Block's up-front cost when the stack buys one, and
README's spot column is the estimate's."""

import dataclasses
import json
from pathlib import Path

from ops.cost import estimate as est
from ops.cost import market_prices as mp

REPO = Path(__file__).resolve().parents[2]
SEED_CONFIG = REPO / "training" / "configs" / "qwen3-4b-lora.yaml"


def _estimate(cl: est.PricedCluster) -> est.Estimate:
    return est.estimate(cl, est.job_from_config(SEED_CONFIG, None, None, None))


def test_price_table_records_spot_ranges_and_block_rates_with_their_sources():
    table = json.loads((REPO / "ops" / "data" / "prices.json").read_text())
    for section in ("spot", "capacity_block"):
        assert table[section]["date"] and table[section]["source"]
    for region, types in table["spot"]["regions"].items():
        for itype, (low, high) in types.items():
            # A range, at most the On-Demand price (AWS: the spot price never exceeds it).
            assert 0 < low <= high <= table["regions"][region]["instance_per_h"][itype], (region, itype)
    assert mp.spot_range(table, "ap-northeast-2", "g6.12xlarge") and mp.capacity_block_rate(table, "us-east-1", "p5.48xlarge")


def test_estimate_shows_on_demand_and_spot_side_by_side():
    e = _estimate(est.cluster_for("aws", "dev", None))
    spot = mp.spot_range(est._json("prices.json"), "ap-northeast-2", "g6.12xlarge")
    text = "\n".join(est.lines(e))
    for s in est.SCENARIOS:
        wall = e.total(s)
        od = 2 * est.price_per_h("ap-northeast-2", "g6.12xlarge") * wall / 3600
        lo, hi = 2 * spot.low * wall / 3600, 2 * spot.high * wall / 3600
        assert f"${od:.2f} on-demand, ${lo:.2f}-${hi:.2f} on spot" in text
    assert "a recorded range across ap-northeast-2's zones" in text and "not a quote" in text
    assert "Capacity Block" not in text  # only when the stack buys one


def test_a_type_without_a_recorded_spot_range_says_so():
    cl = est.cluster_for("aws", None, None, gpu_instance_type="p5.48xlarge", region="us-east-1")
    text = "\n".join(est.lines(_estimate(cl)))
    assert "no recorded spot range for p5.48xlarge in us-east-1" in text


def test_a_capacity_block_costs_whole_days_up_front():
    cl = dataclasses.replace(est.cluster_for("aws", None, None, gpu_instance_type="p5.48xlarge",
                                             region="us-east-1"), market="capacity-block")
    e = _estimate(cl)
    prices = est._json("prices.json")
    rate = mp.capacity_block_rate(prices, "us-east-1", "p5.48xlarge")

    def block_lines(e):
        return mp.market_lines(prices, region="us-east-1", gpu_type="p5.48xlarge", nodes=2, wall=e.total("new"),
                               on_demand_h=est.price_per_h("us-east-1", "p5.48xlarge"), market="capacity-block")

    lines = block_lines(e)
    assert any(line in "\n".join(est.lines(e)) for line in lines)
    assert any(f"Capacity Block: ${2 * rate * 24:.2f} up front" in line and "for 1 day" in line for line in lines)
    # The rate is dated as its source is: current only until AWS's stated update.
    date = prices["capacity_block"]["date"]
    assert "until" in date and any(f"published rate {date}" in line for line in lines)
    # EC2 begins terminating 30 minutes before the block ends: a run within that margin of a whole day
    # needs another day, and the estimate says why.
    margin = e.total("new")
    near = dataclasses.replace(e, phases=[*e.phases, est.PhaseEstimate("train", {"new": 24 * 3600.0 - margin
                                                                                 - 600.0}, "x")])
    near_lines = block_lines(near)
    assert any(f"${2 * rate * 48:.2f} up front" in line for line in near_lines)
    assert any("30 minutes before it ends" in line for line in near_lines)
    assert not any("30 minutes before" in line for line in lines)
    # A run longer than a day needs a second day of the block.
    longer = dataclasses.replace(e, phases=[*e.phases, est.PhaseEstimate("train", {"new": 24 * 3600.0}, "x")])
    assert any(f"${2 * rate * 48:.2f} up front" in line for line in block_lines(longer))


def test_the_stacks_market_comes_from_its_settings(tmp_path, monkeypatch):
    (tmp_path / "Pulumi.x.yaml").write_text("config:\n  aws:region: us-east-1\n  slurm-gpu:gpuMarket: spot\n")
    stack_file = est.stack_settings("x", tmp_path)
    assert stack_file.settings.gpu_market == "spot"
    monkeypatch.setattr(est, "stack_settings", lambda stack, repo=est.REPO: stack_file)
    cl = est.cluster_for("aws", "x", None)
    assert cl.market == "spot"
    assert "(this stack's market)" in "\n".join(est.lines(_estimate(cl)))


def test_readme_spot_column_is_the_estimate():
    e = _estimate(est.cluster_for("aws", "dev", None))
    text = (REPO / "README.md").read_text()
    for scenario in ("new", "again"):
        lo, hi = est.spot_bill(e, scenario)
        assert f"${lo:.2f}-${hi:.2f}" in text, scenario
    assert lo < hi < sum(c.usd for c in est.cost(e, "again"))  # spot is cheaper than on-demand here


def test_a_spot_node_that_could_not_start_gets_the_spot_advice():
    from ops.actions import node_power as power
    from ops.actions import slurm

    reason = ("start failed: InsufficientInstanceCapacity: There is no Spot capacity available that "
              "matches your request.")
    assert power.start_failure(slurm.NodeState("gpu-node-01", "idle~", reason)) == reason
    advice = power.advice(reason)
    assert "Spot market has no capacity" in advice and "slurm-gpu:gpuMarket on-demand" in advice
    # Each StartInstances spot error has its own advice (EC2 API Reference, "Error codes").
    gone = power.advice("start failed: IncorrectSpotRequestState: the request is not in a state to start")
    assert "describe-spot-instance-requests" in gone and "docs/FAULTS.md" in gone
    # Never the destructive advice: a replacement loses the node's root volume.
    assert "--replace" not in gone and "pulumi up" not in gone
    assert "no capacity" not in gone
    quota = power.advice("start failed: MaxSpotInstanceCountExceeded: Max spot instance count exceeded")
    assert "Spot vCPU quota" in quota and "L-C4BD4855 (P5)" in quota and "--quota-code" in quota
    # Spot request status codes are no StartInstances error: no spot advice for them.
    assert "Spot" not in power.advice("start failed: capacity-not-available: no spot capacity")
    on_demand = power.advice("start failed: InsufficientInstanceCapacity: We currently do not have sufficient "
                             "g6.12xlarge capacity in the Availability Zone you requested")
    assert "Spot" not in on_demand and "slurm-gpu:availabilityZone" in on_demand
