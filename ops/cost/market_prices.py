"""The GPU nodes' price in each market (slurm-gpu:gpuMarket), beside the On-Demand bill of
ops/cost/estimate.py: spot as the recorded range of ops/data/prices.json (a snapshot across the region's
zones, not a quote), a Capacity Block at its published rate, paid up front for whole 24-hour days
(EC2 User Guide, "Capacity Blocks for ML": durations in 1-day increments), whatever the run uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY_H = 24
# EC2 begins terminating a block's instances 30 minutes before its end time (EC2 User Guide, "Use
# Capacity Blocks": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-using.html):
# a run must end that long before the block does.
BLOCK_END_LEAD_H = 0.5


@dataclass(frozen=True)
class SpotRange:
    low: float  # USD per instance-hour
    high: float
    date: str
    source: str


def spot_range(prices: dict, region: str, itype: str) -> SpotRange | None:
    """The recorded spot range of a type in a region (prices: ops/data/prices.json), or None."""
    table = prices.get("spot") or {}
    found = (table.get("regions") or {}).get(region, {}).get(itype)
    if not found:
        return None
    return SpotRange(float(found[0]), float(found[1]), table["date"], table["source"])


def capacity_block_rate(prices: dict, region: str, itype: str) -> float | None:
    table = prices.get("capacity_block") or {}
    rate = (table.get("regions") or {}).get(region, {}).get(itype)
    return None if rate is None else float(rate)


def capacity_block_date(prices: dict) -> str:
    """When the recorded Capacity Block rates were current (the page's own date, then when read)."""
    return str((prices.get("capacity_block") or {}).get("date", "undated"))


def market_lines(prices: dict, *, region: str, gpu_type: str, nodes: int, wall: float, on_demand_h: float,
                 market: str) -> list[str]:
    """What the user sees beside the On-Demand bill of a run of `wall` seconds on `nodes` GPU nodes:
    the GPU nodes on spot (always: the alternative, or the stack's own market) and, for a Capacity
    Block stack, the block's cost."""
    run_od = nodes * on_demand_h * wall / 3600
    out = []
    spot = spot_range(prices, region, gpu_type)
    if spot is None:
        out.append(f"  spot: no recorded spot range for {gpu_type} in {region} in ops/data/prices.json "
                   f"(spot never costs more than On-Demand, ${on_demand_h}/h)")
    else:
        lo, hi = (nodes * p * wall / 3600 for p in (spot.low, spot.high))
        mine = " (this stack's market)" if market == "spot" else ""
        out.append(f"  GPU nodes, on-demand vs spot{mine}: ${run_od:.2f} on-demand, ${lo:.2f}-${hi:.2f} on spot "
                   f"({nodes} x {gpu_type} at ${spot.low}-${spot.high}/h: a recorded range across "
                   f"{region}'s zones, {spot.date}, not a quote; a stopped spot node pays only its volume)")
    if market == "capacity-block":
        rate = capacity_block_rate(prices, region, gpu_type)
        if rate is None:
            out.append(f"  Capacity Block: no published rate for {gpu_type} in {region} in "
                       "ops/data/prices.json (see https://aws.amazon.com/ec2/capacityblocks/pricing/)")
        else:
            hours = wall / 3600
            days = max(1, math.ceil((hours + BLOCK_END_LEAD_H) / DAY_H))
            block = nodes * rate * DAY_H * days
            out.append(f"  Capacity Block: ${block:.2f} up front ({nodes} x {gpu_type} at ${rate}/h, AWS's "
                       f"published rate {capacity_block_date(prices)}, for "
                       f"{days} day{'s' if days > 1 else ''}, the shortest block that covers this run's "
                       f"{wall / 60:.0f} min), paid whether the nodes run or not; the instance lines above "
                       "are On-Demand prices, which the block replaces")
            if hours + BLOCK_END_LEAD_H > DAY_H * math.ceil(hours / DAY_H):
                out.append(f"  note: EC2 begins terminating a Capacity Block's instances "
                           f"{BLOCK_END_LEAD_H * 60:.0f} minutes before it ends: this run does not fit "
                           f"{math.ceil(hours / DAY_H)} day(s) with that margin, so {days} are counted")
    return out

