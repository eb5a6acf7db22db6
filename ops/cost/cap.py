"""`fab train --max-cost USD`: the cap checked against the estimate before launch, and handed to the job.

Before launch the run's estimated cost (ops/cost/estimate.py, the stack's prices) must fit the cap, else the
run is refused before any host is touched, saying by how much and what would fit (fewer rows, fewer
nodes, spot). During the run training/cost_cap.py projects the cost from the measured step rate at the
hourly rate computed here and stops with a checkpoint before the cap would be passed.

The local cluster has no prices: it is priced at a stand-in rate per node (ops/data/local.json
`standin_price_per_node_h`), so the cap can be tried and tested there.
"""

from __future__ import annotations

import dataclasses
import math

from ops.actions.flags import OptionError, number
from ops.cost import estimate as est
from ops.cost import market_prices

FLAG = "--max-cost"


class CostCapError(ValueError):
    pass


def parse(value) -> float | None:
    """--max-cost: a positive number of US dollars (None: no cap)."""
    if value is None or value is False or str(value).strip() == "":
        return None
    text = str(value).strip().lstrip("$")
    try:
        usd = number(FLAG.removeprefix("--"), text, float)
    except OptionError:
        raise CostCapError(f"{FLAG} must be a number of US dollars (e.g. {FLAG} 5.00), not {value!r}") from None
    if not math.isfinite(usd) or usd <= 0:
        raise CostCapError(f"{FLAG} must be a positive number of US dollars (e.g. {FLAG} 5.00), not {value!r}")
    return usd


def _spot(cl: est.PricedCluster):
    return market_prices.spot_range(est._json("prices.json"), cl.region, cl.gpu_type)


def gpu_rate_per_h(cl: est.PricedCluster) -> float:
    """One GPU node's hourly price as the cap counts it: on a spot stack the high end of the recorded
    spot range (a cap must not be passed because spot rose within its range); else On-Demand, also
    for reserved capacity (an upper bound: a reservation bills its GPUs whether they run or not)."""
    spot = _spot(cl) if cl.market == "spot" else None
    return spot.high if spot else est.price_per_h(cl.region, cl.gpu_type)


def rate_per_h(cl: est.PricedCluster) -> float:
    """What the run costs per hour while it runs: every billed GPU node, the controller, the NAT gateway
    and the EBS volumes (as the estimate's bill has them); locally the stand-in price per node."""
    if cl.calibrated:
        return cl.billed_nodes * est._json("local.json")["standin_price_per_node_h"]
    p = est.prices(cl.region)
    # The root volumes and the shared /scratch's own (one gp3 formula: its throughput and IOPS are its own).
    volumes = est.gp3_per_month(p, (cl.billed_nodes + 1) * cl.root_volume_gib + cl.scratch_gib, cl.scratch_mbps,
                                cl.scratch_iops)
    return (cl.billed_nodes * gpu_rate_per_h(cl)
            + est.price_per_h(cl.region, cl.controller_type) + p["nat_per_h"]
            + est.per_h_of_month(volumes))


def run_cost(e: est.Estimate, scenario: str) -> float:
    """The estimated cost of the whole run (fab's start to adapters home) in one scenario."""
    if e.cluster.calibrated:
        return rate_per_h(e.cluster) * e.total(scenario) / 3600
    if e.cluster.market == "spot" and (bill := est.spot_bill(e, scenario)):
        return bill[1]  # the high end of the recorded spot range, as gpu_rate_per_h
    return sum(line.usd for line in est.cost(e, scenario))


def fitting_rows(e: est.Estimate, scenario: str, cap: float) -> int | None:
    """The most rows (below the job's) whose run fits the cap; None when not even one row does."""
    def fits(rows: int) -> bool:
        return run_cost(est.estimate(e.cluster, dataclasses.replace(e.job, rows=rows)), scenario) <= cap

    low, high = 0, e.job.rows - 1  # low fits (0 = none found yet), high is the largest candidate
    if high < 1 or not fits(1):
        return None
    low = 1
    while low < high:  # the cost grows with the rows: bisect for the last that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def fitting_nodes(e: est.Estimate, scenario: str, cap: float) -> int | None:
    """The most GPU nodes (below the run's) whose run fits the cap, the stack shrunk to them too (the
    stack bills all its nodes while the run goes); None when no smaller cluster fits."""
    for n in range(e.cluster.nodes - 1, 0, -1):
        smaller = dataclasses.replace(e.cluster, nodes=n, stack_nodes=min(e.cluster.stack_nodes, n))
        if run_cost(est.estimate(smaller, e.job), scenario) <= cap:
            return n
    return None


def check_before_launch(e: est.Estimate, scenario: str, cap: float) -> float:
    """The run's estimated cost when it fits `cap`; else CostCapError saying by how much and what would fit."""
    cost = run_cost(e, scenario)
    if cost <= cap:
        return cost
    cl = e.cluster
    price = (f"stand-in price ${rate_per_h(cl):.2f}/h for {cl.billed_nodes} node(s), ops/data/local.json"
             if cl.calibrated else "the stack's prices, ops/data/prices.json")
    ways = []
    rows = fitting_rows(e, scenario, cap)
    if rows:
        ways.append(f"fewer rows: --examples {rows} (of {e.job.rows:,})")
    nodes = fitting_nodes(e, scenario, cap)
    if nodes:
        ways.append(f"fewer nodes: --nodes {nodes}" + ("" if cl.calibrated else
                                                       f" on a stack of {nodes} (slurm-gpu:gpuNodeCount)"))
    if not cl.calibrated and cl.market != "spot":
        bill = est.spot_bill(e, scenario)
        if bill is None:
            ways.append("GPU nodes on spot instead of on demand (no recorded spot range for "
                        f"{cl.gpu_type} in {cl.region}; docs/CONFIG.md)")
        else:
            low, high = bill
            verdict = "fits" if high <= cap else "may fit" if low <= cap else "does not fit either"
            ways.append(f"GPU nodes on spot (slurm-gpu:gpuMarket spot): ${low:.2f}-${high:.2f} over the "
                        f"recorded range, {verdict} (docs/CONFIG.md)")
    fix = ("; what would fit: " + "; ".join(ways)) if ways else "; nothing smaller fits: raise the cap"
    raise CostCapError(f"{FLAG} ${cap:.2f}: the run is estimated at ${cost:.2f} ({price}), ${cost - cap:.2f} "
                       f"over the cap{fix}. Nothing was started (`fab train --estimate` shows the estimate)")


def train_flags(cap: float, per_h: float, started_at: float) -> dict[str, object]:
    """The training settings the job gets (training/args.py): the cap, the hourly rate, and when the run
    began costing (Unix seconds on the cluster's clock), so time before training counts as spent."""
    return {"max_cost_usd": f"{cap:.6g}", "cost_per_hour_usd": f"{per_h:.6g}",
            "cost_started_at": f"{started_at:.3f}"}
