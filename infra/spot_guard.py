"""Each spot GPU node's persistent Spot request is cancelled before its instance is deleted.

Why the stack does it itself:
- EC2: terminating an instance launched by a persistent Spot request reopens the request, and EC2
  launches a new instance for it unless the request is cancelled first (EC2 User Guide, "Spot Instance
  requests": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-requests.html); only open, active
  or disabled requests can be cancelled, and cancelling one does not terminate its instance (EC2 User
  Guide, "Cancel a Spot Instance request":
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/using-spot-instances-cancel.html).
- terraform-provider-aws's aws_instance delete (internal/service/ec2/ec2_instance.go,
  resourceInstanceDelete), which pulumi-aws bundles, cancels the request only behind a condition
  that is reported never to hold for spot instances: it first tries ModifyInstanceAttribute
  disableApiTermination, which EC2 refuses for spot instances (UnsupportedOperation), and the
  cleanup is skipped while the destroy reports success (hashicorp/terraform-provider-aws#38142,
  closed; the fix, PR #41206, was still open in the copy we could read). Which upstream version
  pulumi-aws 7.51.1 bundles could not be read here (its upstream submodule is not in the stored
  sources), so the stack does not rely on either.
- aws.ec2.SpotInstanceRequest (whose delete does cancel and terminate) is not used: moving existing
  nodes to it would replace every spot node (a new resource type), and its tags apply to the request,
  not the instance (pulumi_aws 7.51.1 ec2/spot_instance_request.py), while the power program, the quota
  check and fab find nodes by their instance tags.

So each spot node gets a SpotRequestGuard: a Pulumi dynamic resource whose inputs are the node's
instance id and Spot request id. Pulumi deletes a resource's dependents before it, on `pulumi destroy`
and on a delete-before-replace replacement (the nodes' replacements are: infra/nodes.py), where the
engine asks each dependent's provider whether new values of the inputs that depend on the replaced
resource replace it (pulumi/pulumi pkg/resource/deploy/step_generator.go,
calculateDependentReplacements, which reads the old state's inputs and property dependencies, so a
guard the program no longer declares, after a move away from spot, is handled too). The guard's diff
replaces it whenever the instance or request id changes, so its delete, which cancels the request,
runs before the instance is deleted, on every path that removes a spot node: destroy, replacement
(`amiId`, key pair, market change) and removal (gpuNodeCount). Its create tags the request with the
stack's tags (the provider tags only the instance), which is how `fab spot-requests` finds requests
left over (ops/actions/spot_requests.py).

The guard's provider calls EC2 with boto3 from where `pulumi` runs, with the same credentials chain
as the AWS provider (environment, profile) and the stack's region; needed permissions:
ec2:CancelSpotInstanceRequests, ec2:DescribeSpotInstanceRequests, ec2:DescribeInstances, ec2:CreateTags,
ec2:TerminateInstances (and sts:GetCallerIdentity, which needs no permission). boto3 follows `aws:profile`
and `aws:region` only: a spot stack is refused while any other `aws:` setting that picks credentials or
endpoints is set (UNFOLLOWED, check_provider_followable), and the guard records the provider's account at
plan time (aws.get_caller_identity) and refuses to act in another one (delete), so a request is never
judged "not found" in the wrong account.

Never rename or move this module or SpotRequestCanceller: existing stacks' state pins their import path.
pulumi.dynamic serializes the provider by reference (dill; `infra.spot_guard.SpotRequestCanceller`), and
the engine's dynamic-provider plugin (`python -m pulumi.dynamic`, started in the project directory)
loads it from there for every diff, update and delete, destroy included
(tests/unit/test_spot_requests.py loads it so).
"""

from __future__ import annotations

import re
import shlex
import sys
from typing import Any

import pulumi
import pulumi.dynamic

from cluster.aws_session import ec2_client, session

