"""`fab spot-requests`: the Spot requests of slurm-gpu stacks that are left over, with how to cancel them.

Each spot GPU node's persistent Spot request is tagged with its stack (STACK_TAG) by the stack itself and
cancelled before the node is deleted (infra/spot_guard.py). A request that is still open, active or
disabled can launch or restart an instance that bills (EC2 User Guide, "Spot Instance requests":
terminating the instance of a persistent request reopens it; "Cancel a Spot Instance request":
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/using-spot-instances-cancel.html, "canceling the request
does not terminate the instance"). Left over: such a request whose instance is not a live instance of its
own stack (after `pulumi destroy` every request of the stack is; a relaunched instance carries no tags).
Requests of stacks destroyed before the stack tagged them carry no tag: every live persistent request
without the stack tag whose instance is gone or carries no stack tag is listed too, marked "untagged:
check" (it may not be slurm-gpu's: check before cancelling).
Works without the stack (after a destroy): it asks EC2 directly, with the caller's credentials.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from cluster import aws_session
from cluster.errors import UserError
from cluster.facts import STACK_TAG  # on instances and requests: the owning Pulumi stack
from ops.say import Say

# Request states in which it can still launch or restart an instance (EC2 API Reference,
# SpotInstanceRequest.State: open | active | closed | cancelled | failed | disabled).
LIVE_STATES = ("open", "active", "disabled")
INSTANCE_STATES = ("pending", "running", "stopping", "stopped")
_REQUEST_ID = re.compile(r"sir-[0-9a-z]{1,40}")
_INSTANCE_ID = re.compile(r"i-[0-9a-f]{1,40}")


class SpotRequestsLeft(UserError, RuntimeError):
    """Left-over Spot requests were found; the message says how many (each was printed above)."""


@dataclass(frozen=True)
class LeftOver:
    request_id: str
    state: str
    instance_id: str | None
    stack: str
    name: str
    untagged: bool = False  # no stack tag: maybe a stack's from before requests were tagged, maybe not ours


def _tags(item: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags", [])}


def _requests(ec2, filters: list[dict]) -> list[dict]:
    return [r for page in ec2.get_paginator("describe_spot_instance_requests").paginate(Filters=filters)
            for r in page["SpotInstanceRequests"]]


def _live_instances(ec2, scope: dict) -> dict[str, str]:
    """Instance id -> its stack tag ("" if none), of the instances in `scope` that are not terminated."""
    live = {}
    for page in ec2.get_paginator("describe_instances").paginate(
            Filters=[scope, {"Name": "instance-state-name", "Values": list(INSTANCE_STATES)}]):
        for inst in (i for r in page["Reservations"] for i in r["Instances"]):
            live[inst["InstanceId"]] = _tags(inst).get(STACK_TAG, "")
    return live


def left_over(ec2, stack: str | None = None) -> list[LeftOver]:
    """The live Spot requests tagged for `stack` (any slurm-gpu stack when None) whose instance is not a
    live instance of that stack, then the untagged live persistent ones whose instance is gone or carries
    no stack tag (module docstring)."""
    scope = ({"Name": f"tag:{STACK_TAG}", "Values": [stack]} if stack
             else {"Name": "tag-key", "Values": [STACK_TAG]})
    live_states = {"Name": "state", "Values": list(LIVE_STATES)}
    requests = _requests(ec2, [scope, live_states])
    untagged = [r for r in _requests(ec2, [live_states, {"Name": "type", "Values": ["persistent"]}])
                if STACK_TAG not in _tags(r)]
    found = []
    if requests:
        live = _live_instances(ec2, scope)
        for req in requests:
            tags = _tags(req)
            owner, instance = tags.get(STACK_TAG, ""), req.get("InstanceId")
            if instance and live.get(instance) == owner:
                continue
            found.append(LeftOver(req["SpotInstanceRequestId"], req.get("State", "?"), instance, owner,
                                  tags.get("Name", "")))
    held = sorted({r["InstanceId"] for r in untagged if r.get("InstanceId")})
    live = _live_instances(ec2, {"Name": "instance-id", "Values": held}) if held else {}
    for req in untagged:
        instance = req.get("InstanceId")
        if instance and live.get(instance):  # a live instance of some stack: its guard cancels it
            continue
        found.append(LeftOver(req["SpotInstanceRequestId"], req.get("State", "?"), instance, "",
                              _tags(req).get("Name", ""), untagged=True))
    return found


def cancel_commands(item: LeftOver, region: str | None) -> list[str]:
    """The AWS CLI commands that end it: cancel the request, then terminate the instance it holds."""
    if not _REQUEST_ID.fullmatch(item.request_id):
        raise UserError(f"EC2 answered an unexpected Spot request id {item.request_id!r}; cancel it in the console")
    where = f" --region {shlex.quote(region)}" if region else ""
    cmds = [f"aws ec2 cancel-spot-instance-requests{where} --spot-instance-request-ids {item.request_id}"]
    if item.instance_id and _INSTANCE_ID.fullmatch(item.instance_id):
        cmds.append(f"aws ec2 terminate-instances{where} --instance-ids {item.instance_id}")
    return cmds


def report(ec2, region: str | None, stack: str | None, say: Say = print) -> None:
    """Print each left-over request and the commands that end it; SpotRequestsLeft when there is any."""
    found = left_over(ec2, stack)
    scope = f"stack {stack}" if stack else "any slurm-gpu stack"
    if not found:
        say(f"no left-over Spot requests of {scope}" + (f" in {region}" if region else ""))
        return
    for item in found:
        holds = f"instance {item.instance_id}" if item.instance_id else "no instance yet"
        if item.untagged:
            say(f"untagged: check: Spot request {item.request_id} ({item.state}, {holds}, no stack tag"
                + (f", {item.name}" if item.name else "") + "): a persistent request of no live stack, maybe of "
                "a stack destroyed before requests were tagged, maybe not slurm-gpu's; check it before cancelling")
        else:
            say(f"left over: Spot request {item.request_id} ({item.state}, {holds}, stack {item.stack or '?'}"
                + (f", {item.name}" if item.name else "") + "): it can launch or restart an instance that bills")
        for cmd in cancel_commands(item, region):
            say(f"  {cmd}")
    raise SpotRequestsLeft(f"{len(found)} left-over Spot request{'s' if len(found) != 1 else ''} of {scope}: "
                           "run the commands above (cancel first: terminating first relaunches a persistent one)")


def ec2_client(region: str | None):
    """EC2 in `region` with the caller's credentials (cluster/aws_session.py); no region anywhere: refused."""
    from botocore.exceptions import NoRegionError

    try:
        return aws_session.ec2_client(region)
    except NoRegionError:
        raise UserError("no AWS region: pass --region REGION (the stack's aws:region)") from None


def run(region: str | None, stack: str | None, say: Say = print) -> None:
    """`fab spot-requests`: report(), with AWS's own failures (no credentials, access denied) as one line."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        report(ec2_client(region), region, stack, say)
    except (BotoCoreError, ClientError) as exc:
        raise UserError(f"could not list Spot requests ({exc}); it needs AWS credentials allowed "
                        "ec2:DescribeSpotInstanceRequests and ec2:DescribeInstances") from None
