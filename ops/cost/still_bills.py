"""What a stack still bills while nobody uses it, per hour and per day, and the command that stops it.

The end of `fab train`'s summary (without --down) and `fab status` print these lines. Prices are
ops/cost/estimate.py's (ops/data/prices.json, list prices): the controller and the NAT gateway run until
the stack is destroyed; every EBS volume bills whether its instance runs or not (EC2 User Guide,
"Instance state changes": stopped instances are not billed, their EBS volumes are,
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-lifecycle.html); a GPU node that is on
bills until power saving stops it (slurm-gpu:idleStopMinutes), or for ever when power saving is off.
By slurm-gpu:gpuMarket (docs/CONFIG.md, "Buying GPU nodes"):
- spot: a node that is on pays the spot price: the recorded range (ops/cost/market_prices.py), its high end
  counted, as the cost cap does (ops/cost/cap.py gpu_rate_per_h);
- capacity-reservation: the On-Demand Capacity Reservation bills every reserved instance at On-Demand
  whether the nodes run or not, and goes on billing after `pulumi destroy` until it is cancelled (EC2 User
  Guide, "Capacity Reservation pricing and billing":
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-reservations-pricing-billing.html);
- capacity-block: paid up front; its instances add nothing per hour here (a small OS fee aside).
Public IPv4 addresses (the controller's, the NAT gateway's Elastic IP) bill per hour too
(https://aws.amazon.com/vpc/pricing/): ops/data/prices.json has no price for them, so a note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.settings import CAPACITY_BLOCK, CAPACITY_RESERVATION, SPOT
from ops.cost import cap, market_prices
from ops.cost import estimate as est

DAY_H = 24
IPV4_NOTE = ("    + public IPv4: the controller's address and the NAT gateway's Elastic IP bill per hour each "
             "(https://aws.amazon.com/vpc/pricing/), not counted here")


@dataclass(frozen=True)
class StillBilling:
    """The stack's standing bill: `steady` lines in USD per hour (until the stack is destroyed), and the
    GPU nodes that are on and stop by themselves within `idle_stop_min` (their USD per hour: `idle_per_h`)."""
    steady: list[est.CostLine]
    nodes_on: int
    nodes_stopped: int
    idle_per_h: float
    idle_stop_min: int
    down_command: str
    notes: list[str] = field(default_factory=list)
    idle_how: str = ""  # how the idle nodes are priced (spot: the recorded range)

    @property
    def per_h(self) -> float:
        """USD per hour now (the idle nodes included while they still run)."""
        return sum(c.usd for c in self.steady) + self.idle_per_h

    @property
    def idle_tail_usd(self) -> float:
        """What the idle nodes cost until power saving stops them (0 when it never does: they are steady)."""
        return est.idle_cost(self.idle_per_h, self.idle_stop_min) if self.idle_stop_min else 0.0

    @property
    def per_day(self) -> float:
        """USD for the next 24 hours: the steady lines all day, the idle nodes until they stop."""
        steady = sum(c.usd for c in self.steady)
        if self.idle_stop_min:
            return steady * DAY_H + self.idle_tail_usd
        return (steady + self.idle_per_h) * DAY_H


def down_command(stack: str | None) -> str:
    return "fab down" + (f" --stack={stack}" if stack else "")


def _gpu_rate(cl: est.PricedCluster) -> tuple[float, str]:
    """One running GPU node's hourly price here and how it was found, by market."""
    on_demand = est.price_per_h(cl.region, cl.gpu_type)
    if cl.market == SPOT:
        spot = market_prices.spot_range(est._json("prices.json"), cl.region, cl.gpu_type)
        if spot is None:
            return on_demand, (f"spot, priced On-Demand ${on_demand}/h: no recorded spot range for {cl.gpu_type} "
                               f"in {cl.region}; spot never costs more")
        return cap.gpu_rate_per_h(cl), (f"spot: ${spot.low}-${spot.high}/h recorded across {cl.region}'s zones "
                                        f"({spot.date}, not a quote), the high end counted")
    return on_demand, ""


