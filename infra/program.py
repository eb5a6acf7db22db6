"""The Pulumi program: config -> plan-time facts -> components -> outputs.

Everything that can refuse the stack (config, instance-type facts, AZ, images, the EBS
key, the account's vCPU quotas) runs before the first resource is declared, so a bad setting
creates nothing.
"""

from __future__ import annotations

import dataclasses

import pulumi

from cluster.facts import ClusterFacts, PowerSave, plan_hosts
from cluster.platform import AWS
from cluster.settings import SPOT
from cluster.stack_config import StackConfig
from infra import config as stack_config
from infra.ami import Ami, resolve_images
from infra.cluster_component import ClusterArgs, ClusterComponent
from infra.instance_types import check_controller_type, choose_availability_zone, lookup_gpu_node_facts
from infra.kms import EbsKey, resolve_ebs_key
from infra.market import Reservation, check_reservation, zones_offering
from infra.quotas import check_cluster_name_is_ours, check_vcpu_quotas, stack_name
from infra.spot_guard import check_provider_followable

SSH_USER = "ubuntu"  # the Ubuntu AMI's login user
# Power saving on EC2: a stop may take this long before the node can be started again
# (the resume program also waits for "stopped"), and a start (boot, driver, slurmd) this long
# before Slurm gives up on the node and requeues its job.
SUSPEND_TIMEOUT_S = 180
RESUME_TIMEOUT_S = 900
# The oldest Pulumi CLI (engine) the program works with: 3.208.0 added the `replacement_trigger`
# resource option (which replaces the GPU nodes on a market change: infra/market.py) and the builtin
# Stash resource (infra/ami.py) (pulumi/pulumi CHANGELOG 3.208.0, PRs #20936 and #20819). The Python
# SDK sends replacement_trigger in RegisterResourceRequest without asking the engine whether it
# supports it (pulumi/runtime/resource.py, unlike deletedWith), so an older engine would ignore a
# market change silently. Pulumi.yaml's requiredPulumiVersion says the same to the CLI itself
# (tests/unit/test_infra_project.py keeps them equal).
MIN_PULUMI_CLI = "3.208.0"


def power_save(cfg: StackConfig) -> PowerSave | None:
    """slurm.conf's power saving from slurm-gpu:idleStopMinutes (0: none)."""
    if cfg.idle_stop_minutes == 0:
        return None
    from bootstrap.node_layout import RESUME_PATH, SUSPEND_PATH

    return PowerSave(suspend_time=cfg.idle_stop_minutes * 60, suspend_program=SUSPEND_PATH,
                     resume_program=RESUME_PATH, suspend_timeout=SUSPEND_TIMEOUT_S,
                     resume_timeout=RESUME_TIMEOUT_S, provider="ec2")


def plan(cfg: StackConfig) -> tuple[ClusterFacts, str, dict[str, Ami], int, EbsKey,
                                                 Reservation | None]:
    """Look up instance facts, AZ, images, the EBS key, the reservation and quotas; refuse bad
    combinations. Declares nothing. Returns the cluster facts, the AZ, each role's image, the EFA
    interfaces per GPU node, the root volumes' key and the GPU nodes' reservation (if any)."""
    gpu = lookup_gpu_node_facts(cfg)
    controller_vcpus = check_controller_type(cfg)
    reservation = check_reservation(cfg)
    if reservation and reservation.availability_zone and not cfg.availability_zone:
        # The nodes must launch in the reservation's zone: the stack follows it.
        cfg = dataclasses.replace(cfg, availability_zone=reservation.availability_zone)
    az = choose_availability_zone(cfg)
    images = resolve_images(cfg)
    region = pulumi.Config("aws").get("region")
    ebs_key = resolve_ebs_key(cfg, region)
    check_cluster_name_is_ours(cfg)
    if cfg.gpu_market == SPOT:
        check_provider_followable()
    # Last: a missing quota takes days to fix, so the other refusals come first.
    check_vcpu_quotas(cfg, gpu_vcpus=gpu.shape.cpus, controller_vcpus=controller_vcpus, region=region)
    controller, gpu_nodes = plan_hosts(cfg.subnet_cidr, cfg.gpu_node_count,
                                       controller_subnet=cfg.public_subnet_cidr)
    facts = ClusterFacts(
        cluster_name=cfg.cluster_name,
        controller=controller,
        gpu_nodes=gpu_nodes,
        shape=gpu.shape,
        subnet_cidr=cfg.subnet_cidr,
        ssh_user=SSH_USER,
        efa=cfg.efa,
        nvlink=gpu.nvlink,
        nvswitch=gpu.nvswitch,
        power_save=power_save(cfg),
        platform=AWS,
        spot=cfg.gpu_market == SPOT,
        region=region,
        stack=stack_name(),
    )
    return facts, az, images, gpu.efa_interfaces, ebs_key, reservation


