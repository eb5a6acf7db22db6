"""Persistent Spot requests never outlive their node: the program declares, for each spot GPU node, a guard
that Pulumi deletes before the node on every path (destroy, replacement, removal) and whose delete cancels
the request (infra/spot_guard.py, under Pulumi mocks and botocore's Stubber); `fab spot-requests` lists any
left over with the commands that end them (ops/actions/spot_requests.py, Stubber)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from botocore.stub import ANY, Stubber

from cluster.facts import STACK_TAG
from infra import spot_guard
from ops.actions import spot_requests
from tests.support.pulumi_mocks import ACCOUNT, run_program, stack_config

DYNAMIC = "pulumi-python:dynamic:Resource"
REPO = Path(__file__).resolve().parents[2]
STACK = "slurm-gpu/test"  # stack_name() under the mocks (no organization)


def ec2_client():
    import botocore.session

    return botocore.session.get_session().create_client(
        "ec2", region_name="ap-northeast-2", aws_access_key_id="test", aws_secret_access_key="test")


def guards_and_nodes(run):
    guards = [r for r in run.mocks.resources if r.typ == DYNAMIC]
    nodes = {r.urn: r for r in run.of_type("instance") if r.inputs["tags"]["Role"] == "gpu"}
    return guards, nodes


# ------------------------------------------------------------ what the program declares

def test_each_spot_node_has_a_guard_deleted_before_it_that_holds_its_request():
    run = run_program(stack_config(gpuMarket="spot", gpuNodeCount=3))
    guards, nodes = guards_and_nodes(run)
    assert len(guards) == len(nodes) == 3
    guarded = set()
    for guard in guards:
        # Depends on its node (so destroy deletes the guard, which cancels, before the node) ...
        (node_urn,) = [d for d in guard.dependencies if d in nodes]
        node = nodes[node_urn]
        guarded.add(node_urn)
        # ... through the inputs that identify the node and its request, so a node replacement
        # (delete-before-replace) replaces the guard first (the engine's dependent replacement asks
        # the guard's diff with those inputs unknown: below).
        assert guard.inputs["instance_id"] == f"{node.name}-id"
        assert guard.inputs["request_id"] == f"sir-{node.name}"
        assert guard.inputs["region"] == "ap-northeast-2"
        assert guard.delete_before_replace and node.delete_before_replace
        assert guard.inputs["tags"] == {**node.inputs["tags"], STACK_TAG: STACK}
        assert "__provider" in guard.inputs  # the serialized SpotRequestCanceller
    assert guarded == set(nodes)


@pytest.mark.parametrize("market", [{}, {"gpuMarket": "capacity-block", "capacityReservationId": "cr-0fedcba9876543210"}])
def test_no_guard_outside_spot(market):
    from tests.support.pulumi_mocks import ClusterMocks, capacity_block_result

    mocks = ClusterMocks(capacity_blocks={"cr-0fedcba9876543210": capacity_block_result("cr-0fedcba9876543210")})
    run = run_program(stack_config(**market, gpuInstanceType="p5.48xlarge") if market else stack_config(), mocks)
    assert guards_and_nodes(run)[0] == []


def test_the_guard_is_replaced_first_whenever_its_node_or_request_changes():
    """What the engine's calculateDependentReplacements asks: the old inputs with those that depend on the
    replaced node unknown. A replace with delete-before-replace means its delete (the cancel) runs first;
    that holds for a guard the program no longer declares too (a move away from spot)."""
    from pulumi.runtime import rpc

    provider = spot_guard.SpotRequestCanceller()
    olds = {"instance_id": "i-0aaa", "request_id": "sir-0aaa", "region": "ap-northeast-2", "tags": {"a": "1"}}
    for news in ({**olds, "instance_id": rpc.UNKNOWN, "request_id": rpc.UNKNOWN},
                 {**olds, "instance_id": "i-0bbb", "request_id": "sir-0bbb"}):
        diff = provider.diff("sir-0aaa", olds, news)
        assert diff.changes and diff.delete_before_replace
        assert set(diff.replaces) == {"instance_id", "request_id"}
    same = provider.diff("sir-0aaa", olds, dict(olds))
    assert not same.changes and same.replaces == []
    retagged = provider.diff("sir-0aaa", olds, {**olds, "tags": {"a": "2"}})
    assert retagged.changes and retagged.replaces == []  # tags: an update, not a cancel


# ------------------------------------------------------------ the guard's EC2 calls

def request(rid="sir-0aaa", state="active", instance="i-0aaa"):
    return {"SpotInstanceRequestId": rid, "State": state, **({"InstanceId": instance} if instance else {})}


def test_delete_cancels_a_live_request_and_leaves_the_node_to_its_instance_resource():
    ec2 = ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": [request(state="disabled")]},
                          {"SpotInstanceRequestIds": ["sir-0aaa"]})
        stub.add_response("cancel_spot_instance_requests", {}, {"SpotInstanceRequestIds": ["sir-0aaa"]})
        assert spot_guard.cancel_request(ec2, "sir-0aaa", "i-0aaa") == []
        stub.assert_no_pending_responses()


def test_delete_also_terminates_an_instance_the_request_relaunched():
    ec2 = ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_instance_requests",
                          {"SpotInstanceRequests": [request(instance="i-0fff")]}, {"SpotInstanceRequestIds": ["sir-0aaa"]})
        stub.add_response("cancel_spot_instance_requests", {}, {"SpotInstanceRequestIds": ["sir-0aaa"]})
        stub.add_response("terminate_instances", {}, {"InstanceIds": ["i-0fff"]})
        assert spot_guard.cancel_request(ec2, "sir-0aaa", "i-0aaa") == ["i-0fff"]
        stub.assert_no_pending_responses()


def test_delete_of_a_request_already_gone_does_nothing():
    ec2 = ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_instance_requests",
                          {"SpotInstanceRequests": [request(state="cancelled")]}, {"SpotInstanceRequestIds": ["sir-0aaa"]})
        assert spot_guard.cancel_request(ec2, "sir-0aaa", "i-0aaa") == []
        stub.add_client_error("describe_spot_instance_requests", "InvalidSpotInstanceRequestID.NotFound", "gone")
        stub.add_client_error("describe_instances", "InvalidInstanceID.NotFound", "gone",
                              expected_params={"InstanceIds": ["i-0aaa"]})
        assert spot_guard.cancel_request(ec2, "sir-0aaa", "i-0aaa") == []
        stub.assert_no_pending_responses()


def instance(state="stopped", request="sir-0aaa"):
    return {"Reservations": [{"Instances": [{"InstanceId": "i-0aaa", "State": {"Name": state, "Code": 80},
                                             **({"SpotInstanceRequestId": request} if request else {})}]}]}


@pytest.mark.parametrize("answer,ok", [
    (instance("terminated"), True),  # gone with its instance
    (instance(request=None), True),  # the node is no longer a spot instance
    (instance("stopped"), False),  # its instance still names it: the guard looks in the wrong place
])
def test_a_request_ec2_does_not_know_is_done_only_once_its_instance_confirms_it(answer, ok):
    ec2 = ec2_client()
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_spot_instance_requests", "InvalidSpotInstanceRequestID.NotFound", "gone")
        stub.add_response("describe_instances", answer, {"InstanceIds": ["i-0aaa"]})
        if ok:
            assert spot_guard.cancel_request(ec2, "sir-0aaa", "i-0aaa") == []
        else:
            with pytest.raises(spot_guard.GuardError, match="still runs under it"):
                spot_guard.cancel_request(ec2, "sir-0aaa", "i-0aaa")
        stub.assert_no_pending_responses()


PROPS = {"instance_id": "i-0aaa", "request_id": "sir-0aaa", "region": "ap-northeast-2", "profile": None,
         "account": ACCOUNT, "tags": {STACK_TAG: STACK}}


def test_the_guard_records_the_providers_account_and_never_acts_in_another(monkeypatch):
    run = run_program(stack_config(gpuMarket="spot", gpuNodeCount=1))
    (guard,), _ = guards_and_nodes(run)
    assert guard.inputs["account"] == ACCOUNT
    monkeypatch.setattr(spot_guard, "caller_account", lambda *a: "999988887777")
    monkeypatch.setattr(spot_guard, "ec2_client", lambda *a: pytest.fail("no EC2 call in another account"))
    with pytest.raises(spot_guard.GuardError) as err:
        spot_guard.SpotRequestCanceller().delete("sir-0aaa", PROPS)
    text = str(err.value)
    assert "\n" not in text and "account 999988887777" in text and f"account {ACCOUNT}" in text
    assert "aws ec2 cancel-spot-instance-requests --region ap-northeast-2 --spot-instance-request-ids sir-0aaa" in text
    assert "`pulumi state delete URN`" in text


@pytest.mark.parametrize("key", spot_guard.UNFOLLOWED)
def test_a_spot_stack_whose_provider_settings_the_guard_cannot_follow_is_refused(key):
    from infra.config import PlanError

    with pytest.raises(PlanError, match=f"^slurm-gpu:gpuMarket is spot, but aws:{key} is set") as err:
        run_program({**stack_config(gpuMarket="spot"), f"aws:{key}": "x"})
    assert "Nothing was created" in str(err.value)
    run_program({**stack_config(), f"aws:{key}": "x"})  # on-demand: nothing to cancel, no refusal


def test_destroy_without_credentials_is_one_line_with_the_way_out(monkeypatch):
    from botocore.exceptions import NoCredentialsError

    def no_credentials(*a):
        raise NoCredentialsError()

    monkeypatch.setattr(spot_guard, "caller_account", no_credentials)
    with pytest.raises(spot_guard.GuardError) as err:
        spot_guard.SpotRequestCanceller().delete("sir-0aaa", PROPS)
    text = str(err.value)
    assert "\n" not in text and "Unable to locate credentials" in text and "AWS_PROFILE" in text
    assert "--spot-instance-request-ids sir-0aaa" in text and "pulumi state delete" in text
    # EC2 refusing a call is the same line, naming what it refused.
    ec2 = ec2_client()
    monkeypatch.setattr(spot_guard, "caller_account", lambda *a: ACCOUNT)
    monkeypatch.setattr(spot_guard, "ec2_client", lambda *a: ec2)
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_spot_instance_requests", "UnauthorizedOperation", "not authorized")
        with pytest.raises(spot_guard.GuardError, match="UnauthorizedOperation.*ec2:CancelSpotInstanceRequests"):
            spot_guard.SpotRequestCanceller().delete("sir-0aaa", PROPS)


def test_a_tagging_failure_warns_and_the_guard_still_lands_in_the_state(monkeypatch, capsys):
    ec2 = ec2_client()
    monkeypatch.setattr(spot_guard, "ec2_client", lambda *a: ec2)
    with Stubber(ec2) as stub:
        stub.add_client_error("create_tags", "UnauthorizedOperation", "not authorized")
        made = spot_guard.SpotRequestCanceller().create(PROPS)
    assert made.id == "sir-0aaa" and made.outs["request_id"] == "sir-0aaa"
    assert "could not tag Spot request sir-0aaa" in made.outs["warning"]
    assert "could not tag" in capsys.readouterr().err


def load_serialized_provider(cwd: str) -> subprocess.CompletedProcess:
    """What the engine's dynamic-provider plugin does with the guard's state: `python -m pulumi.dynamic`
    (started in the project directory: the cwd is on sys.path) runs dill.loads on it."""
    from pulumi.dynamic.dynamic import serialize_provider

    pickled = serialize_provider(spot_guard.SpotRequestCanceller())
    code = ("import base64, sys, dill; p = dill.loads(base64.b64decode(sys.argv[1])); "
            "print(type(p).__module__, type(p).__name__)")
    return subprocess.run([sys.executable, "-c", code, pickled], cwd=cwd, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_the_state_pins_the_providers_import_path_so_it_must_never_move():
    """Renaming or moving infra/spot_guard.py or SpotRequestCanceller would break diff and delete (destroy)
    for every existing stack: the pickle names it, and only the project directory resolves it."""
    here = load_serialized_provider(str(REPO))
    assert here.returncode == 0, here.stderr
    assert here.stdout.split() == ["infra.spot_guard", "SpotRequestCanceller"]
    assert "never rename or move" in inspect.getsource(spot_guard).lower()
    elsewhere = load_serialized_provider("/")
    assert elsewhere.returncode != 0 and "No module named 'infra'" in elsewhere.stderr
    # The plugin starts in the project directory, which is the repository root: no `main:` elsewhere.
    assert not re.search(r"(?m)^main:", (REPO / "Pulumi.yaml").read_text())


def test_create_tags_the_request_with_the_stack():
    ec2 = ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("create_tags", {}, {"Resources": ["sir-0aaa"], "Tags": [
            {"Key": "Cluster", "Value": "mini"}, {"Key": STACK_TAG, "Value": STACK}]})
        spot_guard.tag_request(ec2, "sir-0aaa", {STACK_TAG: STACK, "Cluster": "mini"})
        stub.assert_no_pending_responses()


# ------------------------------------------------------------ fab spot-requests

def test_fab_and_the_stack_agree_on_the_live_states():
    assert spot_requests.LIVE_STATES == spot_guard.LIVE_STATES


def tagged(req: dict, stack=STACK, name="mini-gpu-node-01") -> dict:
    return {**req, "Tags": [{"Key": STACK_TAG, "Value": stack}, {"Key": "Name", "Value": name}]}


def test_left_over_requests_are_listed_with_the_commands_that_end_them():
    """Three live requests of the stack: one whose instance is a live node of the stack (fine), one whose
    instance is gone after a destroy (open, no instance), one holding an instance the stack does not know."""
    ec2, lines = ec2_client(), []
    scope = {"Name": f"tag:{STACK_TAG}", "Values": [STACK]}
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": [
            tagged(request("sir-0aaa", "active", "i-0aaa")),
            tagged(request("sir-0bbb", "open", None), name="mini-gpu-node-02"),
            tagged(request("sir-0ccc", "active", "i-0ccc"), name="mini-gpu-node-03")]},
            {"Filters": [scope, {"Name": "state", "Values": ["open", "active", "disabled"]}]})
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": []}, PERSISTENT)
        stub.add_response("describe_instances", {"Reservations": [{"Instances": [
            {"InstanceId": "i-0aaa", "Tags": [{"Key": STACK_TAG, "Value": STACK}]}]}]},
            {"Filters": [scope, {"Name": "instance-state-name", "Values": ["pending", "running", "stopping",
                                                                           "stopped"]}]})
        with pytest.raises(spot_requests.SpotRequestsLeft, match="2 left-over Spot requests of stack slurm-gpu/test"):
            spot_requests.report(ec2, "ap-northeast-2", STACK, say=lines.append)
        stub.assert_no_pending_responses()
    assert lines == [
        "left over: Spot request sir-0bbb (open, no instance yet, stack slurm-gpu/test, mini-gpu-node-02): "
        "it can launch or restart an instance that bills",
        "  aws ec2 cancel-spot-instance-requests --region ap-northeast-2 --spot-instance-request-ids sir-0bbb",
        "left over: Spot request sir-0ccc (active, instance i-0ccc, stack slurm-gpu/test, mini-gpu-node-03): "
        "it can launch or restart an instance that bills",
        "  aws ec2 cancel-spot-instance-requests --region ap-northeast-2 --spot-instance-request-ids sir-0ccc",
        "  aws ec2 terminate-instances --region ap-northeast-2 --instance-ids i-0ccc",
    ]


PERSISTENT = {"Filters": [{"Name": "state", "Values": ["open", "active", "disabled"]},
                          {"Name": "type", "Values": ["persistent"]}]}


def test_untagged_persistent_requests_of_no_live_stack_are_listed_to_check():
    """Requests of stacks destroyed before requests were tagged carry no stack tag: each live persistent
    one whose instance is gone or untagged is listed, marked to check (it may not be slurm-gpu's)."""
    ec2, lines = ec2_client(), []
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": []},
                          {"Filters": [{"Name": "tag-key", "Values": [STACK_TAG]}, ANY]})
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": [
            request("sir-0ddd", "open", None),  # its instance gone: relaunches one
            request("sir-0eee", "disabled", "i-0eee"),  # an untagged instance
            request("sir-0fff", "active", "i-0fff"),  # a live stack's node (its tagging failed): fine
            tagged(request("sir-0aaa", "active", "i-0aaa"))]}, PERSISTENT)  # tagged: judged above
        stub.add_response("describe_instances", {"Reservations": [{"Instances": [
            {"InstanceId": "i-0eee", "Tags": [{"Key": "Name", "Value": "other"}]},
            {"InstanceId": "i-0fff", "Tags": [{"Key": STACK_TAG, "Value": STACK}]}]}]},
            {"Filters": [{"Name": "instance-id", "Values": ["i-0eee", "i-0fff"]}, ANY]})
        with pytest.raises(spot_requests.SpotRequestsLeft, match="2 left-over"):
            spot_requests.report(ec2, "ap-northeast-2", None, say=lines.append)
        stub.assert_no_pending_responses()
    assert [line.split(" (")[0] for line in lines if not line.startswith("  ")] == [
        "untagged: check: Spot request sir-0ddd", "untagged: check: Spot request sir-0eee"]
    assert "  aws ec2 cancel-spot-instance-requests --region ap-northeast-2 --spot-instance-request-ids sir-0ddd" in lines


