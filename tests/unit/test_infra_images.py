"""Which images the hosts boot (GPU nodes and controller), and that a stack keeps them: the
program run twice under the mocks, the second time with a newer image out, as a later
`pulumi up` would be. Resource options are read from the engine's own RegisterResource requests
(ignoreChanges, deleteBeforeReplace).
"""

from __future__ import annotations

import re

import pytest
import yaml

from bootstrap import node_layout
from cluster import hostpaths
from cluster.platform import AWS
from infra.config import PlanError
from tests.support.pulumi_mocks import (
    CANONICAL,
    DLAMI_ID,
    UBUNTU_ID,
    ClusterMocks,
    Run,
    run_program,
    stack_config,
    user_data_of,
)
from tests.unit.test_bootstrap_render import script_packages
from tests.unit.test_infra_program import _decoded_files, _instances

NEWER_DLAMI = "ami-05e1d2c3b4a596877"  # next week's Deep Learning Base AMI
NEWER_UBUNTU = "ami-0b7c6d5e4f3a2b1c0"  # Canonical's next Ubuntu 24.04 build


def _image_stashes(run: Run) -> list:
    return [s for s in run.of_type("stash") if "-images-" in s.name]  # not the zone's (infra/network.py)


def _by_name(run: Run) -> dict[str, object]:
    return {r.name: r for r in run.of_type("instance")}


def _later_up(first: Run, config: dict, **mocks) -> Run:
    """A later `pulumi up` of the stack `first` made: the engine's stash state carried over,
    the image look-up answering with what is newest now."""
    return run_program(config, ClusterMocks(stashed=first.mocks.stashed, **mocks))


def test_a_newer_image_changes_no_instance():
    config = stack_config()
    first = run_program(config)
    later = _later_up(first, config, newest_dlami=NEWER_DLAMI, newest_ubuntu=NEWER_UBUNTU)
    # The look-up did see the newer images (not a vacuous pass) ...
    assert {r.inputs["input"] for r in _image_stashes(later)} == {NEWER_DLAMI, NEWER_UBUNTU}
    before, after = _by_name(first), _by_name(later)
    assert set(before) == set(after) and len(after) == 3
    for name, inst in after.items():
        # ... yet every instance is declared exactly as before,
        assert inst.inputs == before[name].inputs, name
        # and the engine is told to keep the image it was created with.
        assert "ami" in inst.ignore_changes, name
    assert {n: i.inputs["ami"] for n, i in after.items() if "controller" in n} == {"mini-nodes-controller": UBUNTU_ID}
    assert {i.inputs["ami"] for n, i in after.items() if "gpu" in n} == {DLAMI_ID}
    # The output says which image each host runs: what `pulumi config set slurm-gpu:amiId` pins.
    assert later.outputs["images"] == first.outputs["images"] == {
        "controller": UBUNTU_ID, "gpu-node-01": DLAMI_ID, "gpu-node-02": DLAMI_ID}


def test_a_node_added_later_boots_the_stacks_image():
    """Growing the cluster after a new image is out: the new node matches the others."""
    first = run_program(stack_config(gpuNodeCount=2))
    later = _later_up(first, stack_config(gpuNodeCount=3), newest_dlami=NEWER_DLAMI)
    _, gpus = _instances(later)
    assert [g.inputs["tags"]["Name"] for g in gpus] == ["mini-gpu-node-01", "mini-gpu-node-02", "mini-gpu-node-03"]
    assert {g.inputs["ami"] for g in gpus} == {DLAMI_ID}


def test_a_new_stack_boots_the_newest_images():
    run = run_program(stack_config(), ClusterMocks(newest_dlami=NEWER_DLAMI, newest_ubuntu=NEWER_UBUNTU))
    controller, gpus = _instances(run)
    assert controller[0].inputs["ami"] == NEWER_UBUNTU
    assert {g.inputs["ami"] for g in gpus} == {NEWER_DLAMI}


def test_fixed_addresses_are_deleted_before_replacement():
    """An instance or interface with a fixed IP (or a pre-made interface) cannot exist twice:
    any replacement deletes the old one first."""
    for config in (stack_config(), stack_config(gpuInstanceType="p5.48xlarge")):
        run = run_program(config)
        assert run.of_type("instance") and run.of_type("eni")
        for res in run.of_type("instance") + run.of_type("eni"):
            assert res.delete_before_replace is True, res.name
        controller, _ = _instances(run)
        assert controller[0].inputs["privateIp"] == "10.0.0.10"


def test_moving_to_a_newer_image_is_a_config_setting():
    """`pulumi config set slurm-gpu:amiId NEW` (docs/AWS.md: Moving to a newer image): the GPU
    nodes follow it (replaced, each deleted first); the controller keeps its image."""
    first = run_program(stack_config())
    later = _later_up(first, stack_config(amiId=NEWER_DLAMI), newest_dlami=NEWER_DLAMI,
                      newest_ubuntu=NEWER_UBUNTU)
    controller, gpus = _instances(later)
    for node in gpus:
        assert node.inputs["ami"] == NEWER_DLAMI
        assert "ami" not in node.ignore_changes and node.delete_before_replace
    assert controller[0].inputs["ami"] == UBUNTU_ID and "ami" in controller[0].ignore_changes
    # And the controller by its own setting.
    moved = _later_up(first, stack_config(controllerAmiId=NEWER_UBUNTU), newest_ubuntu=NEWER_UBUNTU)
    controller, gpus = _instances(moved)
    assert controller[0].inputs["ami"] == NEWER_UBUNTU
    assert controller[0].ignore_changes == ("userData", "userDataBase64") and controller[0].delete_before_replace
    assert {g.inputs["ami"] for g in gpus} == {DLAMI_ID}


