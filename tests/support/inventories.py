"""Cluster specs (cluster/spec.py) for unit tests, from the few figures a test cares about.

Not a test file: the tests that need an inventory without a cluster build it here, so each
states only what it checks (the hosts, the GPUs, the AWS resources) and the spec stays typed.
"""

from __future__ import annotations

from cluster.facts import JOB_USER, ClusterFacts, Host, NodeShape, PowerSave
from cluster.platform import AWS, LOCAL
from cluster.spec import Access, AwsResources, ClusterSpec

SYSTEMCTL = "sudo systemctl {action} {service}"


def make(target: str = "aws", *, cluster_name: str = "mini", ssh_user: str | None = None,
         controller: tuple[str, str] = ("controller", "10.0.0.10"), public_ip: str | None = None,
         gpu_nodes: tuple[tuple[str, str], ...] = (), gpus_per_node: int = 4, gpu_type: str = "l4",
         nvlink: bool = False, efa: bool | None = None, python: str = "/opt/slurm-gpu/venv/bin/python",
         service_cmd: str = SYSTEMCTL, scratch: str = "/scratch", job_user: str = JOB_USER,
         ssh_key_file: str | None = None, known_hosts: str | None = None, aws: AwsResources | None = None,
         idle_stop_s: int | None = None, **facts) -> ClusterSpec:
    """A spec of `target`: `gpu_nodes` as (name, private ip); `aws` defaults to an empty
    AwsResources on target "aws"; `idle_stop_s`: power saving on (AWS's timeouts); `facts`: more
    ClusterFacts fields (platform, ...)."""
    on_aws = target == "aws"
    subnet = facts.pop("subnet_cidr", "10.0.0.0/16")
    if idle_stop_s is not None:
        facts["power_save"] = PowerSave(suspend_time=idle_stop_s, suspend_program="/usr/local/sbin/suspend",
                                        resume_program="/usr/local/sbin/resume", suspend_timeout=300,
                                        resume_timeout=900)
    shape = NodeShape(cpus=8, real_memory_mib=30000, gpu_count=gpus_per_node, gpu_type=gpu_type)
    cluster = ClusterFacts(
        cluster_name=cluster_name, controller=Host(*controller), gpu_nodes=tuple(Host(*n) for n in gpu_nodes),
        shape=shape, subnet_cidr=subnet, ssh_user=ssh_user or ("ubuntu" if on_aws else "root"),
        job_user=job_user, scratch=scratch, efa=on_aws if efa is None else efa, nvlink=nvlink,
        **{"platform": AWS if on_aws else LOCAL, **facts})
    return ClusterSpec(target=target, facts=cluster,
                       access=Access(python=python, service_cmd=service_cmd, controller_public_ip=public_ip,
                                     ssh_key_file=ssh_key_file, known_hosts=known_hosts),
                       aws=aws if aws is not None or not on_aws else AwsResources())
