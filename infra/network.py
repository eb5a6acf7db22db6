"""The cluster's network: one VPC, a public subnet for the controller and a private one
for the GPU nodes, both in the AZ of the placement group.

- Public subnet: the controller (SSH from adminCidr only, the jump host for fab) and the
  NAT gateway; its route table sends 0.0.0.0/0 to the internet gateway.
- Private subnet: the GPU nodes, which have no public address. Their route table sends
  0.0.0.0/0 to the NAT gateway (one Elastic IP for the whole cluster), so apt, pip and
  model downloads work while nothing on the internet can open a connection to them.

Fixed private IPs come from cluster.facts (NAT gateway .4 and controller .10 of the public
subnet, gpu-node-NN .10+NN of the private one), so nothing takes another's address.
docs/NETWORK.md explains the design and its cost. The NAT gateway and its Elastic IP, which bill per
hour, carry the owning stack's STACK_TAG as the instances do (`fab status` counts a stack's spend by it);
a tag change is an in-place update (terraform-provider-aws's `tags` is the shared tftags.TagsSchema, never
ForceNew), so adding it to an existing stack replaces nothing: `pulumi preview` shows an update.

The zone is kept per stack as the images are (infra/ami.py): the zone chosen at the stack's first
`pulumi up` (the first that offers both instance types) goes into a `pulumi.Stash`, and the subnets
ignore later changes of `availability_zone`, so a zone AWS adds for the type, or a new GPU type,
moves nothing. Only slurm-gpu:availabilityZone moves the cluster (`zone_configured`): a new zone is
ForceNew on a subnet (terraform-provider-aws internal/service/ec2/vpc_subnet.go, "availability_zone"
ForceNew; pulumi_aws ec2/subnet.py), and the replacement has the same CIDR, which EC2 refuses while
the old subnet exists (InvalidSubnet.Conflict). So each subnet is deleted before its replacement is
made (deleteBeforeReplace), which first deletes what must be replaced with it (Pulumi docs,
"Resource option: deleteBeforeReplace": it cascades to dependents): the route table association
and NAT gateway (subnet_id ForceNew), the GPU nodes' interfaces and every instance (all with
deleteBeforeReplace already: fixed addresses). The route tables, the VPC and the Elastic IP stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from cluster.facts import STACK_TAG, nat_gateway_ip
from infra.quotas import stack_name


@dataclass(frozen=True)
class NetworkArgs:
    """What NetworkComponent makes the VPC, its subnets and gateways from."""

    cluster_name: str
    vpc_cidr: str
    subnet_cidr: str
    public_subnet_cidr: str
    availability_zone: str
    zone_configured: bool = False


class NetworkComponent(pulumi.ComponentResource):
    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # The zone the subnets are made in: the configured one, else the stack's first (module doc).
        self.zone_configured = args.zone_configured
        self.zone_stash = None if args.zone_configured else pulumi.Stash(
            f"{name}-zone", input=args.availability_zone, opts=child)
        zone = args.availability_zone if args.zone_configured else self.zone_stash.output

        def tags(what: str) -> dict[str, str]:
            return {"Cluster": args.cluster_name, "Name": f"{args.cluster_name}-{what}"}

        def billed_tags(what: str) -> dict[str, str]:
            """A billed resource's: also the owning stack (STACK_TAG), unique per stack unlike Cluster,
            which `fab status` finds the stack's spend by (ops/cost/spend.py)."""
            return {**tags(what), STACK_TAG: stack_name()}

        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.vpc_cidr,
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags=tags("vpc"),
            opts=child,
        )
        self.internet_gateway = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=self.vpc.id, tags=tags("igw"), opts=child
        )

        # Public: no map_public_ip_on_launch either; the controller asks for its own public IP.
        (self.public_subnet, self.public_route_table, self.public_default_route,
         self.public_route_table_association) = self._routed_subnet(
            name, "public", args.public_subnet_cidr, zone, tags("public"), child,
            gateway_id=self.internet_gateway.id)

        # One NAT gateway (and its one Elastic IP) for every GPU node's outbound traffic, at its
        # fixed address (cluster.facts). `private_ip` is ForceNew in the provider
        # (terraform-provider-aws internal/service/ec2/vpc_nat_gateway.go), so a gateway made
        # with a random address is replaced once; the old one goes first, as the new one needs
        # its address (and the Elastic IP) free. Not ignore_changes: Pulumi would then carry the
        # old address into a replacement in another subnet (pulumi/pulumi#2657).
        self.nat_eip = aws.ec2.Eip(
            f"{name}-nat-eip", domain="vpc", tags=billed_tags("nat"),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.internet_gateway]),
        )
        self.nat_gateway = aws.ec2.NatGateway(
            f"{name}-nat",
            allocation_id=self.nat_eip.allocation_id,
            subnet_id=self.public_subnet.id,
            connectivity_type="public",
            private_ip=nat_gateway_ip(args.public_subnet_cidr),
            tags=billed_tags("nat"),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.internet_gateway],
                                        delete_before_replace=True),
        )

        (self.gpu_subnet, self.gpu_route_table, self.gpu_default_route,
         self.gpu_route_table_association) = self._routed_subnet(
            name, "gpu", args.subnet_cidr, zone, tags("gpu-private"), child,
            nat_gateway_id=self.nat_gateway.id)

        # What a host must wait for to have a route out at first boot (the bootstrap installs packages).
        self.controller_internet = [self.internet_gateway, self.public_default_route,
                                    self.public_route_table_association]
        self.gpu_internet = [self.nat_gateway, self.gpu_default_route, self.gpu_route_table_association]
        # Where the subnets are, read from their state (what a kept zone leaves them in).
        self.availability_zone = self.gpu_subnet.availability_zone
        self.register_outputs({
            "availabilityZone": self.availability_zone,
            "vpcId": self.vpc.id,
            "publicSubnetId": self.public_subnet.id,
            "gpuSubnetId": self.gpu_subnet.id,
            "internetGatewayId": self.internet_gateway.id,
            "natGatewayId": self.nat_gateway.id,
            "natPublicIp": self.nat_eip.public_ip,
        })

    def _routed_subnet(self, name: str, kind: str, cidr: str, availability_zone: pulumi.Input[str],
                       tags: dict[str, str], child: pulumi.ResourceOptions, **default_route):
        """A subnet (no public IPs on launch), its route table with 0.0.0.0/0 to `default_route`'s
        target (internet or NAT gateway), and their association. The subnet keeps its zone unless
        the config names one, and is deleted before a replacement of the same CIDR (module doc)."""
        subnet = aws.ec2.Subnet(
            f"{name}-{kind}-subnet", vpc_id=self.vpc.id, cidr_block=cidr,
            availability_zone=availability_zone, map_public_ip_on_launch=False, tags=tags,
            opts=pulumi.ResourceOptions(
                parent=self, delete_before_replace=True,
                ignore_changes=[] if self.zone_configured else ["availabilityZone"]),
        )
        table = aws.ec2.RouteTable(f"{name}-{kind}-rt", vpc_id=self.vpc.id, tags=tags, opts=child)
        route = aws.ec2.Route(
            f"{name}-{kind}-default-route", route_table_id=table.id,
            destination_cidr_block="0.0.0.0/0", opts=child, **default_route,
        )
        association = aws.ec2.RouteTableAssociation(
            f"{name}-{kind}-rta", subnet_id=subnet.id, route_table_id=table.id, opts=child,
        )
        return subnet, table, route, association