# Spot request states (EC2 API Reference, SpotInstanceRequest.State) in which the request can still
# launch or restart an instance: what cancelling is for.
LIVE_STATES = ("open", "active", "disabled")
# The guard's inputs whose change means another instance or request: the guard is replaced (its delete
# cancels the old request first).
IDENTITY = ("instance_id", "request_id", "region")
_REQUEST_ID = re.compile(r"sir-[0-9a-z]{1,40}")


# `aws:` provider settings that pick credentials or endpoints boto3 would not follow (pulumi_aws 7.51.1
# config/vars.py; terraform-provider-aws's provider configuration: assume_role, endpoints, ...).
UNFOLLOWED = ("accessKey", "secretKey", "token", "assumeRole", "assumeRoles", "assumeRoleWithWebIdentity",
              "sharedCredentialsFiles", "sharedConfigFiles", "endpoints")


class GuardError(Exception):
    """One line for `pulumi up/destroy`: what failed, and the way out."""


def check_provider_followable() -> None:
    """Refuse a spot stack (PlanError) whose AWS provider settings the guard's boto3 cannot follow."""
    from cluster.settings import NAMESPACE
    from infra.config import PlanError

    aws_config = pulumi.Config("aws")
    unfollowed = [k for k in UNFOLLOWED if aws_config.get(k) is not None]
    if unfollowed:
        raise PlanError(
            f"{NAMESPACE}:gpuMarket is spot, but aws:{unfollowed[0]} is set: each spot node's persistent request "
            "is cancelled on destroy by the stack's own EC2 calls (infra/spot_guard.py), which follow only "
            "aws:profile, aws:region and the environment's credentials, and could look in another account. "
            f"Nothing was created. Use a profile instead (`pulumi config rm aws:{unfollowed[0]}`; "
            "`pulumi config set aws:profile NAME`) or another market")


def provider_account() -> str:
    """The AWS account the stack's provider acts in (sts:GetCallerIdentity through the provider)."""
    import pulumi_aws as aws

    return aws.get_caller_identity().account_id


def caller_account(region: str | None, profile: str | None = None) -> str:
    return session(region, profile).client("sts").get_caller_identity()["Account"]


def tag_request(ec2, request_id: str, tags: dict[str, str]) -> None:
    """Tag the Spot request (RunInstances through the provider tags only the instance)."""
    ec2.create_tags(Resources=[request_id], Tags=[{"Key": k, "Value": v} for k, v in sorted(tags.items())])


def cancel_request(ec2, request_id: str, instance_id: str) -> list[str]:
    """Cancel the node's Spot request if it can still launch; terminate any instance it launched other
    than the node's own (one the request relaunched after a termination: Pulumi does not track it).
    The node's own instance is left to its aws.ec2.Instance resource. Returns the instances terminated."""
    try:
        found = ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[request_id])["SpotInstanceRequests"]
    except Exception as exc:
        if _code(exc) == "InvalidSpotInstanceRequestID.NotFound":
            _confirm_gone(ec2, request_id, instance_id)
            return []
        raise
    strays: list[str] = []
    for req in found:
        if req.get("State") in LIVE_STATES:
            ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=[req["SpotInstanceRequestId"]])
        other = req.get("InstanceId")
        if other and other != instance_id:
            strays.append(other)
    if strays:
        ec2.terminate_instances(InstanceIds=strays)
    return strays


def _confirm_gone(ec2, request_id: str, instance_id: str) -> None:
    """EC2 does not know the request: the node's instance must be gone too, or not held by that request
    (else the guard looks in the wrong place and the request may live on: GuardError)."""
    try:
        reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    except Exception as exc:
        if _code(exc) == "InvalidInstanceID.NotFound":
            return
        raise
    for inst in (i for r in reservations for i in r["Instances"]):
        if inst.get("State", {}).get("Name") in ("shutting-down", "terminated"):
            continue
        if inst.get("SpotInstanceRequestId") == request_id:
            raise GuardError(f"EC2 does not know Spot request {request_id}, yet instance {instance_id} still "
                             "runs under it: cannot confirm the request is cancelled")