def render_user_data(facts: ClusterFacts) -> dict[str, str]:
    """The controller's cloud-config and each GPU node's own, gzip-compressed and base64-encoded
    (EC2's user_data_base64), keyed "controller" and by node name, from bootstrap/ (which owns
    the content). A GPU node's depends on it alone."""
    from bootstrap.user_data import user_data_base64

    try:
        texts = {"controller": user_data_base64(facts, "controller")}
        texts.update({h.name: user_data_base64(facts, "gpu", h.name) for h in facts.gpu_nodes})
        return texts
    except ValueError as exc:  # e.g. over EC2's 16 KiB user-data limit
        raise stack_config.PlanError(
            f"slurm-gpu:gpuNodeCount is {len(facts.gpu_nodes)}: the cluster's user-data cannot be "
            f"built ({exc}); lower it with `pulumi config set slurm-gpu:gpuNodeCount N`"
        ) from exc


def main() -> dict[str, pulumi.Output]:
    # Before anything is declared: an older engine would drop replacement_trigger and Stash without a
    # word (MIN_PULUMI_CLI).
    pulumi.runtime.require_pulumi_version(f">={MIN_PULUMI_CLI}")
    cfg = stack_config.load()
    facts, az, images, efa_interfaces, ebs_key, reservation = plan(cfg)
    user_data = render_user_data(facts)
    region = pulumi.Config("aws").get("region")

    cluster = ClusterComponent(cfg.cluster_name, ClusterArgs(
        cfg=cfg, facts=facts, images=images, availability_zone=az,
        user_data=user_data,
        efa_interfaces=efa_interfaces, region=region, ebs_key=ebs_key,
        reservation=reservation,
    ))
    zones = zones_offering(cfg.gpu_instance_type)
    cluster.network.availability_zone.apply(lambda kept: _tell_if_not_offered(kept, cfg.gpu_instance_type, zones))
    outputs = {
        "controllerPublicIp": cluster.controller_public_ip,
        "nodes": cluster.node_list,
        "sshUser": facts.ssh_user,
        "clusterName": facts.cluster_name,
        "inventory": cluster.inventory,
        # The image each host runs (from its state): what to pin with slurm-gpu:amiId and
        # controllerAmiId, and what `pulumi up` keeps (docs/AWS.md: "Moving to a newer image").
        "images": cluster.images_running,
        # Where else the GPU type is offered: the zones to try when this one has no capacity
        # (InsufficientInstanceCapacity; docs/FAULTS.md).
        # "zone": where the stack's subnets are (kept from its first up: infra/network.py).
        "gpuTypeZones": {"instanceType": cfg.gpu_instance_type, "zone": cluster.network.availability_zone,
                         "zones": zones},
    }
    for key, value in outputs.items():
        pulumi.export(key, value)
    return outputs


def _tell_if_not_offered(kept: str | None, gpu_type: str, zones: list[str]) -> None:
    """The stack keeps its zone (infra/network.py); a GPU type changed since may not be offered there."""
    if kept and zones and kept not in zones:
        pulumi.log.warn(f"slurm-gpu:gpuInstanceType {gpu_type} is not offered in this stack's zone {kept} "
                        f"(offered in: {', '.join(zones)}): its nodes cannot launch or change type there. "
                        "Move the cluster with `pulumi config set slurm-gpu:availabilityZone ZONE` "
                        "(replaces every host: docs/FAULTS.md) or keep the old type")
