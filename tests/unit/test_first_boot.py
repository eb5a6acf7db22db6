"""The rendered AWS first boot of the default stack (2 x g6.12xlarge) does things in the
right order for the image it boots: GPU devices opened and checked before
slurmd starts, python3-dev and a C compiler, cgroup confinement, unlimited MEMLOCK."""

from __future__ import annotations

import re

import pytest
import yaml

from bootstrap import node_layout
from bootstrap.slurm_keys import unknown_keys
from bootstrap.user_data import MAX_USER_DATA_BYTES
from cluster import hostpaths
from cluster.platform import AWS
from tests.support.pulumi_mocks import run_program, stack_config, user_data_of, user_data_size
from tests.unit.test_bootstrap_render import script_packages
from tests.unit.test_infra_program import _decoded_files, _instances


@pytest.fixture(scope="module")
def user_data():
    run = run_program(stack_config())  # the defaults: 2 x g6.12xlarge (4 x L4 each)
    controller, gpus = _instances(run)
    assert [g.inputs["instanceType"] for g in gpus] == ["g6.12xlarge"] * 2
    raw = {"controller": user_data_of(controller[0])}
    raw.update({g.inputs["tags"]["Name"]: user_data_of(g) for g in gpus})
    assert all(user_data_size(i) <= MAX_USER_DATA_BYTES for i in controller + gpus)
    return {name: yaml.safe_load(text) for name, text in raw.items()}


def _files(doc):
    return _decoded_files(doc)


def test_gpu_nodes_get_python_headers_and_a_compiler(user_data):
    for name, doc in user_data.items():
        if name != "controller":
            packages = script_packages(_files(doc)[hostpaths.BOOTSTRAP_PATH])
            assert {"python3-dev", "build-essential", "python3-venv"} <= set(packages), name


def test_gpus_are_opened_and_checked_before_slurmd_starts(user_data):
    doc = next(d for n, d in user_data.items() if n != "controller")
    script = _files(doc)[hostpaths.BOOTSTRAP_PATH]
    steps = re.search(r"^ALL_STEPS=\((.*)\)$", script, re.M).group(1).split()
    assert steps.index("gpus") < steps.index("services") == len(steps) - 1
    gpus = script[script.index("step_gpus() {"):script.index("step_services() {")]
    assert gpus.index("nvidia-persistenced") < gpus.index("nvidia-smi -L") < gpus.index('[ -e "$dev" ]')
    assert "devices=(/dev/nvidia0 /dev/nvidia1 /dev/nvidia2 /dev/nvidia3)" in gpus
    assert 'die "GPU check: missing ${missing[*]} (gres.conf File=/dev/nvidia[0-3]: 4 x l4); slurmd is not started' in gpus
    # The training venv is made by the image's Python, which the pins were checked for.
    assert f"die \"the training pins need Python {AWS.python}" in script
    dropin = _files(doc)[node_layout.SLURMD_DROPIN]
    assert "After=nvidia-persistenced.service" in dropin and "ExecStartPre=-/usr/bin/nvidia-smi -L" in dropin
    assert "LimitMEMLOCK=infinity" in dropin and "Delegate=yes" in dropin


def test_jobs_are_confined_by_cgroups_and_keep_unlimited_memlock(user_data):
    files = _files(user_data["controller"])
    conf = files[node_layout.SLURM_CONF]
    assert "\nProctrackType=proctrack/cgroup\n" in conf
    assert "\nTaskPlugin=task/cgroup,task/affinity\n" in conf
    assert "\nPropagateResourceLimitsExcept=MEMLOCK\n" in conf
    assert "enable_configless" in conf  # slurmctld serves cgroup.conf with slurm.conf
    cgroup = files[node_layout.CGROUP_CONF]
    for key in ("ConstrainDevices=yes", "ConstrainCores=yes", "ConstrainRAMSpace=yes"):
        assert f"\n{key}\n" in cgroup
    for path, kind in ((node_layout.SLURM_CONF, "slurm.conf"), (node_layout.GRES_CONF, "gres.conf"),
                       (node_layout.CGROUP_CONF, "cgroup.conf")):
        assert unknown_keys(files[path], kind, AWS.slurm) == [], path
    # GPU nodes carry none of these: configless slurmd fetches them from slurmctld.
    for name, doc in user_data.items():
        if name != "controller":
            assert not any(p.startswith("/etc/slurm/") for p in _files(doc)), name