def _code(exc: Exception) -> str:
    return getattr(exc, "response", {}).get("Error", {}).get("Code", "")


class SpotRequestCanceller(pulumi.dynamic.ResourceProvider):
    """The guard's provider: create tags the request, delete cancels it (module docstring).
    Never rename or move this class or its module: existing stacks' state pins its import path."""

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        outs = dict(props)
        if props.get("request_id"):  # none: the instance is not (or no longer) a spot one
            outs["warning"] = _tag_or_warn(props)
        return pulumi.dynamic.CreateResult(id_=props.get("request_id") or f"none-{props['instance_id']}", outs=outs)

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        replaces = [k for k in IDENTITY if olds.get(k) != news.get(k)]
        changed = replaces or [k for k in ("tags", "profile", "account") if olds.get(k) != news.get(k)]
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=replaces, delete_before_replace=True)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        outs = dict(news)
        if news.get("request_id"):
            outs["warning"] = _tag_or_warn(news)
        return pulumi.dynamic.UpdateResult(outs=outs)

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        if not props.get("request_id"):
            return
        from botocore.exceptions import BotoCoreError, ClientError

        region, profile = props.get("region"), props.get("profile")
        try:
            account = props.get("account")  # none: a guard made before it was recorded
            if account and (now := caller_account(region, profile)) != account:
                raise GuardError(f"the credentials here are for account {now}, but the stack's nodes are in "
                                 f"account {account}: set AWS_PROFILE (or aws:profile) to that account's")
            cancel_request(ec2_client(region, profile), props["request_id"], props["instance_id"])
        except (GuardError, BotoCoreError, ClientError) as exc:
            raise GuardError(way_out(props, exc)) from None


def way_out(props: dict[str, Any], exc: Exception) -> str:
    """One line: why the request could not be cancelled here, and how to do it by hand."""
    where = f" --region {shlex.quote(props['region'])}" if props.get("region") else ""
    rid = props["request_id"] if _REQUEST_ID.fullmatch(str(props.get("request_id"))) else "SPOT_REQUEST_ID"
    return (f"could not cancel Spot request {rid} of instance {props.get('instance_id')} "
            f"({_first_line(exc)}); the guard needs AWS credentials for the stack's account (AWS_PROFILE or "
            "aws:profile) allowed ec2:DescribeSpotInstanceRequests, ec2:CancelSpotInstanceRequests, "
            "ec2:DescribeInstances and ec2:TerminateInstances. Or cancel it yourself: "
            f"`aws ec2 cancel-spot-instance-requests{where} --spot-instance-request-ids {rid}`, then "
            "`pulumi state delete URN` for this guard (URN from `pulumi stack --show-urns`) and run the "
            "command again")


def _tag_or_warn(props: dict[str, Any]) -> str:
    """Tag the request; a failure is a warning (in the guard's outputs and on stderr), not a failed
    create: the guard must land in the state, or a later destroy would not cancel the request."""
    try:
        tag_request(ec2_client(props.get("region"), props.get("profile")), props["request_id"], props["tags"])
        return ""
    except Exception as exc:
        warning = (f"could not tag Spot request {props['request_id']} ({_first_line(exc)}): "
                   "`fab spot-requests` lists it as untagged; the guard still cancels it")
        print(f"warning: {warning}", file=sys.stderr)
        return warning


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class SpotRequestGuard(pulumi.dynamic.Resource):
    """Cancels `node`'s persistent Spot request before the node is deleted (module docstring)."""

    def __init__(self, name: str, *, node, region: str | None, account: str | None, tags: dict[str, str],
                 opts: pulumi.ResourceOptions | None = None):
        profile = pulumi.Config("aws").get("profile")
        super().__init__(
            SpotRequestCanceller(), name,
            {"instance_id": node.id, "request_id": node.spot_instance_request_id, "region": region,
             "profile": profile, "account": account, "tags": tags, "warning": None},
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[node],
                                                                      delete_before_replace=True)))
