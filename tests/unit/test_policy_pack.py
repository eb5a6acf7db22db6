"""The CrossGuard policy pack (policy/), run offline on the resources of the mocked program.

The Pulumi engine cannot run here, so the tests play its part: the program runs under
the mocks of tests/support/pulumi_mocks.py, and each resource it registers is handed to the
pack's real analyzer service (pulumi_policy's _PolicyAnalyzerServicer) as the engine
would send it: an AnalyzeRequest per resource (its inputs, camelCase) and one
AnalyzeStackRequest (outputs, with ids, parents and property dependencies). The
service does the engine-facing work itself (protobuf decoding, unknown-value proxies,
enforcement levels); only its gRPC server is left out.

Every policy has a passing case (the real program's resources) and violations (the same
resources with one property changed), each with its expected message.
"""

from __future__ import annotations

import base64
import copy
import gzip
import importlib.metadata
import json
import os
import re
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pulumi_policy
import pytest
import yaml
from google.protobuf import json_format, struct_pb2
from pulumi.runtime.proto import analyzer_pb2 as proto
from pulumi_policy import EnforcementLevel
from pulumi_policy.policy import _PolicyAnalyzerServicer
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

import tests.support.pulumi_mocks as harness
from policy import rules
from tests.support.pulumi_mocks import stack_config

REPO = Path(__file__).resolve().parents[2]
POLICY_DIR = REPO / "policy"
ADMIN_CIDR = harness.ADMIN_CIDR


# ------------------------------------------------------------ the stack

@dataclass
class Res:
    """One registered custom resource as the engine would show it to the analyzer."""

    typ: str
    name: str
    urn: str
    id: str
    parent: str
    dependencies: list[str]
    property_dependencies: dict[str, list[str]]
    inputs: dict
    outputs: dict = field(default_factory=dict)


class _DepsMonitor(harness.RecordingMonitor):
    """The harness's monitor, also keeping what the engine passes on to stack policies:
    each resource's id and per-property dependencies."""

    def __init__(self, mocks):
        super().__init__(mocks)
        self.ids: dict[str, str] = {}
        self.property_deps: dict[str, dict[str, list[str]]] = {}

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        self.ids[response.urn] = response.id
        self.property_deps[response.urn] = {
            k: list(v.urns) for k, v in request.propertyDependencies.items()
        }
        return response


def declare(**config) -> list[Res]:
    """Run the program under mocks; its custom resources with inputs and outputs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "RecordingMonitor", _DepsMonitor)
        run = harness.run_program(stack_config(**config))
    monitor = run.monitor
    out = []
    for r in run.resources:
        assert r.urn, f"{r.name} was not registered through the monitor"
        rid = monitor.ids[r.urn]
        state = dict(r.inputs)
        # Outputs the provider computes (the mocks answer like the provider does).
        if r.typ == rules.PLACEMENT_GROUP:
            state["name"] = f"{r.name}-4d5e6f"
        if r.typ == rules.KEY_PAIR:
            state["keyName"] = f"{r.name}-1a2b3c"
        out.append(Res(r.typ, r.name, r.urn, rid, r.parent, list(r.dependencies),
                       monitor.property_deps[r.urn], dict(r.inputs), {**state, "id": rid}))
    return out


@pytest.fixture(scope="module")
def cluster() -> list[Res]:
    return declare()


def one(stack: list[Res], suffix: str) -> Res:
    found = [r for r in stack if r.name.endswith(suffix)]
    assert len(found) == 1, f"expected one resource named *{suffix}, found {[r.name for r in found]}"
    return found[0]


# ---------------------------------------------------- the analyzer service

def servicer() -> _PolicyAnalyzerServicer:
    return _PolicyAnalyzerServicer(rules.PACK_NAME, "0.0.1", rules.policies(), EnforcementLevel.MANDATORY)


def _struct(props: dict) -> struct_pb2.Struct:
    return json_format.ParseDict(props, struct_pb2.Struct())


@dataclass(frozen=True)
class Finding:
    policy: str
    message: str
    urn: str
    mandatory: bool


def _findings(response) -> list[Finding]:
    return [Finding(d.policyName, d.message, d.urn, d.enforcementLevel == proto.MANDATORY)
            for d in response.diagnostics]


def analyze(stack: list[Res]) -> list[Finding]:
    """Resource policies on every resource's inputs, as during preview/up."""
    svc, found = servicer(), []
    for r in stack:
        req = proto.AnalyzeRequest(type=r.typ, properties=_struct(r.inputs), urn=r.urn, name=r.name)
        found += [f if f.urn else Finding(f.policy, f.message, r.urn, f.mandatory)
                  for f in _findings(svc.Analyze(req, None))]
    return found


