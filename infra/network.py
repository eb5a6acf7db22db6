"""The cluster's network: one VPC, one public subnet in one AZ, its internet route.

One subnet in one AZ keeps every node in the same placement group and at the
lowest latency (the seed's layout); fixed private IPs come from bootstrap.facts.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws


class NetworkComponent(pulumi.ComponentResource):
    def __init__(self, name: str, *, cluster_name: str, vpc_cidr: str, subnet_cidr: str,
                 availability_zone: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("slurm-gpu:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        def tags(what: str) -> dict[str, str]:
            return {"Cluster": cluster_name, "Name": f"{cluster_name}-{what}"}

        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=vpc_cidr,
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags=tags("vpc"),
            opts=child,
        )
        self.internet_gateway = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=self.vpc.id, tags=tags("igw"), opts=child
        )
        # No map_public_ip_on_launch: the controller asks for its public IP
        # itself, and GPU nodes get Elastic IPs on their (EFA) interfaces
        # (see infra/nodes.py), so nothing else launched here is exposed.
        self.subnet = aws.ec2.Subnet(
            f"{name}-subnet",
            vpc_id=self.vpc.id,
            cidr_block=subnet_cidr,
            availability_zone=availability_zone,
            map_public_ip_on_launch=False,
            tags=tags("public"),
            opts=child,
        )
        self.route_table = aws.ec2.RouteTable(
            f"{name}-rt", vpc_id=self.vpc.id, tags=tags("public"), opts=child
        )
        self.default_route = aws.ec2.Route(
            f"{name}-default-route",
            route_table_id=self.route_table.id,
            destination_cidr_block="0.0.0.0/0",
            gateway_id=self.internet_gateway.id,
            opts=child,
        )
        self.route_table_association = aws.ec2.RouteTableAssociation(
            f"{name}-rta", subnet_id=self.subnet.id, route_table_id=self.route_table.id, opts=child
        )
        # What a host must wait for to have a route out at first boot.
        self.internet_access = [self.internet_gateway, self.default_route, self.route_table_association]
        self.register_outputs({
            "vpcId": self.vpc.id,
            "subnetId": self.subnet.id,
            "internetGatewayId": self.internet_gateway.id,
        })
