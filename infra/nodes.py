"""The cluster's hosts: a key pair, a cluster placement group, the controller, N GPU nodes.

Every host has a fixed private IP (cluster.facts.plan_hosts). IMDSv2 is required and
root volumes are encrypted gp3 on every host. The shared /scratch is the controller's own encrypted
gp3 volume (scratch_volume), attached to it and kept across a controller replacement.

The controller lives in the public subnet with a public IP (the only host reachable from
adminCidr; fab's jump host). Its user-data holds the node list, but cloud-init reads
user-data only at first boot: later node-list changes reach it through `fab reconfigure`,
so the program ignores changes to it instead of stopping and starting the controller.

GPU nodes live in the private subnet with no public address (outbound through the NAT
gateway). Each gets one EFA interface per network card the instance type has (p5.48xlarge:
32), all in the cluster's security group: card 0's is the primary interface (type `efa`,
with the node's fixed IP), the others are `efa-only` (no IP address, RDMA traffic only).
EFA interfaces cannot be attached to a running instance, so they are all attached at
launch. Each node's user-data depends on that node alone (slurmd runs configless), so
adding or removing nodes changes no other node.

Images (infra/ami.py): the controller boots plain Ubuntu 24.04, GPU nodes the DLAMI. A newer
image found by a later `pulumi up` changes no instance: the ids come from the stack's stash
and `ami` changes are ignored unless the config names the image. Where an instance is
replaced (a configured image moved), it is deleted first: its fixed private IP and its
pre-made interfaces cannot belong to two instances, so create-before-delete would fail.
The same holds for the interfaces themselves (the primary one has the node's fixed IP).

Code updates: no instance input that a new checkout can change stops, starts or replaces a
running host (IGNORED_ON_UPDATE, DELIBERATE): user-data is read at first boot only, so every host ignores
changes to it; `fab update-nodes` brings bootstrap changes to running GPU nodes, idle ones only.
An instance replaced on purpose (a new image, key pair or EBS key) boots the user-data kept in the
state, not the current one: the engine puts the old inputs of ignored properties into the goal
state, replacement included (pulumi/pulumi#2657; Pulumi docs, "Resource option: ignoreChanges").
Its bootstrap record says so: `fab status` names it behind and `fab update-nodes` updates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.facts import STACK_TAG, ClusterFacts, Host
from cluster.gp3 import GP3_IOPS, GP3_THROUGHPUT
from infra.quotas import stack_name

# What the provider does when an instance input changes on `pulumi up` (pulumi_aws 7.x
# ec2.Instance input docs: "Updates to this field will trigger a stop/start of the EC2 instance";
# terraform-provider-aws internal/service/ec2/ec2_instance.go: resourceInstanceUpdate changes
# instance_type, user_data and user_data_base64 through modifyInstanceAttributeWithStopStart
# (StopInstances, ModifyInstanceAttribute, StartInstances), and the schema's ForceNew inputs
# replace the instance). A stop/start kills the node's jobs, Slurm marks it DOWN "unexpectedly
# rebooted", and cloud-init does not run the new user-data (same instance id). So user-data,
# which the bootstrap templates and pins change with every `git pull`, is ignored on update
# (IGNORED_ON_UPDATE); the other such inputs the program sets change only with the stack's
# config or state, never with the code (DELIBERATE, with why). tests/unit/test_infra_updates.py
# checks both against the installed pulumi_aws.
IGNORED_ON_UPDATE = ("userData", "userDataBase64")
DELIBERATE = {
    "ami": "kept per stack (infra/ami.py stash), ignored unless slurm-gpu:amiId/controllerAmiId names "
           "an image: moving to a newer image replaces the host on purpose",
    "instanceType": "slurm-gpu:gpuInstanceType / controllerInstanceType: a config change; it stops and starts "
                    "every GPU node, power-saved ones included (modifyInstanceAttributeWithStopStart starts the "
                    "instance whatever its state was): drain the nodes and let them idle first (docs/CONFIG.md)",
    "keyName": "the key pair made from slurm-gpu:sshPublicKey: a config change that replaces every host "
               "(key_name is ForceNew; /scratch's own volume is kept and attached again): rotate keys through "
               "~/.ssh/authorized_keys instead (docs/CONFIG.md)",
    "placementGroup": "the cluster's placement group resource (fixed once made) or a Capacity Block's own, "
                      "or none (spot, capacity-reservation): it changes only with slurm-gpu:gpuMarket / "
                      "capacityReservationId, which replace every GPU node through replacement_trigger "
                      "(infra/market.py market_key)",
    "subnetId": "the VPC's subnets: fixed once made",
    "privateIp": "the controller's fixed address (cluster.facts.plan_hosts of slurm-gpu:subnetCidr)",
    "associatePublicIpAddress": "the controller always has one",
    "primaryNetworkInterface": "the node's own primary interface resource: fixed once made",
    "networkInterfaces": "the node's own EFA interface resources (cards of its instance type): fixed once made",
    "instanceMarketOptions": "slurm-gpu:gpuMarket (spot, capacity-block): a config change that replaces every "
                             "GPU node (replacement_trigger: infra/market.py market_key): drain the nodes first "
                             "(docs/CONFIG.md)",
    "capacityReservationSpecification": "slurm-gpu:gpuMarket / capacityReservationId: a config change that "
                                        "replaces every GPU node (replacement_trigger: infra/market.py "
                                        "market_key): drain the nodes first",
    "rootBlockDevice": "size and encryption key from slurm-gpu:rootVolumeGiB, ebsKmsKeyId: config changes (the "
                       "size modifies the volume in place; the key would replace the host); throughput and "
                       "IOPS fixed at gp3's baseline (modified in place)",
}
# The scratch volume's inputs a `pulumi up` leaves as they were made (_scratch_volume).
SCRATCH_VOLUME_KEPT = ["kmsKeyId"]


@dataclass(frozen=True)
class NodesArgs:
    """What NodesComponent makes the hosts from: the plan's facts and settings, each role's image
    (`follow_ami`: whether a change of it reaches running instances), the network's subnets, group,
    zone and routes (`*_internet`: what an instance waits for), the rendered user-data, and the GPU
    nodes' market (infra/market.py: instance arguments, placement group, replacement key)."""

    facts: ClusterFacts
    ssh_public_key: str
    ami: dict[str, pulumi.Input[str]]
    follow_ami: dict[str, bool]
    controller_instance_type: str
    gpu_instance_type: str
    root_volume_gib: int
    public_subnet_id: pulumi.Input[str]
    gpu_subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    user_data: dict[str, str]
    controller_zone: pulumi.Input[str]
    scratch_size_gib: int
    efa_interfaces: int
    controller_internet: Sequence[pulumi.Resource]
    gpu_internet: Sequence[pulumi.Resource]
    controller_instance_profile: pulumi.Input[str] | None = None
    ebs_key_arn: str | None = None
    scratch_throughput_mbps: int | None = None
    scratch_iops: int | None = None
    gpu_market_args: dict | None = None
    gpu_placement_group: bool | str | None = True
    gpu_market_key: str | None = None
    gpu_market_ignored: Sequence[str] = ()
    placement_group_replace_with: Sequence[pulumi.Resource] = ()