def analyze_stack(stack: list[Res], props: str = "outputs") -> list[Finding]:
    """Stack policies on the whole stack."""
    req = proto.AnalyzeStackRequest(resources=[
        proto.AnalyzerResource(
            type=r.typ, properties=_struct(getattr(r, props)), urn=r.urn, name=r.name,
            parent=r.parent, dependencies=r.dependencies,
            propertyDependencies={k: proto.AnalyzerPropertyDependencies(urns=v)
                                  for k, v in r.property_dependencies.items()},
        )
        for r in stack
    ])
    return _findings(servicer().AnalyzeStack(req, None))


def as_preview(stack: list[Res]) -> list[Res]:
    """The stack as `pulumi preview` sees it before anything exists: every id and
    provider-computed name is unknown; only the property dependencies link resources."""
    stack = copy.deepcopy(stack)
    computed = {r.id for r in stack} | {r.outputs.get("name") for r in stack} | \
               {r.outputs.get("keyName") for r in stack}
    computed.discard(None)

    def blank(value):
        if isinstance(value, dict):
            return {k: blank(v) for k, v in value.items()}
        if isinstance(value, list):
            return [blank(v) for v in value]
        return UNKNOWN_STRING_VALUE if isinstance(value, str) and value in computed else value

    for r in stack:
        r.outputs = blank({k: v for k, v in r.outputs.items() if k not in ("id", "name", "keyName")})
        r.inputs = blank(r.inputs)
    return stack


# ------------------------------------------------------------ passing

@pytest.mark.parametrize("config", [
    {},
    {"gpuNodeCount": 4, "gpuInstanceType": "p5.48xlarge"},
    {"gpuNodeCount": 3, "gpuInstanceType": "g6.48xlarge"},
    {"efa": False, "gpuNodeCount": 1, "gpuInstanceType": "g4dn.xlarge"},
    {"ebsKmsKeyId": harness.CMK},
], ids=["default", "4xp5", "3xg6.48", "no-efa", "cmk"])
def test_the_programs_resources_pass_every_policy(config):
    stack = declare(**config)
    types = {r.typ for r in stack}
    # The policies had something to look at (not a vacuous pass).
    assert {rules.INSTANCE, rules.SECURITY_GROUP, rules.VPC_INGRESS, rules.VPC_EGRESS,
            rules.KEY_PAIR, rules.PLACEMENT_GROUP} <= types
    if config.get("idleStopMinutes") != 0:
        assert rules.IAM_ROLE_POLICY in types  # the power-save role's policy was checked too
    assert analyze(stack) == []
    assert analyze_stack(stack) == []


def test_stack_policies_see_efa_nodes_in_the_real_program(cluster):
    """The EFA rules apply to the program as it is: every GPU node is an EFA node."""
    from pulumi_policy.policy import PolicyResource

    def policy_resource(r):
        return PolicyResource(r.typ, r.outputs, r.urn, r.name, None, None, None, [], {})

    resources = [policy_resource(r) for r in cluster]
    efa = rules._efa_instances(resources)
    assert sorted(inst.name for inst, _ in efa) == ["mini-nodes-gpu-node-01", "mini-nodes-gpu-node-02"]
    assert all(eni.props["interfaceType"] == "efa" for _, enis in efa for eni in enis)


def test_stack_policies_work_during_preview_through_property_dependencies(cluster):
    preview = as_preview(cluster)
    gpu = one(preview, "gpu-node-01")
    assert gpu.outputs["placementGroup"] == UNKNOWN_STRING_VALUE  # really unknown
    assert analyze_stack(preview) == []
    # ...and still catch a violation with ids unknown.
    no_self_egress = [r for r in preview if not r.name.endswith("all-to-self")]
    found = analyze_stack(no_self_egress)
    assert [f.policy for f in found] == ["efa-security-group-self-rules"]
    assert "no all-traffic egress rule to itself" in found[0].message


def test_resource_policies_wait_for_unknown_values_in_preview(cluster):
    """A value unknown during preview is reported by the SDK as advisory, not as a pass
    or a mandatory failure; `pulumi up` then checks the real value."""
    ssh = copy.deepcopy(one(cluster, "ssh-from-admin"))
    ssh.inputs["cidrIpv4"] = UNKNOWN_STRING_VALUE
    found = analyze([ssh])
    assert found and all(not f.mandatory for f in found)
    assert all("can't run policy" in f.message for f in found)


# ------------------------------------------------------------ violations

def _mutate(stack: list[Res], suffix: str, change) -> list[Res]:
    stack = copy.deepcopy(stack)
    r = one(stack, suffix)
    r.typ = getattr(change, "new_type", r.typ)
    change(r.inputs)
    change(r.outputs)
    return stack


def _set(**values):
    def change(props):
        for key, value in values.items():
            if value is None:
                props.pop(key, None)
            else:
                props[key] = value
    return change


def _nested(key, **values):
    def change(props):
        props[key] = {**props.get(key, {}), **values}
    return change


