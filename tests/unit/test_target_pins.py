"""Every pin the GPU nodes install has a wheel for the target platform's Python.

The nodes install `node_pins.training_pins()` (read from requirements.txt) into a venv of the
image's python3 (bootstrap-gpu.sh.j2's `training` step); this asks pip, without installing,
whether that works on the AWS platform of cluster/platform.py. The controller installs only
the power-save programs' boto3 (node_pins.power_pins(), its bootstrap's `power` step), checked the
same way.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bootstrap import node_layout, node_pins, user_data
from bootstrap.wheels import check_wheels, describe
from cluster.facts import ClusterFacts, NodeShape, PowerSave, plan_hosts
from cluster.platform import AWS, BOOT_DEBIAN13

PINS = [f"{name}=={version}" for name, version in node_pins.training_pins().items()]


def test_gpu_nodes_install_exactly_the_pins_checked_here():
    script = user_data.bootstrap_script(_facts(), "gpu")
    assert f"want='{' '.join(PINS)}'" in script


def test_every_pin_has_a_wheel_for_the_aws_target():
    check = check_wheels(PINS, AWS)
    assert check.ok, describe(check, AWS)


def test_the_controllers_power_pins_have_a_wheel_for_the_aws_target():
    pins = node_pins.power_pins()
    assert f"want='{' '.join(pins)}'" in user_data.bootstrap_script(_facts_with_power(), "controller")
    check = check_wheels(pins, AWS)
    assert check.ok, describe(check, AWS)


def test_the_boot_test_debian_13_pins_have_wheels_but_torch_from_debian():
    """The boot test's Debian 13 (Python 3.13) takes torch from Debian's python3-torch
    (Platform.os_torch); every other pin is a wheel for Python 3.13."""
    reqs = node_pins.training_requirements(BOOT_DEBIAN13)
    assert reqs[0] == f"torch=={BOOT_DEBIAN13.os_torch.version}"
    assert reqs[1:] == PINS[1:]
    check = check_wheels(reqs[1:], BOOT_DEBIAN13)
    assert check.ok, describe(check, BOOT_DEBIAN13)


@pytest.mark.slow
def test_python_3_10_of_the_ubuntu_22_04_image_fails_naming_the_pins():
    """The check can fail: Ubuntu 22.04's Deep Learning Base image has Python 3.10, and
    transformers, trl and accelerate need >= 3.11."""
    old = replace(AWS, os="Ubuntu 22.04", python="3.10")
    check = check_wheels(PINS, old)
    assert not check.ok
    failed = {req.split("==")[0] for req in check.missing}
    assert failed == {"transformers", "trl", "accelerate"}, describe(check, old)
    report = describe(check, old)
    assert "Python 3.10" in report and "transformers==5.24.0" in report


def _facts_with_power():
    return replace(_facts(), power_save=PowerSave(1800, node_layout.SUSPEND_PATH, node_layout.RESUME_PATH, 180, 900))


def _facts():
    ctl, nodes = plan_hosts("10.0.1.0/24", 2)
    return ClusterFacts("t", ctl, nodes, NodeShape(48, 184800, 4, "l4"), "10.0.1.0/24")
