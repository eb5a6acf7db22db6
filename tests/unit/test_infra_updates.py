"""A code update never stops, starts or replaces a running host through Pulumi.

With pulumi-aws 7.x a changed `userData` is applied by stopping the instance, modifying it and
starting it again (pulumi_aws ec2.Instance input docs; terraform-provider-aws
internal/service/ec2/ec2_instance.go, resourceInstanceUpdate -> modifyInstanceAttributeWithStopStart),
and ForceNew inputs replace it. So: (1) a second program run with changed GPU templates and pins
changes no input of an existing instance that the engine would act on, and (2) every input the
program sets that the installed provider stops/starts or replaces on is ignored on update or
deliberate (infra/nodes.py DELIBERATE: it changes with the stack's config, not the code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pulumi_aws
import pytest

from bootstrap import node_pins, render
from infra import nodes
from tests.support.pulumi_mocks import Run, run_program, stack_config

INSTANCE = "aws:ec2/instance:Instance"
INSTANCE_PY = Path(pulumi_aws.__file__).parent / "ec2" / "instance.py"

# The schema's ForceNew inputs of aws_instance (top level, or a nested field that is ForceNew),
# from terraform-provider-aws internal/service/ec2/ec2_instance.go, resourceInstance(): the
# installed pulumi_aws carries the provider's docs, not its schema, so this table stands in for
# what its docs do not say. `primaryNetworkInterface`: EC2 cannot swap a running instance's
# primary interface (its network_interface_id is ForceNew like network_interface's).
FORCE_NEW = {
    "ami", "associatePublicIpAddress", "availabilityZone", "cpuOptions", "ebsBlockDevices", "ebsOptimized", "enclaveOptions", "ephemeralBlockDevices",
    "hibernation", "hostId", "instanceMarketOptions", "ipv6Addresses", "keyName", "launchTemplate",
    "networkInterfaces", "placementGroup", "placementPartitionNumber", "primaryNetworkInterface",
    "privateDnsNameOptions", "privateIp", "rootBlockDevice", "securityGroups", "subnetId", "tenancy",
}
# resourceInstanceUpdate also stops and starts the instance for a capacity reservation change.
STOP_START = {"capacityReservationSpecification"}

# What the installed docs say of an input whose update stops/starts or replaces the instance.
DISRUPTS = re.compile(r"stop/start|destroy and recreate|forces recreation|force your instance to be replaced", re.I)


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w.title() for w in rest)


def documented_disruptive() -> dict[str, str]:
    """camelCase input -> the sentence of the installed pulumi_aws's Instance docs (the InstanceArgs
    `:param` lines and deprecation messages) that says an update stops/starts or replaces it."""
    src = INSTANCE_PY.read_text()
    args = src[src.index("class InstanceArgs"):src.index("class _InstanceState")]
    found = {}
    for name, text in re.findall(r":param [^\n]*? (\w+): ([^\n]*)", args):
        if DISRUPTS.search(text):
            found[_camel(name)] = text
    for name, text in re.findall(r'if (\w+) is not None:\n\s+warnings\.warn\("""([^"]*)"""', args):
        if DISRUPTS.search(text):
            found[_camel(name)] = text
    return found


def _instances(run: Run) -> dict[str, object]:
    return {r.name: r for r in run.resources if r.typ == INSTANCE}


def test_the_installed_provider_docs_are_read():
    """The parse finds what the docs say today (the test below is not vacuous)."""
    docs = documented_disruptive()
    assert {"userData", "userDataBase64", "instanceType"} <= set(docs), sorted(docs)
    assert "stop/start" in docs["userData"]
    assert "securityGroups" in docs  # deprecated: "will force your instance to be replaced"
    # Every name the tables use is an input of the installed Instance.
    inputs = {_camel(n) for n in re.findall(r"(?m)^ {17}(\w+): pulumi\.Input", INSTANCE_PY.read_text())}
    assert (FORCE_NEW | STOP_START | set(docs)) <= inputs, sorted((FORCE_NEW | STOP_START | set(docs)) - inputs)


@pytest.mark.parametrize("cfg", [{}, {"gpuInstanceType": "p5.48xlarge"}, {"idleStopMinutes": "0"},
                                 {"gpuMarket": "spot"},
                                 {"gpuMarket": "capacity-reservation", "capacityReservationId": "cr-0123456789abcdef0",
                                  "availabilityZone": "ap-northeast-2a"}],
                         ids=["default", "p5-efa", "no-power-saving", "spot", "capacity-reservation"])
def test_no_disruptive_input_is_left_to_change(cfg):
    """Each input the program sets that stops/starts or replaces an instance on update is in
    ignore_changes or deliberate (changes only with the stack's config), with a reason."""
    disruptive = set(documented_disruptive()) | FORCE_NEW | STOP_START
    assert set(nodes.DELIBERATE) <= disruptive, "DELIBERATE lists an input that disrupts nothing"
    assert not set(nodes.DELIBERATE) & set(nodes.IGNORED_ON_UPDATE)
    assert all(reason.strip() for reason in nodes.DELIBERATE.values())
    run = run_program(stack_config(**cfg))
    instances = _instances(run)
    assert len(instances) == 3
    problems = []
    for name, inst in instances.items():
        for key, value in inst.inputs.items():
            if key not in disruptive or value in (None, "", [], {}):
                continue
            if key not in inst.ignore_changes and key not in nodes.DELIBERATE:
                problems.append(f"{name}: {key} (not ignored, not deliberate)")
    assert problems == []


def test_a_code_update_changes_no_running_instance(monkeypatch):
    """`pulumi up` after a `git pull` that changed the GPU nodes' templates and pins: every
    instance's user-data differs, and the engine sees no other change (user-data ignored)."""
    first = _instances(run_program(stack_config()))
    pins = node_pins.training_requirements

    def newer_pins(platform):
        return [p.replace("torch==", "torch==9.") if p.startswith("torch==") else p for p in pins(platform)]

    healthcheck = render.render_healthcheck
    monkeypatch.setattr(render, "training_requirements", newer_pins)
    monkeypatch.setattr(render, "render_healthcheck", lambda facts: healthcheck(facts) + "true  # newer check\n")
    second = _instances(run_program(stack_config()))
    assert set(first) == set(second)
    changed = []
    for name in first:
        a, b = first[name], second[name]
        assert a.inputs["userDataBase64"] != b.inputs["userDataBase64"], f"{name}: the code change did not reach it"
        assert {"userData", "userDataBase64"} <= set(b.ignore_changes), f"{name}: new user-data would stop and start it"
        same = {k: v for k, v in a.inputs.items() if k != "userDataBase64"}
        if same != {k: v for k, v in b.inputs.items() if k != "userDataBase64"}:
            changed.append(f"{name}: inputs")
        if (a.ignore_changes, a.replace_on_changes, a.delete_before_replace) != \
                (b.ignore_changes, b.replace_on_changes, b.delete_before_replace):
            changed.append(f"{name}: options")
    assert changed == []