MUNGE_KEY = os.urandom(1024)  # the size Debian's create-munge-key writes
MUNGE_B64 = base64.b64encode(MUNGE_KEY).decode()
PRIVATE_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\n"
               "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
               "-----END OPENSSH PRIVATE KEY-----\n")


def _user_data(props) -> dict:
    """The cloud-config the stack gives an instance (userDataBase64: gzip, as EC2 gets it)."""
    return yaml.safe_load(gzip.decompress(base64.b64decode(props["userDataBase64"])))


def _cloud_config(edit):
    """Edit the cloud-config and hand it over as plain userData (the policy reads both inputs)."""
    def change(props):
        doc = _user_data(props)
        edit(doc)
        del props["userDataBase64"]
        props["userData"] = "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False)
    return change


def _as_legacy_rule(props):
    """The SSH rule re-expressed as an aws:ec2/securityGroupRule (the older style)."""
    sg = props.pop("securityGroupId")
    props.clear()
    props.update(type="ingress", protocol="tcp", fromPort=22, toPort=22,
                 cidrBlocks=["0.0.0.0/0"], securityGroupId=sg)


_as_legacy_rule.new_type = rules.SG_RULE


def _gzip_user_data_with_private_key(props):
    doc = _user_data(props)
    doc["write_files"].append({"path": "/root/.ssh/id_ed25519", "content": PRIVATE_KEY})
    text = "#cloud-config\n" + yaml.safe_dump(doc)
    props["userDataBase64"] = base64.b64encode(gzip.compress(text.encode())).decode()


def _policy_doc(edit):
    """Edit the first statement (stop/start) of an IAM policy document property."""
    def change(props):
        doc = json.loads(props["policy"])
        edit(doc["Statement"][0])
        props["policy"] = json.dumps(doc)
    return change


