"""The Pulumi mock harness itself (tests/support/pulumi_mocks.py): the SDK parses its answers into
typed results, as it parses the provider's.
"""

from __future__ import annotations

import json

import pulumi
import pytest

from tests.support.pulumi_mocks import DLAMI_ROOT_GIB, ClusterMocks


def test_mocks_answer_like_the_provider():
    """The harness itself: the SDK parses the mock answers into typed results."""
    import pulumi_aws as aws

    mocks = ClusterMocks()
    pulumi.runtime.set_mocks(mocks, project="slurm-gpu", stack="test", preview=False)
    info = aws.ec2.get_instance_type(instance_type="p5.48xlarge")
    assert info.default_vcpus == 192 and info.memory_size == 2097152
    assert info.gpuses[0].name == "H100" and info.gpuses[0].count == 8 and info.efa_supported
    assert (info.maximum_network_cards, info.efa_maximum_interfaces) == (32, 32)
    ami = aws.ec2.get_ami(most_recent=True, owners=["amazon"], filters=[{"name": "name", "values": ["x"]}])
    assert ami.block_device_mappings[0].ebs["volume_size"] == str(DLAMI_ROOT_GIB)
    with pytest.raises(Exception, match="InvalidInstanceType"):
        aws.ec2.get_instance_type(instance_type="z9.huge")
    assert json.dumps(mocks.calls)  # calls were recorded as plain data