def test_no_left_over_request_is_one_line_and_success():
    ec2, lines = ec2_client(), []
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": []},
                          {"Filters": [{"Name": "tag-key", "Values": [STACK_TAG]}, ANY]})
        stub.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": []}, PERSISTENT)
        spot_requests.report(ec2, "ap-northeast-2", None, say=lines.append)
    assert lines == ["no left-over Spot requests of any slurm-gpu stack in ap-northeast-2"]


def test_an_unexpected_request_id_never_reaches_a_command():
    bad = spot_requests.LeftOver("sir-1; rm -rf ~", "open", None, STACK, "")
    with pytest.raises(spot_requests.UserError, match="unexpected Spot request id"):
        spot_requests.cancel_commands(bad, "ap-northeast-2")


def test_a_node_without_a_request_id_makes_no_ec2_call(monkeypatch):
    """The provider reads no request id for an instance that is not a spot one: nothing to tag or cancel."""
    monkeypatch.setattr(spot_guard, "ec2_client", lambda *a: pytest.fail("no EC2 call expected"))
    provider = spot_guard.SpotRequestCanceller()
    props = {"instance_id": "i-0aaa", "request_id": "", "region": "ap-northeast-2", "tags": {}}
    assert provider.create(props).id == "none-i-0aaa"
    provider.update("none-i-0aaa", props, props)
    provider.delete("none-i-0aaa", props)


def test_aws_failures_are_one_line_naming_the_permissions(monkeypatch):
    ec2 = ec2_client()
    monkeypatch.setattr(spot_requests, "ec2_client", lambda region: ec2)
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_spot_instance_requests", "UnauthorizedOperation", "not authorized")
        with pytest.raises(spot_requests.UserError, match="ec2:DescribeSpotInstanceRequests"):
            spot_requests.run("ap-northeast-2", None, say=lambda line: None)