RESOURCE_CASES = [
    # (id, resource suffix, change, policies expected to fire, message pattern)
    ("ssh-from-anywhere-v4", "ssh-from-admin", _set(cidrIpv4="0.0.0.0/0"),
     {"ssh-not-open-to-internet"},
     r"cidrIpv4: tcp port 22 from 0\.0\.0\.0/0 opens SSH \(port 22\) to the whole internet; "
     r"allow SSH only from your adminCidr"),
    ("range-holding-22-from-anywhere-v6", "ssh-from-admin",
     _set(cidrIpv4=None, cidrIpv6="::/0", fromPort=0, toPort=1024),
     {"ssh-not-open-to-internet", "only-ssh-from-outside"},
     r"cidrIpv6: tcp ports 0-1024 from ::/0 opens SSH"),
    ("all-traffic-from-anywhere", "all-from-self",
     _set(referencedSecurityGroupId=None, cidrIpv4="0.0.0.0/0"),
     {"ssh-not-open-to-internet", "only-ssh-from-outside"},
     r"cidrIpv4: all traffic from 0\.0\.0\.0/0 opens SSH"),
    ("legacy-rule-ssh-from-anywhere", "ssh-from-admin", _as_legacy_rule,
     {"ssh-not-open-to-internet"}, r"rule: tcp port 22 from 0\.0\.0\.0/0 opens SSH"),
    ("inline-sg-ssh-from-anywhere", "sec-sg",
     _set(ingress=[{"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["0.0.0.0/0"]}]),
     {"ssh-not-open-to-internet"}, r"ingress\[0\]: tcp port 22 from 0\.0\.0\.0/0 opens SSH"),
    ("other-port-from-admin", "ssh-from-admin", _set(fromPort=443, toPort=443),
     {"only-ssh-from-outside"},
     rf"cidrIpv4: tcp port 443 from {re.escape(ADMIN_CIDR)}: only SSH \(tcp 22\) may enter"),
    ("imdsv1-allowed", "nodes-controller", _nested("metadataOptions", httpTokens="optional"),
     {"instances-require-imdsv2"},
     r'metadataOptions\.httpTokens is "optional": set metadata_options http_tokens="required"'),
    ("no-metadata-options", "gpu-node-01", _set(metadataOptions=None),
     {"instances-require-imdsv2"}, r"metadataOptions\.httpTokens is not set \(IMDSv1 allowed\)"),
    ("root-unencrypted", "nodes-controller", _nested("rootBlockDevice", encrypted=False),
     {"volumes-encrypted"}, r"rootBlockDevice\.encrypted is not true: set root_block_device encrypted=True"),
    ("no-root-block-device", "gpu-node-02", _set(rootBlockDevice=None),
     {"volumes-encrypted"}, r"rootBlockDevice\.encrypted is not true"),
    ("ebs-unencrypted", "gpu-node-01",
     _set(ebsBlockDevices=[{"deviceName": "/dev/sdf", "volumeSize": 100, "encrypted": False}]),
     {"volumes-encrypted"}, r"ebsBlockDevices\[0\] \(/dev/sdf\)\.encrypted is not true"),
    ("munge-key-in-write-files", "nodes-controller",
     _cloud_config(lambda d: d["write_files"].append(
         {"path": "/etc/munge/munge.key", "encoding": "b64", "content": MUNGE_B64,
          "owner": "munge:munge", "permissions": "0400"})),
     {"user-data-has-no-munge-key"},
     r"userData: write_files\[\d+\] writes /etc/munge/munge\.key: the munge key must never be in user-data"),
    ("munge-key-piped-in-runcmd", "gpu-node-01",
     _cloud_config(lambda d: d["runcmd"].insert(0, f"echo {MUNGE_B64} | base64 -d > /etc/munge/munge.key")),
     {"user-data-has-no-munge-key"}, r"userData carries a 1368-character encoded blob"),
    ("hex-key-in-bootcmd", "gpu-node-02",
     _cloud_config(lambda d: d.setdefault("bootcmd", []).append(f"echo {MUNGE_KEY[:128].hex()} | xxd -r -p")),
     {"user-data-has-no-munge-key"}, r"userData carries a 256-character encoded blob"),
    ("private-key-as-key-pair", "nodes-key", _set(publicKey=PRIVATE_KEY),
     {"no-private-key-material", "key-pair-public-key-only"},
     r'publicKey holds private key material \("PRIVATE KEY"\)'),
    ("private-key-in-user-data", "gpu-node-02",
     _cloud_config(lambda d: d["write_files"].append(
         {"path": "/home/ubuntu/.ssh/id_ed25519", "content": PRIVATE_KEY, "permissions": "0600"})),
     {"no-private-key-material"}, r"userData holds private key material"),
    ("binary-file-gzip-encoded", "nodes-controller",
     _cloud_config(lambda d: d["write_files"].append(
         {"path": "/var/lib/slurm/k", "encoding": "gz+b64",
          "content": base64.b64encode(gzip.compress(MUNGE_KEY)).decode()})),
     {"user-data-has-no-munge-key"},
     r"userData: write_files\[\d+\] \(/var/lib/slurm/k\) holds 1024 bytes of binary data"),
    ("private-key-in-gzip-user-data-base64", "gpu-node-01", _gzip_user_data_with_private_key,
     {"no-private-key-material"}, r"userDataBase64 holds private key material"),
    ("key-pair-not-a-public-key", "nodes-key", _set(publicKey="hunter2"),
     {"key-pair-public-key-only"}, r"publicKey is not an OpenSSH public key line"),
    ("stop-start-without-tag-condition", "power-stop-start", _policy_doc(lambda st: st.pop("Condition")),
     {"power-save-role-is-tag-scoped"},
     r"policy Statement\[0\] allows ec2:startinstances and ec2:stopinstances without a resource-tag "
     r"condition: add Condition StringEquals aws:ResourceTag/Cluster"),
    ("stop-start-scoped-by-region-only", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringEquals": {"aws:RequestedRegion": "ap-northeast-2"}})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    ("stop-start-tag-wildcard", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringLike": {"aws:ResourceTag/Cluster": "*"}})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    # Under StringLike, a value made only of wildcards matches any tag value: no scope.
    *[(f"stop-start-tag-like-{name}", "power-stop-start",
       _policy_doc(lambda st, v=v: st.update(Condition={"StringLike": {"aws:ResourceTag/Cluster": v}})),
       {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition")
      for name, v in (("any-nonempty", "?*"), ("double-star", "**"), ("three-marks", "???"),
                      ("list", ["slurm-gpu", "*?"]))],
    ("stop-start-stack-tag-like-wildcards", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringLike": {"ec2:ResourceTag/slurm-gpu:stack": "*?*"}})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    # Only the Cluster or the stack tag scopes: Role=gpu is on every stack's GPU nodes.
    ("stop-start-role-tag-only", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringEquals": {"aws:ResourceTag/Role": "gpu"}})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    ("stop-start-other-tag-only", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringEquals": {"ec2:ResourceTag/Name": "x",
                                                                  "aws:ResourceTag/Clusters": "x"}})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    # ...IfExists holds for a request without the tag (an untagged instance): not a tag scope.
    ("stop-start-tag-if-exists", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringEqualsIfExists": st["Condition"]["StringEquals"]})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    ("stop-start-tag-like-if-exists", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"StringLikeIfExists": st["Condition"]["StringEquals"]})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    ("stop-start-tag-for-all-values", "power-stop-start",
     _policy_doc(lambda st: st.update(Condition={"ForAllValues:StringEquals": st["Condition"]["StringEquals"]})),
     {"power-save-role-is-tag-scoped"}, r"without a resource-tag condition"),
    # The SSH source: no wider than a /16 (IPv6 /48), never loopback or link-local.
    ("ssh-from-a-slash-8", "ssh-from-admin", _set(cidrIpv4="10.0.0.0/8"), {"ssh-source-is-narrow"},
     r"cidrIpv4: tcp port 22 from 10\.0\.0\.0/8 is wider than a /16: SSH open to that much of the internet; "
     r"narrow it to your address \(e\.g\. 203\.0\.113\.7/32\), or set the pack's config allowWideAdminCidr: true"),
    ("ssh-from-a-slash-15", "ssh-from-admin", _set(cidrIpv4="198.18.0.0/15"), {"ssh-source-is-narrow"},
     r"from 198\.18\.0\.0/15 is wider than a /16"),
    ("ssh-from-a-v6-slash-32", "ssh-from-admin", _set(cidrIpv4=None, cidrIpv6="2001:db8::/32"),
     {"ssh-source-is-narrow"}, r"cidrIpv6: tcp port 22 from 2001:db8::/32 is wider than a /48"),
    ("ssh-from-loopback", "ssh-from-admin", _set(cidrIpv4="127.0.0.1/32"), {"ssh-source-is-narrow"},
     r"from 127\.0\.0\.1/32, a loopback range: no admin connects from there"),
    ("ssh-from-link-local", "ssh-from-admin", _set(cidrIpv4="169.254.0.0/16"), {"ssh-source-is-narrow"},
     r"from 169\.254\.0\.0/16, a link-local range"),
    ("ssh-from-v6-loopback", "ssh-from-admin", _set(cidrIpv4=None, cidrIpv6="::1/128"), {"ssh-source-is-narrow"},
     r"from ::1/128, a loopback range"),
    ("ssh-from-v6-link-local", "ssh-from-admin", _set(cidrIpv4=None, cidrIpv6="fe80::/10"),
     {"ssh-source-is-narrow"}, r"from fe80::/10, a link-local range"),
    ("ec2-star-action", "power-stop-start", _policy_doc(lambda st: st.update(Action="ec2:*")),
     {"power-save-role-is-tag-scoped"},
     r"policy Statement\[0\] allows wildcard action\(s\) ec2:\*: name each action"),
    ("not-action", "power-stop-start",
     _policy_doc(lambda st: (st.pop("Action"), st.update(NotAction=["iam:*"]))),
     {"power-save-role-is-tag-scoped"}, r"uses NotAction"),
    ("inline-role-policy-unscoped", "power-role",
     _set(inlinePolicies=[{"name": "x", "policy": json.dumps({"Version": "2012-10-17", "Statement": [
         {"Effect": "Allow", "Action": ["ec2:StopInstances"], "Resource": "*"}]})}]),
     {"power-save-role-is-tag-scoped"},
     r"inlinePolicies\[0\]\.policy Statement\[0\] allows ec2:stopinstances without a resource-tag condition"),
]


@pytest.mark.parametrize("suffix,change,policies,pattern",
                         [c[1:] for c in RESOURCE_CASES], ids=[c[0] for c in RESOURCE_CASES])
def test_resource_policy_violation(cluster, suffix, change, policies, pattern):
    stack = _mutate(cluster, suffix, change)
    target = one(stack, suffix)
    found = analyze(stack)
    assert {f.policy for f in found} == policies, found
    assert all(f.mandatory and f.urn == target.urn for f in found)
    assert any(re.search(pattern, f.message) for f in found), [f.message for f in found]
    # The message opens with the policy's description (the SDK's format).
    described = {p.name: p.description for p in rules.policies()}
    assert all(f.message.startswith(described[f.policy]) for f in found)


def _drop(suffix):
    return lambda stack: [r for r in stack if not r.name.endswith(suffix)]


def _edit(suffix, change):
    return lambda stack: _mutate(stack, suffix, change)


def _second_group(stack):
    """gpu-node-02 moved to a second cluster placement group."""
    stack = copy.deepcopy(stack)
    pg = one(stack, "nodes-pg")
    other = copy.deepcopy(pg)
    other.name, other.urn, other.id = pg.name + "-b", pg.urn + "-b", pg.id + "-b"
    other.outputs.update(id=other.id, name=other.name + "-4d5e6f")
    node = one(stack, "gpu-node-02")
    for props in (node.inputs, node.outputs):
        props["placementGroup"] = other.outputs["name"]
    node.property_dependencies["placementGroup"] = [other.urn]
    return stack + [other]


def _no_group(stack):
    stack = _mutate(stack, "gpu-node-02", _set(placementGroup=None))
    one(stack, "gpu-node-02").property_dependencies.pop("placementGroup", None)
    return stack


def _inline_self_egress(stack):
    """Self egress expressed inline on the group instead of as its own rule: still fine."""
    stack = _drop("all-to-self")(stack)
    return _mutate(stack, "sec-sg", _set(egress=[{"protocol": "-1", "fromPort": 0, "toPort": 0, "self": True}]))


def _address_on(suffix: str, typ: str, prop: str):
    """The stack plus an Elastic IP (or EIP association) pointing at the resource *suffix."""
    def change(stack):
        stack = copy.deepcopy(stack)
        target = one(stack, suffix)
        name = f"extra-{typ.rsplit(':', 1)[-1].lower()}"
        urn = target.urn.rsplit("::", 1)[0].rsplit("$", 1)[0] + f"$aws:ec2/eip:Eip::{name}"
        props = {prop: target.id, "domain": "vpc"} if typ == rules.EIP else {prop: target.id}
        stack.append(Res(typ, name, urn, f"{name}-id", target.parent, [], {prop: [target.urn]}, dict(props),
                         {**props, "id": f"{name}-id"}))
        return stack
    return change


STACK_CASES = [
    ("gpu-node-with-public-ip", _edit("gpu-node-01", _set(associatePublicIpAddress=True)),
     "gpu-nodes-have-no-public-ip",
     r"mini-nodes-gpu-node-01 is a GPU node with associatePublicIpAddress true: GPU nodes take no public "
     r"address"),
    ("eip-on-a-gpu-interface", _address_on("gpu-node-02-eni", rules.EIP, "networkInterface"),
     "gpu-nodes-have-no-public-ip",
     r"Elastic IP extra-eip is attached to interface mini-nodes-gpu-node-02-eni of GPU node "
     r"mini-nodes-gpu-node-02"),
    ("eip-associated-with-a-gpu-instance", _address_on("gpu-node-01", rules.EIP_ASSOCIATION, "instanceId"),
     "gpu-nodes-have-no-public-ip",
     r"Elastic IP extra-eipassociation is attached to GPU node mini-nodes-gpu-node-01"),
    ("gpu-subnet-maps-public-ips", _edit("gpu-subnet", _set(mapPublicIpOnLaunch=True)),
     "gpu-nodes-have-no-public-ip",
     r"subnet mini-net-gpu-subnet of GPU node mini-nodes-gpu-node-0\d has mapPublicIpOnLaunch true"),
    ("gpu-node-outside-placement-group", _no_group, "efa-nodes-share-cluster-placement-group",
     r"mini-nodes-gpu-node-02 has an EFA interface but no placementGroup"),
    ("spread-placement-group", _edit("nodes-pg", _set(strategy="spread")),
     "efa-nodes-share-cluster-placement-group",
     r"placement group mini-nodes-pg whose strategy is 'spread': EFA nodes need strategy \"cluster\""),
    ("split-placement-groups", _second_group, "efa-nodes-share-cluster-placement-group",
     r"EFA nodes are split across placement groups"),
    ("no-self-egress", _drop("all-to-self"), "efa-security-group-self-rules",
     r"security group mini-sec-sg of EFA node mini-nodes-gpu-node-0\d has no all-traffic egress rule to "
     r"itself: EFA needs both \(an egress to 0\.0\.0\.0/0 does not cover EFA\)"),
    ("self-egress-tcp-only", _edit("all-to-self", _set(ipProtocol="tcp", fromPort=0, toPort=65535)),
     "efa-security-group-self-rules", r"has no all-traffic egress rule to itself"),
    ("no-self-ingress", _drop("all-from-self"), "efa-security-group-self-rules",
     r"has no all-traffic ingress rule from itself"),
]


@pytest.mark.parametrize("change,policy,pattern", [c[1:] for c in STACK_CASES],
                         ids=[c[0] for c in STACK_CASES])
def test_stack_policy_violation(cluster, change, policy, pattern):
    found = analyze_stack(change(cluster))
    assert found and {f.policy for f in found} == {policy}, found
    assert all(f.mandatory for f in found)
    assert any(re.search(pattern, f.message) for f in found), [f.message for f in found]


def test_public_addresses_the_design_has_pass(cluster):
    """The controller's public IP, its public subnet and the NAT gateway's Elastic IP are
    allowed: the rule is about GPU nodes only."""
    assert one(cluster, "nodes-controller").inputs["associatePublicIpAddress"] is True
    assert [r.name for r in cluster if r.typ == rules.EIP] == ["mini-net-nat-eip"]
    mapped = _mutate(cluster, "public-subnet", _set(mapPublicIpOnLaunch=True))
    assert analyze_stack(mapped) == []
    # An Elastic IP on the controller is not a GPU node's either.
    assert analyze_stack(_address_on("nodes-controller", rules.EIP, "instance")(cluster)) == []


def test_gpu_nodes_are_found_without_efa_by_their_role_tag():
    stack = declare(efa=False, gpuNodeCount=1, gpuInstanceType="g4dn.xlarge")
    assert analyze_stack(stack) == []
    found = analyze_stack(_mutate(stack, "gpu-node-01", _set(associatePublicIpAddress=True)))
    assert [f.policy for f in found] == ["gpu-nodes-have-no-public-ip"]


def test_no_public_ip_rule_works_during_preview(cluster):
    """With every id unknown, the EIP is still tied to the GPU interface through the engine's
    property dependencies."""
    preview = as_preview(_address_on("gpu-node-01-eni", rules.EIP, "networkInterface")(cluster))
    assert one(preview, "extra-eip").outputs["networkInterface"] == UNKNOWN_STRING_VALUE
    found = analyze_stack(preview)
    assert [f.policy for f in found] == ["gpu-nodes-have-no-public-ip"] and found[0].mandatory


def test_efa_only_interfaces_of_a_multi_card_node_are_checked():
    """p4d.24xlarge: 4 EFA interfaces per node; each is tied to its node, and an Elastic IP on
    the third card's interface is caught too."""
    stack = declare(gpuInstanceType="p4d.24xlarge")
    assert analyze(stack) == [] and analyze_stack(stack) == []
    found = analyze_stack(_address_on("gpu-node-01-efa3", rules.EIP, "networkInterface")(stack))
    assert [f.policy for f in found] == ["gpu-nodes-have-no-public-ip"]
    assert "interface mini-nodes-gpu-node-01-efa3 of GPU node mini-nodes-gpu-node-01" in found[0].message


def test_self_egress_may_be_an_inline_rule(cluster):
    assert analyze_stack(_inline_self_egress(cluster)) == []


# ------------------------------------------------ the root volumes' KMS key

def _kms_statement(sid: str, edit):
    """Edit the power-save policy's statement `sid` (the stack names a customer-managed key)."""
    def change(props):
        doc = json.loads(props["policy"])
        (st,) = [st for st in doc["Statement"] if st.get("Sid") == sid]
        edit(st)
        props["policy"] = json.dumps(doc)
    return change


KMS_CASES = [
    ("use-any-key", _kms_statement("UseTheRootVolumesKeyThroughEc2", lambda st: st.update(Resource="*")),
     r"Statement\[2\] allows kms:decrypt, .* on \*: name the KMS key's ARN"),
    ("use-by-alias", _kms_statement("UseTheRootVolumesKeyThroughEc2", lambda st: st.update(
        Resource="arn:aws:kms:ap-northeast-2:111122223333:alias/ebs")), r"on arn:aws:kms:.*:alias/ebs: name"),
    ("grant-unconditioned", _kms_statement("LetEc2GrantTheRootVolumesKey", lambda st: st.pop("Condition")),
     r"Statement\[3\] allows kms:CreateGrant without Condition Bool kms:GrantIsForAWSResource = true"),
    ("grant-condition-false", _kms_statement("LetEc2GrantTheRootVolumesKey", lambda st: st.update(
        Condition={"Bool": {"kms:GrantIsForAWSResource": "false"}})), r"allows kms:CreateGrant without"),
]


@pytest.fixture(scope="module")
def cmk_cluster() -> list[Res]:
    return declare(ebsKmsKeyId=harness.CMK)


@pytest.mark.parametrize("change,pattern", [c[1:] for c in KMS_CASES], ids=[c[0] for c in KMS_CASES])
def test_kms_grant_violation(cmk_cluster, change, pattern):
    stack = _mutate(cmk_cluster, "power-stop-start", change)
    target = one(stack, "power-stop-start")
    found = analyze(stack)
    assert {f.policy for f in found} == {"kms-use-names-its-key"}, found
    assert all(f.mandatory and f.urn == target.urn for f in found)
    assert any(re.search(pattern, f.message) for f in found), found


# ------------------------------------------------------------ the pack

def test_main_builds_the_pack_with_every_policy_mandatory(monkeypatch):
    """Run policy/__main__.py as the engine does (runpy on the directory), with
    PolicyPack's server replaced by a recorder, then ask the real analyzer service
    built from the recorded arguments what it would tell the engine."""
    made = []
    monkeypatch.setattr(pulumi_policy, "PolicyPack", lambda **kw: made.append(kw))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "rules", raising=False)
    runpy.run_path(str(POLICY_DIR), run_name="__main__")
    (kw,) = made
    assert kw["name"] == rules.PACK_NAME and kw["enforcement_level"] == EnforcementLevel.MANDATORY

    svc = _PolicyAnalyzerServicer(kw["name"], "0.0.1", kw["policies"], kw["enforcement_level"])
    info = svc.GetAnalyzerInfo(None, None)
    assert info.name == "slurm-gpu-security"
    by_name = {p.name: p for p in info.policies}
    stack_policies = {"efa-nodes-share-cluster-placement-group", "efa-security-group-self-rules",
                      "gpu-nodes-have-no-public-ip"}
    assert set(by_name) == {p.name for p in rules.policies()} == stack_policies | {
        "ssh-not-open-to-internet", "ssh-source-is-narrow", "only-ssh-from-outside", "instances-require-imdsv2",
        "volumes-encrypted", "user-data-has-no-munge-key", "no-private-key-material",
        "key-pair-public-key-only", "power-save-role-is-tag-scoped", "kms-use-names-its-key"}
    for name, p in by_name.items():
        assert p.enforcementLevel == proto.MANDATORY, name
        want = proto.PolicyType.POLICY_TYPE_STACK if name in stack_policies else proto.PolicyType.POLICY_TYPE_RESOURCE
        assert p.policy_type == want, name
    monkeypatch.delitem(sys.modules, "rules", raising=False)


def test_pack_project_file_and_pins():
    project = yaml.safe_load((POLICY_DIR / "PulumiPolicy.yaml").read_text())
    assert project["runtime"]["name"] == "python"
    venv = (POLICY_DIR / project["runtime"]["options"]["virtualenv"]).resolve()
    assert venv == REPO / ".venv"  # the environment scripts/setup.sh makes
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            pins[name.lower()] = version
    assert pins["pulumi-policy"] == importlib.metadata.version("pulumi-policy")
    for line in (POLICY_DIR / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert pins[name.lower()] == version, f"policy/requirements.txt pins {line}; requirements.txt differs"


def test_the_pack_serves_the_engine_over_loopback():
    """Start the pack as the CLI does (`python <dir>` under runpy) and ask it, over
    its loopback gRPC port, for its policies and for a verdict on a bad resource."""
    import subprocess

    import grpc
    from google.protobuf import empty_pb2
    from pulumi.runtime.proto import analyzer_pb2_grpc

    proc = subprocess.Popen([sys.executable, "-u", "-m", "pulumi.policy", "127.0.0.1:1", str(POLICY_DIR)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read() if proc.poll() is not None else port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = analyzer_pb2_grpc.AnalyzerStub(channel)
            info = stub.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
            assert len(info.policies) == len(rules.policies())
            bad = proto.AnalyzeRequest(type=rules.INSTANCE, urn="urn:pulumi:t::p::aws:ec2/instance:Instance::x",
                                       name="x", properties=_struct({"metadataOptions": {"httpTokens": "optional"},
                                                                     "rootBlockDevice": {"encrypted": True}}))
            found = _findings(stub.Analyze(bad, timeout=30))
            assert [f.policy for f in found] == ["instances-require-imdsv2"] and found[0].mandatory
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _configured(override) -> _PolicyAnalyzerServicer:
    """The analyzer as `--policy-pack-config` configures it: allowWideAdminCidr for both SSH-source policies."""
    svc = servicer()
    props = _struct({rules.WIDE_OVERRIDE: override})
    svc.Configure(proto.ConfigureAnalyzerRequest(policyConfig={
        name: proto.PolicyConfig(enforcementLevel=proto.MANDATORY, properties=props)
        for name in ("ssh-not-open-to-internet", "ssh-source-is-narrow")}), None)
    return svc


@pytest.mark.parametrize("cidr,wide_ok", [("10.0.0.0/8", True), ("0.0.0.0/0", True), ("127.0.0.0/8", False),
                                          ("169.254.169.254/32", False)])
def test_the_wide_source_override_allows_wide_ranges_but_never_loopback_or_link_local(cluster, cidr, wide_ok):
    stack = _mutate(cluster, "ssh-from-admin", _set(cidrIpv4=cidr))
    rule = one(stack, "ssh-from-admin")
    request = proto.AnalyzeRequest(type=rule.typ, properties=_struct(rule.inputs), urn=rule.urn, name=rule.name)
    unset = {f.policy for f in _findings(servicer().Analyze(request, None))}
    assert unset  # refused without the override
    for override in ("true", 1):  # only a JSON true counts
        assert {f.policy for f in _findings(_configured(override).Analyze(request, None))} == unset
    found = {f.policy for f in _findings(_configured(True).Analyze(request, None))}
    assert found == (set() if wide_ok else {"ssh-source-is-narrow"})


@pytest.mark.parametrize("condition", [
    {"StringEquals": {"aws:ResourceTag/Cluster": "demo"}},
    {"StringEquals": {"ec2:ResourceTag/slurm-gpu:stack": "org/slurm-gpu/dev"}},
    {"StringLike": {"aws:ResourceTag/slurm-gpu:stack": "org/slurm-gpu/*"}},
    {"StringLike": {"aws:ResourceTag/Cluster": "demo-?"}},
])
def test_the_cluster_or_stack_tag_with_a_real_value_scopes(condition):
    """The other side of the refused cases above: the tags that name this cluster's instances, with a
    value that is more than wildcards, count as a scope (as the stack's own policy uses them)."""
    from policy import rules

    assert rules._tag_scoped({"Effect": "Allow", "Condition": condition})
    wild = {op: {k: "*?" for k in tests} for op, tests in condition.items()}
    assert rules._tag_scoped({"Effect": "Allow", "Condition": wild}) is ("StringEquals" in condition)
