"""Which images the cluster boots, and how a stack keeps them.

Two images, both facts of the AWS platform (cluster/platform.py): the GPU nodes boot the
Deep Learning Base GPU AMI for Ubuntu 24.04 (NVIDIA driver, CUDA, EFA with aws-ofi-nccl);
the controller boots Canonical's plain Ubuntu 24.04 server image (same Python and Slurm,
no GPU stack; the GPU image does not list C6i). The ARM64 builds are excluded by the
architecture filter.

Both are re-released often (the DLAMI about weekly). A new image id on an instance replaces
it, so a stack keeps the images it was created with: the newest match is looked up at every
`pulumi up`, but the instances take the id a `pulumi.Stash` recorded at the stack's first
`pulumi up` and ignore later changes of `ami` (which also protects stacks created before the
stash existed). Moving to a newer image is deliberate: `pulumi config set slurm-gpu:amiId`
(GPU nodes) or `slurm-gpu:controllerAmiId`; those ids are taken as given and a change
replaces the instances, each deleted before its replacement is made (fixed addresses).
Why 24.04: docs/PLATFORM.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.platform import AWS, MachineImage
from cluster.stack_config import StackConfig
from infra.config import PlanError
from infra.instance_types import ARCH

ROLES = ("controller", "gpu")
CONFIG_KEY = {"controller": "controllerAmiId", "gpu": "amiId"}


@dataclass(frozen=True)
class Ami:
    id: str
    name: str
    root_device_name: str
    root_snapshot_gib: int | None
    # True: the stack's config names this image (slurm-gpu:amiId / controllerAmiId); the
    # instances follow it. False: the newest match now, which the stack's stash overrides.
    configured: bool = False


def resolve_ami(cfg: StackConfig, role: str = "gpu") -> Ami:
    """The image a role would boot today: the configured id, or the newest platform match."""
    image: MachineImage = AWS.images[role]
    key = CONFIG_KEY[role]
    configured = cfg.ami_id if role == "gpu" else cfg.controller_ami_id
    if configured:
        filters = [{"name": "image-id", "values": [configured]}]
        owners = None
        what = f"slurm-gpu:{key} {configured}"
    else:
        filters = [
            {"name": "name", "values": [image.name]},
            {"name": "architecture", "values": [ARCH]},
            {"name": "state", "values": ["available"]},
        ]
        owners = [image.owner]
        what = f"the newest '{image.name}' image (owner {image.owner})"
    try:
        res = aws.ec2.get_ami(most_recent=True, owners=owners, filters=filters)
    except Exception as exc:
        raise PlanError(
            f"could not find {what} in this region ({exc}); set an AMI with "
            f"`pulumi config set slurm-gpu:{key} ami-...`"
        ) from exc
    if res.architecture and res.architecture != ARCH:
        raise PlanError(f"slurm-gpu:{key} {res.id} is {res.architecture}; the cluster needs {ARCH}; "
                          f"set an {ARCH} image with `pulumi config set slurm-gpu:{key} ami-...`")
    root = next((m for m in res.block_device_mappings or []
                 if m.device_name == res.root_device_name), None)
    size = None
    if root is not None and root.ebs and root.ebs.get("volume_size"):
        size = int(root.ebs["volume_size"])
    if size is not None and cfg.root_volume_gib < size:
        raise PlanError(
            f"slurm-gpu:rootVolumeGiB is {cfg.root_volume_gib} but the {role} image {res.id} needs at "
            f"least {size} GiB; set it with `pulumi config set slurm-gpu:rootVolumeGiB {max(size, 200)}`"
        )
    extra = sorted(m.device_name for m in res.block_device_mappings or []
                   if m.ebs and m.device_name != res.root_device_name)
    if role == "controller" and extra:
        # The controller's bootstrap takes the one EBS disk nothing is mounted from as /scratch's own
        # volume (bootstrap-controller.sh.j2 scratchvol): an image's extra EBS volume could be taken.
        raise PlanError(
            f"slurm-gpu:{key}: the controller image {res.id} maps EBS volumes besides its root "
            f"({', '.join(extra)}), which the controller could mount as /scratch; use an image with only "
            f"a root volume (unset it: `pulumi config rm slurm-gpu:{key}`)"
        )
    return Ami(id=res.id, name=res.name, root_device_name=res.root_device_name,
               root_snapshot_gib=size, configured=bool(configured))


def resolve_images(cfg: StackConfig) -> dict[str, Ami]:
    """Role -> the image it would boot today (plan time; declares nothing)."""
    return {role: resolve_ami(cfg, role) for role in ROLES}


@dataclass(frozen=True)
class ImagesArgs:
    """What ImagesComponent keeps: each role's image as the plan resolved it (infra/ami.py resolve_images)."""

    images: dict[str, Ami]


class ImagesComponent(pulumi.ComponentResource):
    """The image id each role's instances take: the configured one, else the stack's stash.

    `ami[role]` is the id to launch with; `follow[role]` says whether a change of it must
    reach existing instances (configured ids) or be ignored (the stash's, see the module doc).
    """

    def __init__(self, name: str, args: ImagesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Images", name, None, opts)
        self.ami: dict[str, pulumi.Output[str]] = {}
        self.follow: dict[str, bool] = {}
        self.stashes: dict[str, pulumi.Stash] = {}
        for role, image in args.images.items():
            self.follow[role] = image.configured
            if image.configured:
                self.ami[role] = pulumi.Output.from_input(image.id)
                continue
            stash = pulumi.Stash(f"{name}-{role}", input=image.id, opts=pulumi.ResourceOptions(parent=self))
            self.stashes[role] = stash
            self.ami[role] = stash.output
            pulumi.Output.all(stash.input, stash.output).apply(lambda v, r=role: _tell_if_newer(r, *v))
        self.register_outputs({f"{role}Ami": ami for role, ami in self.ami.items()})


def _tell_if_newer(role: str, newest: str | None, kept: str | None) -> None:
    if newest and kept and newest != kept:
        pulumi.log.info(f"a newer {role} image {newest} is out; this stack keeps {kept}. To move to it: "
                        f"`pulumi config set slurm-gpu:{CONFIG_KEY[role]} {newest}` and `pulumi up` "
                        "(replaces those instances: docs/AWS.md, 'Moving to a newer image')")