def still_billing(cl: est.PricedCluster, nodes_on: int, nodes_stopped: int, stack: str | None) -> StillBilling:
    """The standing bill of the stack `cl` prices (estimate.cluster_for) with `nodes_on` GPU nodes running
    and `nodes_stopped` stopped by power saving, by the stack's GPU market (module doc)."""
    p = est.prices(cl.region)
    ctl_h = est.price_per_h(cl.region, cl.controller_type)
    gpu_h, how = _gpu_rate(cl)
    steady = [est.CostLine(f"controller {cl.controller_type} (runs until the stack is destroyed)", ctl_h),
              est.CostLine(f"NAT gateway (+ ${p['nat_per_gb']}/GB it carries)", p["nat_per_h"])]
    # The controller's root volume and the shared /scratch's own (attached to it).
    steady += [est.CostLine(f"controller: {c.what}", c.usd) for c in est.storage_per_h(cl, volumes=1, scratch=True)]
    for count, what in ((nodes_on, "on"), (nodes_stopped, "stopped: a stopped node keeps its volume")):
        if count:
            line = est.storage_per_h(cl, volumes=count)[0]
            steady.append(est.CostLine(f"{count} GPU node(s) {what}: {line.what}", line.usd))
    notes, idle_per_h = [], nodes_on * gpu_h
    reserved = f" {cl.reservation_id}" if cl.reservation_id else ""
    if cl.market == CAPACITY_RESERVATION:  # every reserved instance bills, on or stopped, until cancelled
        count = nodes_on + nodes_stopped
        steady.append(est.CostLine(f"Capacity Reservation{reserved}: {count} x {cl.gpu_type} at On-Demand, "
                                   "running or not, until it is cancelled (pulumi destroy does not; a "
                                   "reservation larger than the stack's nodes bills more)",
                                   count * gpu_h))
        idle_per_h = 0.0
    elif cl.market == CAPACITY_BLOCK:  # paid up front: stopping a node saves nothing, running one adds ~0
        notes.append(f"    Capacity Block{reserved}: paid up front for its days; its {cl.gpu_type} nodes add "
                     "only a small OS fee per hour (not counted), and stopping them saves nothing")
        idle_per_h = 0.0
    elif nodes_on and not cl.idle_stop_min:  # power saving off: they run until stopped by hand
        steady.append(est.CostLine(f"{nodes_on} x {cl.gpu_type} on (power saving is off: "
                                   "slurm-gpu:idleStopMinutes 0)" + (f"; {how}" if how else ""), idle_per_h))
        idle_per_h = 0.0
    notes.append(IPV4_NOTE)
    return StillBilling(steady, nodes_on, nodes_stopped, idle_per_h, cl.idle_stop_min, down_command(stack),
                        notes, how)


def lines(bill: StillBilling) -> list[str]:
    """What the user reads: the total per hour and per day, a line per item, and how to stop it."""
    out = [f"  still billing ${bill.per_h:.3f}/h now, ${bill.per_day:.2f} over the next 24 h "
           "(list prices, ops/data/prices.json):"]
    out += [f"    ${c.usd:.3f}/h  {c.what}" for c in bill.steady]
    if bill.idle_per_h:
        out.append(f"    ${bill.idle_per_h:.3f}/h  {bill.nodes_on} GPU node(s) on, until power saving stops them "
                   f"{bill.idle_stop_min} min after their last job (slurm-gpu:idleStopMinutes: "
                   f"${bill.idle_tail_usd:.2f} once idle)" + (f"; {bill.idle_how}" if bill.idle_how else ""))
    out += bill.notes
    out.append(f"  stop it: `{bill.down_command}` (pulumi destroy, once every finished run is home; "
               "`fab runs` lists them)")
    return out


def after_destroy(market: str, reservation_id: str) -> list[str]:
    """What `fab down` says once `pulumi destroy` is done: what the stack did not own bills on (module doc)."""
    rid = reservation_id or "its cr-... id"
    out = []
    if market == CAPACITY_RESERVATION:
        out.append(f"still billing: the On-Demand Capacity Reservation {rid} bills every reserved instance until "
                   f"you cancel it (`aws ec2 cancel-capacity-reservation --capacity-reservation-id {rid}`)")
    elif market == CAPACITY_BLOCK:
        out.append(f"the Capacity Block {rid} was paid up front for its days and is not refunded")
    out.append("left-over Spot requests (a spot stack's) can still launch instances: `fab spot-requests` lists them")
    out.append("nothing else of this stack bills any more (its Pulumi.<stack>.yaml and empty state remain: "
               "`pulumi stack rm` removes them)")
    return out