def test_configured_images_are_looked_up_by_id_and_not_stashed():
    run = run_program(stack_config(amiId=NEWER_DLAMI, controllerAmiId=NEWER_UBUNTU))
    looked_up = [a for t, a in run.mocks.calls if t == "aws:ec2/getAmi:getAmi"]
    assert sorted(f["values"] for a in looked_up for f in a["filters"]) == [[NEWER_DLAMI], [NEWER_UBUNTU]]
    assert _image_stashes(run) == []
    controller, gpus = _instances(run)
    assert controller[0].inputs["ami"] == NEWER_UBUNTU and {g.inputs["ami"] for g in gpus} == {NEWER_DLAMI}


# ---------------------------------------------------------------- the controller's image

def test_controller_boots_plain_ubuntu_and_gpu_nodes_the_dlami():
    run = run_program(stack_config())
    controller, gpus = _instances(run)
    assert controller[0].inputs["instanceType"] == "c6i.xlarge"  # not on the DLAMI's list
    assert controller[0].inputs["ami"] == UBUNTU_ID
    assert {g.inputs["ami"] for g in gpus} == {DLAMI_ID}
    owners = {a["owners"][0] for t, a in run.mocks.calls if t == "aws:ec2/getAmi:getAmi"}
    assert owners == {CANONICAL, "amazon"}


def test_platform_declares_both_images_of_one_release():
    images = AWS.images
    assert (images["controller"].owner, images["controller"].gpu_stack) == (CANONICAL, False)
    assert (images["gpu"].owner, images["gpu"].gpu_stack) == ("amazon", True)
    # Same Ubuntu release, so the same Python and Slurm from its apt on every host.
    release = AWS.os.split()[-1]
    assert all(release in image.name for image in images.values()), images


def test_controller_user_data_needs_no_gpu_driver_or_efa():
    """Guard: plain Ubuntu has neither; only the configs it serves to the nodes name devices."""
    run = run_program(stack_config(gpuInstanceType="p5.48xlarge"))
    controller, _ = _instances(run)
    doc = yaml.safe_load(user_data_of(controller[0]))
    files = _decoded_files(doc)
    served = {node_layout.SLURM_CONF, node_layout.GRES_CONF, node_layout.CGROUP_CONF}
    for path, text in files.items():
        if path in served:
            continue
        found = re.findall(r"\b(?:nvidia[\w-]*|cuda|efa|fi_info|fabricmanager)\b|/opt/amazon", text, re.I)
        assert not found, (path, found)
    assert not any("nvidia" in p or "cuda" in p for p in script_packages(files[hostpaths.BOOTSTRAP_PATH]))


BAD = [
    ("controllerAmiId", {"controllerAmiId": "ubuntu-24.04"}, {}),
    ("controllerAmiId", {"controllerAmiId": "ami-0c1d2e3f4a5b6c7d8"}, {"arches": {"ami-0c1d2e3f4a5b6c7d8": "arm64"}}),
    ("amiId", {"amiId": "ami-12345678"}, {"arches": {"ami-12345678": "arm64"}}),
    ("rootVolumeGiB", {"rootVolumeGiB": 60}, {"ami_root_gib": 75}),
]


@pytest.mark.parametrize("setting,config,mocks", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_image_settings_are_refused_before_any_resource(setting, config, mocks):
    m = ClusterMocks(**mocks)
    with pytest.raises(PlanError, match=f"slurm-gpu:{setting}"):
        run_program(stack_config(**config), m)
    assert m.resources == [] and m.components == []


def test_an_image_that_cannot_be_found_names_its_setting():
    class NoUbuntu(ClusterMocks):
        def call(self, args):
            if args.token == "aws:ec2/getAmi:getAmi" and args.args.get("owners") == [CANONICAL]:
                return {}, [("", "Your query returned no results. Please change your search criteria")]
            return super().call(args)

    m = NoUbuntu()
    with pytest.raises(PlanError, match=r"slurm-gpu:controllerAmiId ami-\.\.\."):
        run_program(stack_config(), m)
    assert m.resources == []


def test_a_controller_image_with_an_extra_ebs_volume_is_refused():
    """Its bootstrap takes the one unmounted EBS disk as /scratch's volume: an image's own second
    volume could be taken for it (an instance-store mapping has no ebs and is fine)."""
    class TwoVolumes(ClusterMocks):
        def call(self, args):
            result = super().call(args)
            if args.token == "aws:ec2/getAmi:getAmi" and args.args.get("owners") == [CANONICAL]:
                result = {**result, "blockDeviceMappings": [
                    *result["blockDeviceMappings"],
                    {"deviceName": "/dev/sdb", "ebs": {"volume_size": "50"}, "noDevice": "", "virtualName": ""},
                    {"deviceName": "/dev/sdc", "ebs": {}, "noDevice": "", "virtualName": "ephemeral0"}]}
            return result

    m = TwoVolumes()
    with pytest.raises(PlanError, match=r"slurm-gpu:controllerAmiId: the controller image .* maps EBS "
                                          r"volumes besides its root \(/dev/sdb\)"):
        run_program(stack_config(), m)
    assert m.resources == []
