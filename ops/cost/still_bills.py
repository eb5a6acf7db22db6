"""What a stack still bills while nobody uses it, per hour and per day, and the command that stops it.

The end of `fab train`'s summary (without --down) and `fab status` print these lines. Prices are
ops/cost/estimate.py's (ops/data/prices.json, list prices): the controller and the NAT gateway run until
the stack is destroyed; every EBS volume bills whether its instance runs or not (EC2 User Guide,
"Instance state changes": stopped instances are not billed, their EBS volumes are,
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-lifecycle.html); a GPU node that is on
bills until power saving stops it (slurm-gpu:idleStopMinutes), or for ever when power saving is off.
"""

from __future__ import annotations

from dataclasses import dataclass

from ops.cost import estimate as est

DAY_H = 24


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

    @property
    def per_h(self) -> float:
        """USD per hour now (the idle nodes included while they still run)."""
        return sum(c.usd for c in self.steady) + self.idle_per_h

    @property
    def idle_tail_usd(self) -> float:
        """What the idle nodes cost until power saving stops them (0 when it never does: they are steady)."""
        return self.idle_per_h * self.idle_stop_min / 60 if self.idle_stop_min else 0.0

    @property
    def per_day(self) -> float:
        """USD for the next 24 hours: the steady lines all day, the idle nodes until they stop."""
        steady = sum(c.usd for c in self.steady)
        if self.idle_stop_min:
            return steady * DAY_H + self.idle_tail_usd
        return (steady + self.idle_per_h) * DAY_H


def down_command(stack: str | None) -> str:
    return "fab down" + (f" --stack {stack}" if stack else "")


def still_billing(cl: est.PricedCluster, nodes_on: int, nodes_stopped: int, stack: str | None) -> StillBilling:
    """The standing bill of the stack `cl` prices (estimate.cluster_for) with `nodes_on` GPU nodes running
    and `nodes_stopped` stopped by power saving."""
    p = est.prices(cl.region)
    ctl_h, gpu_h = est.price_per_h(cl.region, cl.controller_type), est.price_per_h(cl.region, cl.gpu_type)
    steady = [est.CostLine(f"controller {cl.controller_type} (runs until the stack is destroyed)", ctl_h),
              est.CostLine(f"NAT gateway (+ ${p['nat_per_gb']}/GB it carries)", p["nat_per_h"])]
    ctl_volume = [est.CostLine(f"controller: {c.what}", c.usd) for c in est.storage_per_h(cl, volumes=1)]
    steady += ctl_volume
    for count, how in ((nodes_on, "on"), (nodes_stopped, "stopped: a stopped node keeps its volume")):
        if count:
            line = est.storage_per_h(cl, volumes=count)[0]
            steady.append(est.CostLine(f"{count} GPU node(s) {how}: {line.what}", line.usd))
    idle_per_h = nodes_on * gpu_h
    if nodes_on and not cl.idle_stop_min:  # power saving off: they run until stopped by hand
        steady.append(est.CostLine(f"{nodes_on} x {cl.gpu_type} on (power saving is off: "
                                   "slurm-gpu:idleStopMinutes 0)", idle_per_h))
        idle_per_h = 0.0
    return StillBilling(steady, nodes_on, nodes_stopped, idle_per_h, cl.idle_stop_min, down_command(stack))


def lines(bill: StillBilling) -> list[str]:
    """What the user reads: the total per hour and per day, a line per item, and how to stop it."""
    out = [f"  still billing ${bill.per_h:.3f}/h now, ${bill.per_day:.2f} over the next 24 h "
           "(list prices, ops/data/prices.json):"]
    out += [f"    ${c.usd:.3f}/h  {c.what}" for c in bill.steady]
    if bill.idle_per_h:
        out.append(f"    ${bill.idle_per_h:.3f}/h  {bill.nodes_on} GPU node(s) on, until power saving stops them "
                   f"{bill.idle_stop_min} min after their last job (slurm-gpu:idleStopMinutes: "
                   f"${bill.idle_tail_usd:.2f} once idle)")
    out.append(f"  stop it: `{bill.down_command}` (pulumi destroy, once every finished run is home; "
               "`fab runs` lists them)")
    return out
