"""The target platforms are data (cluster/platform.py) that the stack and the rendered files read."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from bootstrap import render, user_data
from cluster.facts import ClusterFacts, NodeShape, facts_from_dict, facts_to_dict, plan_hosts
from cluster.platform import AWS, LOCAL, platform
from localcluster import plan as local_plan


def _facts(**kw) -> ClusterFacts:
    ctl, nodes = plan_hosts("10.0.1.0/24", 2)
    return ClusterFacts("t", ctl, nodes, NodeShape(48, 184800, 4, "l4"), "10.0.1.0/24", **kw)


def test_aws_target_is_ubuntu_24_04_with_python_3_12_and_slurm_23_11():
    assert AWS.ami_name == "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *"
    assert (AWS.os, AWS.python, AWS.slurm, AWS.cgroup) == ("Ubuntu 24.04", "3.12", "23.11", True)
    assert AWS.efa_dir == "/opt/amazon/efa" and AWS.real_gpus
    assert platform("aws") is AWS and platform("local") is LOCAL


def test_local_platform_is_this_machines_debian():
    """The LOCAL facts are checked against the machine the local cluster runs on."""
    assert (LOCAL.python, LOCAL.slurm, LOCAL.cgroup, LOCAL.real_gpus) == ("3.11", "22.05", False, False)
    if 'VERSION_ID="12"' not in open("/etc/os-release").read():
        pytest.skip(f"this machine is not {LOCAL.os}, which the LOCAL platform describes")
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == LOCAL.python
    out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "slurm-wlm"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith(LOCAL.slurm + "."), out


def test_facts_carry_the_platform_and_its_device_prefix():
    assert _facts().platform is AWS and _facts().gpu_device_prefix == "/dev/nvidia"
    local = local_plan.cluster_facts(1, 2)
    assert local.platform is LOCAL and local.gpu_device_prefix == LOCAL.gpu_device_prefix
    assert f"File={LOCAL.gpu_device_prefix}[0-1]" in render.render_gres_conf(local)
    # An explicit prefix (tests' temporary device dirs) still wins.
    assert replace(_facts(), gpu_device_prefix="/tmp/x/nvidia").gpu_device_prefix == "/tmp/x/nvidia"


def test_platform_survives_the_inventory_round_trip():
    for p in (AWS, LOCAL):
        facts = _facts(platform=p)
        assert facts_from_dict(facts_to_dict(facts)) == facts
    old = facts_to_dict(_facts())
    del old["platform"]  # inventories written before the platform was recorded: AWS
    assert facts_from_dict(old).platform is AWS


def test_local_cluster_shortens_only_its_own_timers():
    """The local cluster's slurm.conf checks health every 15 s and schedules every 5 s (a requeued job
    starts seconds after its start time, not at Slurm's next 60 s pass); AWS's keeps Slurm's values."""
    from tests.unit.test_bootstrap_render import settings

    local = settings(render.render_slurm_conf(local_plan.cluster_facts(2, 2)))
    aws = settings(render.render_slurm_conf(_facts()))
    assert (local["SlurmdTimeout"], local["HealthCheckInterval"], local["SchedulerParameters"]) == \
        ("15", "15", "sched_interval=5")
    assert (aws["SlurmdTimeout"], aws["HealthCheckInterval"]) == ("180", "60") and "SchedulerParameters" not in aws
    assert facts_from_dict(facts_to_dict(local_plan.cluster_facts(2, 2))).sched_interval == 5


def test_a_local_cluster_may_shorten_the_requeue_wait():
    """cred_expire (how long a requeued job waits) is the lost-node-safe default unless a cluster asks
    for a shorter one (the hang and spot tests, where no node is lost); the inventory carries it."""
    from tests.unit.test_bootstrap_render import settings

    assert settings(render.render_slurm_conf(local_plan.cluster_facts(2, 2)))["AuthInfo"] == \
        f"cred_expire={local_plan.CRED_EXPIRE_S}"
    short = local_plan.cluster_facts(2, 2, cred_expire=20)
    assert settings(render.render_slurm_conf(short))["AuthInfo"] == "cred_expire=20"
    assert local_plan.make_inventory(2, 2, cred_expire=20).facts.cred_expire == 20  # `fab reconfigure` renders from it


def test_wheel_tags_are_pips_own_for_the_platforms_glibc():
    """`Platform.wheel_platforms` is the list pip itself accepts on that glibc (what a node's `pip
    install` takes): checked against pip's tag code on this machine, whose glibc is LOCAL's."""
    import platform as py

    from packaging import tags

    assert py.libc_ver() == ("glibc", LOCAL.glibc) and py.machine() == LOCAL.arch
    pips = [t for t in dict.fromkeys(tag.platform for tag in tags.sys_tags()) if t != "any"]
    assert sorted(LOCAL.wheel_platforms) == sorted(pips)
    assert [t for t in LOCAL.wheel_platforms if t.startswith("manylinux")] == [t for t in pips if t.startswith("manylinux")]
    # The AMI's glibc 2.39 takes torch's CUDA libraries as the real index tags them.
    assert {"manylinux_2_27_x86_64", "manylinux_2_18_x86_64", "manylinux_2_28_x86_64"} <= set(AWS.wheel_platforms)
    assert AWS.wheel_platforms[0] == "manylinux_2_39_x86_64"


def test_controller_boots_the_gpu_nodes_os_python_and_arch():
    """The controller fills the GPU nodes' wheel cache with its own pip (no --platform): its image
    must be the GPU image's OS release (so the same Python and glibc) and machine. The rendered
    step checks Python, glibc and machine again at boot and records a mismatch for the nodes."""
    from infra.instance_types import ARCH

    images = AWS.images
    version = AWS.os.removeprefix("Ubuntu ")
    assert f"({AWS.os})" in images["gpu"].name and "ARM64" not in images["gpu"].name
    assert f"-noble-{version}-amd64-" in images["controller"].name  # Canonical's name: codename, release, arch
    assert AWS.os == "Ubuntu 24.04" and AWS.arch == ARCH == "x86_64"  # noble is 24.04; amd64 is x86_64
    script = user_data.bootstrap_script(_facts(), "controller")
    assert f"nodes='{AWS.python} {AWS.glibc} {AWS.arch}'" in script
    assert "are not the GPU nodes'" in script


def test_inventory_saved_with_the_old_wheel_tags_still_loads():
    """Inventories written before the platform recorded its glibc carry a `wheel_platforms` list."""
    old = facts_to_dict(_facts())
    del old["platform"]["glibc"], old["platform"]["arch"]
    old["platform"]["wheel_platforms"] = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64"]
    assert facts_from_dict(old).platform == AWS