class NodesComponent(pulumi.ComponentResource):
    def __init__(self, name: str, args: NodesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Nodes", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        facts = args.facts
        cluster = facts.cluster_name
        self._cluster = cluster
        self._root_volume_gib = args.root_volume_gib
        self._ebs_key_arn = args.ebs_key_arn

        self.key_pair = aws.ec2.KeyPair(
            f"{name}-key", public_key=args.ssh_public_key,
            tags={"Cluster": cluster, "Name": f"{cluster}-admin"}, opts=child,
        )
        # True: the stack's own cluster placement group; a name: a reservation's; None: none
        # (a stop-on-interruption spot instance cannot be in one: infra/market.py).
        self.placement_group = aws.ec2.PlacementGroup(
            f"{name}-pg", strategy="cluster",
            tags={"Cluster": cluster, "Name": f"{cluster}-gpu"},
            opts=pulumi.ResourceOptions(parent=self, replace_with=list(args.placement_group_replace_with) or None),
        ) if args.gpu_placement_group is True else None
        gpu_group = self.placement_group.name if self.placement_group else args.gpu_placement_group

        self.scratch_volume = self._scratch_volume(name, facts, args.controller_zone, args.scratch_size_gib,
                                                   args.scratch_throughput_mbps, args.scratch_iops)

        self.controller = aws.ec2.Instance(
            f"{name}-{facts.controller.name}",
            ami=args.ami["controller"],
            instance_type=args.controller_instance_type,
            key_name=self.key_pair.key_name,
            # Only the controller has a role: it stops/starts idle GPU nodes (infra/power_role.py).
            iam_instance_profile=args.controller_instance_profile,
            subnet_id=args.public_subnet_id,
            private_ip=facts.controller.ip,
            vpc_security_group_ids=[args.security_group_id],
            associate_public_ip_address=True,
            metadata_options=self._imdsv2(),
            # The shared /scratch is its own volume (scratch_volume), not a folder of the root one.
            root_block_device=self._root("controller", facts.controller),
            # Its bootstrap finds the scratch volume as the one unmounted EBS disk, not by id: a
            # replacement boots this first user-data (IGNORED_ON_UPDATE) whatever the volume's id.
            user_data_base64=args.user_data["controller"],
            tags=self._instance_tags("controller", facts.controller),
            # Boot only once the subnet routes to the internet: the bootstrap installs packages.
            # User-data is read at first boot only; node-list changes go by `fab reconfigure`.
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.controller_internet),
                                        ignore_changes=[*IGNORED_ON_UPDATE,
                                                        *self._ignore_ami(args.follow_ami, "controller")],
                                        delete_before_replace=True),
        )

        self.scratch_attachment = self._scratch_attachment(name, facts)

        self.gpu_interfaces: dict[str, list[aws.ec2.NetworkInterface]] = {}
        self.gpu_nodes: list[aws.ec2.Instance] = []
        for host in facts.gpu_nodes:
            enis = self._gpu_interfaces(name, host, args.gpu_subnet_id, args.security_group_id, args.efa_interfaces)
            if len(enis) == 1:
                interfaces = {"primary_network_interface": {"network_interface_id": enis[0].id}}
            else:
                # Several cards: all attached at launch (an EFA cannot be hot-attached). Card 0
                # device 0 is the primary; the EFA-only interfaces take device index 1 on their cards.
                interfaces = {"network_interfaces": [
                    {"network_interface_id": eni.id, "network_card_index": card,
                     "device_index": 0 if card == 0 else 1}
                    for card, eni in enumerate(enis)
                ]}
            node = aws.ec2.Instance(
                f"{name}-{host.name}",
                ami=args.ami["gpu"],
                instance_type=args.gpu_instance_type,
                key_name=self.key_pair.key_name,
                placement_group=gpu_group,
                # No iam_instance_profile: a GPU node's metadata holds no role credentials, so a job
                # there finds none to take (the controller's, the power role, is guarded on the
                # controller: its bootstrap's `imds` step).
                metadata_options=self._imdsv2(),
                root_block_device=self._root("gpu", host),
                user_data_base64=args.user_data[host.name],
                tags=self._instance_tags("gpu", host),
                # Boot only once the private subnet routes out through the NAT gateway.
                # Its interfaces (and so its IP) pass to a replacement only once it is gone.
                # New user-data would stop/start it (IGNORED_ON_UPDATE): `fab update-nodes` instead.
                # A market change replaces the node (gpu_market_key, infra/market.py: the
                # provider sees no diff when a Computed market block is left out).
                opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.gpu_internet),
                                            ignore_changes=[*IGNORED_ON_UPDATE,
                                                            *self._ignore_ami(args.follow_ami, "gpu"),
                                                            *args.gpu_market_ignored],  # infra/market.py
                                            replacement_trigger=args.gpu_market_key,
                                            delete_before_replace=True),
                **interfaces,
                **(args.gpu_market_args or {}),
            )
            self.gpu_interfaces[host.name] = enis
            self.gpu_nodes.append(node)

        self.register_outputs({
            "controllerId": self.controller.id,
            "controllerPublicIp": self.controller.public_ip,
            "gpuNodeIds": [n.id for n in self.gpu_nodes],
            "scratchVolumeId": self.scratch_volume.id,
        })

    def _scratch_volume(self, name: str, facts: ClusterFacts, zone: pulumi.Input[str], size_gib: int,
                        throughput: int | None, iops: int | None) -> aws.ebs.Volume:
        """The shared /scratch's own gp3 volume: an NFS client's root that forges file handles (AUTH_SYS)
        reaches this file system alone, never the controller's root one (docs/SECURITY.md).

        Inputs (pulumi_aws ebs/volume.py VolumeArgs): availability_zone (ForceNew in
        terraform-provider-aws internal/service/ec2/ebs_volume.go): the controller's subnet's zone, not
        the instance's. A zone move replaces it, empty: /scratch's data does not move (docs/CONFIG.md);
        a new key does not (SCRATCH_VOLUME_KEPT). size (GiB; grows in place, never
        shrinks), type gp3 with throughput (MiB/s) and iops ("Only valid for type of io1, io2 or gp3"),
        encrypted with kms_key_id (None: the account's default EBS key). final_snapshot stays off:
        `pulumi destroy` deletes the volume and its data, like the hosts. It is not the instance's, so
        a replaced controller finds it again with its data (the attachment is made anew)."""
        return aws.ebs.Volume(
            f"{name}-scratch",
            availability_zone=zone,
            type="gp3",
            size=size_gib,
            throughput=throughput,  # MiB/s; None: gp3's baseline (125)
            iops=iops,
            encrypted=True,
            kms_key_id=self._ebs_key_arn,
            tags={"Cluster": self._cluster, "Role": "scratch", "Name": f"{self._cluster}-scratch",
                  STACK_TAG: stack_name()},
            # A new ebsKmsKeyId would replace the volume (kms_key_id is ForceNew), made empty and the
            # old one deleted with /scratch's data: the volume keeps the key it was made with.
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=SCRATCH_VOLUME_KEPT),
        )

    def _scratch_attachment(self, name: str, facts: ClusterFacts) -> aws.ec2.VolumeAttachment:
        """The scratch volume on the controller (pulumi_aws ec2/volume_attachment.py VolumeAttachmentArgs).
        device_name /dev/sdf is EC2's block device mapping name; on Nitro the volume shows up as an NVMe
        device that the bootstrap finds as the one unmounted EBS disk, not by this name. Never change
        device_name: it is ForceNew, and replacing the attachment alone stops the controller
        (stop_instance_before_detaching), which nothing starts again. instance_id and volume_id
        are ForceNew: a replaced controller gets a new attachment. stop_instance_before_detaching:
        "Stops the instance, if it is not already stopped" before the detach, so the controller shuts
        down (and unmounts /scratch cleanly) before its volume leaves it on a replacement or a destroy;
        force_detach stays off (its docs: "can result in data loss"); skip_destroy stays off (the
        volume is really detached, so it can be attached to the next controller). Deleted before its
        replacement is made: a gp3 volume attaches to one instance at a time (no Multi-Attach)."""
        return aws.ec2.VolumeAttachment(
            f"{name}-scratch-attachment",
            device_name="/dev/sdf",
            volume_id=self.scratch_volume.id,
            instance_id=self.controller.id,
            stop_instance_before_detaching=True,
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),
        )

    def _gpu_interfaces(self, name: str, host: Host, subnet_id, security_group_id,
                        efa_interfaces: int) -> list[aws.ec2.NetworkInterface]:
        """Card 0's primary interface (EFA when efa is on), then one EFA-only per other card."""
        enis = [aws.ec2.NetworkInterface(
            f"{name}-{host.name}-eni",
            subnet_id=subnet_id,
            private_ips=[host.ip],
            security_groups=[security_group_id],
            interface_type="efa" if efa_interfaces else None,
            description=f"{self._cluster} {host.name} primary interface",
            tags=self._tags("gpu", host),
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),  # its fixed IP
        )]
        for card in range(1, efa_interfaces):
            enis.append(aws.ec2.NetworkInterface(
                f"{name}-{host.name}-efa{card}",
                subnet_id=subnet_id,
                security_groups=[security_group_id],
                interface_type="efa-only",
                description=f"{self._cluster} {host.name} EFA-only interface, network card {card}",
                tags=self._tags("gpu", host),
                opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),
            ))
        return enis

    @staticmethod
    def _ignore_ami(follow_ami: dict[str, bool], role: str) -> list[str]:
        """Keep the image an instance was created with unless the config names one."""
        return [] if follow_ami[role] else ["ami"]

    def _tags(self, role: str, host: Host) -> dict[str, str]:
        return {"Cluster": self._cluster, "Role": role, "Name": f"{self._cluster}-{host.name}"}

    def _instance_tags(self, role: str, host: Host) -> dict[str, str]:
        """Also the owning stack: the quota check (infra/quotas.py) does not count its own instances
        as the account's others (a tag change is applied in place, without a stop)."""
        return {**self._tags(role, host), STACK_TAG: stack_name()}

    def _root(self, role: str, host: Host) -> aws.ec2.InstanceRootBlockDeviceArgs:
        """gp3 at its baseline throughput and IOPS, said explicitly: /scratch is not on it
        (scratch_volume), and a root disk that held it before kept its paid-for throughput when these
        were left out (Optional and Computed in terraform-provider-aws ec2_instance.go: no diff).
        Changed in place, without a stop (EBS Elastic Volumes)."""
        return aws.ec2.InstanceRootBlockDeviceArgs(
            volume_type="gp3",
            volume_size=self._root_volume_gib,
            throughput=GP3_THROUGHPUT[0],  # MiB/s
            iops=GP3_IOPS[0],
            encrypted=True,
            kms_key_id=self._ebs_key_arn,  # None: the account's default EBS key (infra/kms.py)
            delete_on_termination=True,
            tags=self._tags(role, host),
        )

    @staticmethod
    def _imdsv2() -> aws.ec2.InstanceMetadataOptionsArgs:
        """IMDSv2 only, and its token one network hop away, set on every instance whatever the AMI's
        or the account's default (pulumi_aws ec2 InstanceMetadataOptionsArgs: http_tokens,
        http_put_response_hop_limit). Session tokens required: IMDSv1's plain GETs are what SSRF
        attacks abuse. Hop limit 1: the PUT that makes a token is answered with IP TTL 1, so a
        container or VM behind a bridge on the host (one more hop) never gets one (EC2 User Guide,
        "Configure the instance metadata options", hop limit; https://docs.aws.amazon.com/AWSEC2/
        latest/UserGuide/configuring-instance-metadata-options.html)."""
        return aws.ec2.InstanceMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required",
                                                   http_put_response_hop_limit=1)
