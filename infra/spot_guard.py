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
ec2:CancelSpotInstanceRequests, ec2:DescribeSpotInstanceRequests, ec2:CreateTags, ec2:TerminateInstances.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi.dynamic

from cluster.aws_session import ec2_client

# Spot request states (EC2 API Reference, SpotInstanceRequest.State) in which the request can still
# launch or restart an instance: what cancelling is for.
LIVE_STATES = ("open", "active", "disabled")
# The guard's inputs whose change means another instance or request: the guard is replaced (its delete
# cancels the old request first).
IDENTITY = ("instance_id", "request_id", "region")




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


def _code(exc: Exception) -> str:
    return getattr(exc, "response", {}).get("Error", {}).get("Code", "")


class SpotRequestCanceller(pulumi.dynamic.ResourceProvider):
    """The guard's provider: create tags the request, delete cancels it (module docstring)."""

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        if props.get("request_id"):  # none: the instance is not (or no longer) a spot one
            tag_request(ec2_client(props.get("region"), props.get("profile")), props["request_id"], props["tags"])
        return pulumi.dynamic.CreateResult(id_=props.get("request_id") or f"none-{props['instance_id']}", outs=props)

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        replaces = [k for k in IDENTITY if olds.get(k) != news.get(k)]
        changed = replaces or [k for k in ("tags", "profile") if olds.get(k) != news.get(k)]
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=replaces, delete_before_replace=True)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        if news.get("request_id"):
            tag_request(ec2_client(news.get("region"), news.get("profile")), news["request_id"], news["tags"])
        return pulumi.dynamic.UpdateResult(outs=news)

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        if not props.get("request_id"):
            return
        cancel_request(ec2_client(props.get("region"), props.get("profile")), props["request_id"],
                       props["instance_id"])


class SpotRequestGuard(pulumi.dynamic.Resource):
    """Cancels `node`'s persistent Spot request before the node is deleted (module docstring)."""

    def __init__(self, name: str, *, node, region: str | None, tags: dict[str, str],
                 opts: pulumi.ResourceOptions | None = None):
        profile = pulumi.Config("aws").get("profile")
        super().__init__(
            SpotRequestCanceller(), name,
            {"instance_id": node.id, "request_id": node.spot_instance_request_id, "region": region,
             "profile": profile, "tags": tags},
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[node],
                                                                      delete_before_replace=True)))
