"""The Pulumi program: config -> plan-time facts -> components -> outputs.

Everything that can refuse the stack (config, instance-type facts, AZ, AMI) runs
before the first resource is declared, so a bad setting creates nothing.
"""

from __future__ import annotations

import pulumi

from bootstrap.facts import ClusterFacts, PowerSave, plan_hosts
from bootstrap.platform import AWS
from infra import config as stack_config
from infra.ami import resolve_ami
from infra.cluster import ClusterComponent
from infra.instance_types import check_controller_type, choose_availability_zone, lookup_gpu_node_facts

SSH_USER = "ubuntu"  # the Ubuntu AMI's login user
# Power saving on EC2: a stop may take this long before the node can be started again
# (the resume program also waits for "stopped"), and a start (boot, driver, slurmd) this long
# before Slurm gives up on the node and requeues its job.
SUSPEND_TIMEOUT_S = 180
RESUME_TIMEOUT_S = 900


def power_save(cfg: stack_config.StackConfig, region: str | None) -> PowerSave | None:
    """slurm.conf's power saving from slurm-gpu:idleStopMinutes (0: none)."""
    if cfg.idle_stop_minutes == 0:
        return None
    from bootstrap.render import RESUME_PATH, SUSPEND_PATH

    return PowerSave(suspend_time=cfg.idle_stop_minutes * 60, suspend_program=SUSPEND_PATH,
                     resume_program=RESUME_PATH, suspend_timeout=SUSPEND_TIMEOUT_S,
                     resume_timeout=RESUME_TIMEOUT_S, provider="ec2", region=region)


def plan(cfg: stack_config.StackConfig) -> tuple[ClusterFacts, str, str, int]:
    """Look up instance facts, AZ and AMI; refuse bad combinations. Declares nothing.
    Returns the cluster facts, the AZ, the AMI id and the EFA interfaces per GPU node."""
    gpu = lookup_gpu_node_facts(cfg)
    check_controller_type(cfg)
    az = choose_availability_zone(cfg)
    ami = resolve_ami(cfg)
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
        power_save=power_save(cfg, pulumi.Config("aws").get("region")),
        platform=AWS,
    )
    return facts, az, ami.id, gpu.efa_interfaces


def render_user_data(facts: ClusterFacts) -> dict[str, str]:
    """The controller's cloud-config and each GPU node's own, keyed "controller" and by
    node name, from bootstrap/ (which owns the content). A GPU node's depends on it alone."""
    from bootstrap.render import user_data

    try:
        texts = {"controller": user_data(facts, "controller")}
        texts.update({h.name: user_data(facts, "gpu", h.name) for h in facts.gpu_nodes})
        return texts
    except ValueError as exc:  # e.g. over EC2's 16 KiB user-data limit
        raise stack_config.ConfigError(
            f"slurm-gpu:gpuNodeCount is {len(facts.gpu_nodes)}: the cluster's user-data cannot be "
            f"built ({exc}); lower it with `pulumi config set slurm-gpu:gpuNodeCount N`"
        ) from exc


def main() -> dict[str, pulumi.Output]:
    cfg = stack_config.load()
    facts, az, ami_id, efa_interfaces = plan(cfg)
    user_data = render_user_data(facts)
    region = pulumi.Config("aws").get("region")

    cluster = ClusterComponent(
        cfg.cluster_name, cfg=cfg, facts=facts, ami_id=ami_id, availability_zone=az,
        user_data=user_data, efa_interfaces=efa_interfaces, region=region,
    )
    outputs = {
        "controllerPublicIp": cluster.controller_public_ip,
        "nodes": cluster.node_list,
        "sshUser": facts.ssh_user,
        "clusterName": facts.cluster_name,
        "inventory": cluster.inventory,
    }
    for key, value in outputs.items():
        pulumi.export(key, value)
    return outputs
