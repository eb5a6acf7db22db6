"""One way to reach the AWS API from this machine: boto3 with the stack's profile and region.

The stack's AWS provider takes its credentials from aws:profile when set, else the AWS SDK's default
chain (environment, shared files, SSO); boto3's Session(profile_name=...) reads the same shared files
(https://boto3.amazonaws.com/v1/documentation/api/latest/guide/credentials.html). infra/spot_guard.py
(the Spot request guard), `fab status`'s spend (ops/cost/spend.py) and `fab spot-requests` all call
EC2 through this, so each uses the credentials `pulumi` uses for the stack.
"""

from __future__ import annotations


def session(region: str | None, profile: str | None = None):
    """boto3's session in `region` (None: the profile's or the environment's) with aws:profile
    `profile` (None: the SDK's default chain). An unknown profile raises botocore's ProfileNotFound."""
    import boto3

    return boto3.session.Session(profile_name=profile or None, region_name=region or None)


def ec2_client(region: str | None, profile: str | None = None):
    """The EC2 client of `session(region, profile)`."""
    return session(region, profile).client("ec2")
