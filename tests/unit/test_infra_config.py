"""StackConfig: defaults, parsing of `pulumi config set` strings, and every refusal."""

from __future__ import annotations

import pytest

from cluster.facts import max_gpu_nodes
from cluster.stack_config import ConfigError, StackConfig
from tests.support.pulumi_mocks import ADMIN_CIDR, SSH_KEY

BASE = {"adminCidr": ADMIN_CIDR, "sshPublicKey": SSH_KEY}


def parse(**overrides) -> StackConfig:
    raw = {**BASE, **overrides}
    return StackConfig.from_mapping({k: v for k, v in raw.items() if v is not None})


def refused(setting: str, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        parse(**overrides)
    msg = str(info.value)
    assert f"slurm-gpu:{setting}" in msg, msg
    return msg


def test_defaults_are_the_seed_cluster():
    cfg = parse()
    assert cfg.gpu_node_count == 2
    assert cfg.gpu_instance_type == "g6.12xlarge"
    assert cfg.root_volume_gib == 200
    assert cfg.cluster_name == "mini"
    assert cfg.efa is True
    assert cfg.ami_id is None and cfg.availability_zone is None
    assert cfg.vpc_cidr == "10.0.0.0/16" and cfg.subnet_cidr == "10.0.1.0/24"
    assert cfg.admin_cidr == ADMIN_CIDR and cfg.ssh_public_key == SSH_KEY


def test_strings_from_pulumi_config_are_parsed():
    cfg = parse(gpuNodeCount="4", rootVolumeGiB="500", efa="false", gpuInstanceType="p5.48xlarge",
                amiId="ami-0123456789abcdef0", availabilityZone="ap-northeast-2c",
                clusterName="big-run", vpcCidr="172.20.0.0/16", subnetCidr="172.20.8.0/22")
    assert (cfg.gpu_node_count, cfg.root_volume_gib, cfg.efa) == (4, 500, False)
    assert cfg.ami_id == "ami-0123456789abcdef0" and cfg.availability_zone == "ap-northeast-2c"
    assert cfg.subnet_cidr == "172.20.8.0/22" and cfg.cluster_name == "big-run"
    assert parse(efa="True").efa is True and parse(efa=False).efa is False


def test_config_is_frozen():
    cfg = parse()
    with pytest.raises(AttributeError):
        cfg.gpu_node_count = 9  # type: ignore[misc]


# ---- adminCidr ----

def test_admin_cidr_missing():
    msg = refused("adminCidr", adminCidr=None)
    assert "required" in msg and "pulumi config set slurm-gpu:adminCidr" in msg


@pytest.mark.parametrize("value", ["0.0.0.0/0", "::/0"])
def test_admin_cidr_open_to_the_internet(value):
    assert "whole internet" in refused("adminCidr", adminCidr=value)


@pytest.mark.parametrize("value", ["10.0.0.0/8", "100.64.0.0/10", "0.0.0.0/0"])
def test_a_wide_admin_cidr_needs_the_named_override(value):
    assert "pulumi config set slurm-gpu:allowWideAdminCidr true" in refused("adminCidr", adminCidr=value)
    cfg = parse(adminCidr=value, allowWideAdminCidr="true")
    assert (cfg.admin_cidr, cfg.allow_wide_admin_cidr) == (value, True)
    assert parse(adminCidr="198.51.0.0/16").allow_wide_admin_cidr is False  # a /16 is narrow enough


@pytest.mark.parametrize("value", ["127.0.0.1/32", "127.0.0.0/8", "169.254.169.254/32", "169.254.0.0/16",
                                   "::1/128", "fe80::/10"])
def test_loopback_and_link_local_are_refused_even_with_the_override(value):
    for allow in ("false", "true"):
        msg = refused("adminCidr", adminCidr=value, allowWideAdminCidr=allow)
        assert "loopback range" in msg or "link-local range" in msg


@pytest.mark.parametrize("value", ["203.0.113.7", "203.0.113.300/32", "my-laptop", "203.0.113.7/33", ""])
def test_admin_cidr_malformed(value):
    refused("adminCidr", adminCidr=value)


def test_admin_cidr_host_bits_suggests_the_network():
    assert "203.0.113.0/24" in refused("adminCidr", adminCidr="203.0.113.7/24")


def test_admin_cidr_ipv6_refused_the_vpc_is_ipv4():
    assert "IPv6" in refused("adminCidr", adminCidr="2001:db8::1/128")


def test_admin_cidr_narrow_network_accepted():
    assert parse(adminCidr="198.51.100.0/28").admin_cidr == "198.51.100.0/28"


# ---- sshPublicKey ----

def test_ssh_key_missing():
    assert "required" in refused("sshPublicKey", sshPublicKey=None)


@pytest.mark.parametrize("value", [
    "hello",
    "ssh-ed25519",
    "ssh-dss AAAAB3NzaC1kc3MAAACBAP" + "A" * 80,
    "ssh-ed25519 not*base64*at*all" + "x" * 60,
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
])
def test_ssh_key_not_a_public_key(value):
    refused("sshPublicKey", sshPublicKey=value)


def test_ssh_private_key_is_named_as_such():
    assert "PRIVATE" in refused("sshPublicKey", sshPublicKey="-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n")


def test_rsa_key_accepted():
    key = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQC" + "x" * 300 + " me@host"
    assert parse(sshPublicKey=key).ssh_public_key == key


# ---- gpuNodeCount ----

@pytest.mark.parametrize("value", ["0", 0, "-1", -3])
def test_node_count_below_one(value):
    assert "at least 1" in refused("gpuNodeCount", gpuNodeCount=value)


@pytest.mark.parametrize("value", ["two", "2.5", "1e3", True])
def test_node_count_not_a_number(value):
    assert "whole number" in refused("gpuNodeCount", gpuNodeCount=value)


def test_a_5000_digit_count_is_the_settings_error_not_a_traceback():
    assert "whole number, not a value of 5000 characters" in refused("gpuNodeCount", gpuNodeCount="9" * 5000)


def test_node_count_more_than_the_subnet_holds():
    room = max_gpu_nodes("10.0.1.0/28")
    assert parse(subnetCidr="10.0.1.0/28", gpuNodeCount=room).gpu_node_count == room
    msg = refused("gpuNodeCount", subnetCidr="10.0.1.0/28", gpuNodeCount=room + 1)
    assert f"at most {room}" in msg and "slurm-gpu:subnetCidr" in msg
    refused("gpuNodeCount", gpuNodeCount=max_gpu_nodes("10.0.1.0/24") + 1)


# ---- rootVolumeGiB ----

@pytest.mark.parametrize("value", ["-200", -1, "0", "20", "99999"])
def test_root_volume_out_of_range(value):
    refused("rootVolumeGiB", rootVolumeGiB=value)


def test_root_volume_not_a_number():
    assert "whole number" in refused("rootVolumeGiB", rootVolumeGiB="200GB")


# ---- scratchThroughputMBps, scratchIops (the shared /scratch's gp3 volume) ----

def test_scratch_volume_defaults_to_gp3_baseline_and_derives_the_iops_it_needs():
    cfg = parse()
    assert (cfg.scratch_throughput_mbps, cfg.scratch_iops) == (125, 3000)
    assert (parse(scratchThroughputMBps="750").scratch_iops, parse(scratchThroughputMBps=751).scratch_iops) == \
        (3000, 3004)  # at most 0.25 MiB/s per IOPS
    cfg = parse(scratchThroughputMBps="1000")
    assert (cfg.scratch_throughput_mbps, cfg.scratch_iops) == (1000, 4000)
    assert parse(scratchThroughputMBps="1000", scratchIops="16000").scratch_iops == 16000


@pytest.mark.parametrize("value", ["124", 0, "1001", "-5"])
def test_scratch_throughput_out_of_gp3_range(value):
    msg = refused("scratchThroughputMBps", scratchThroughputMBps=value)
    assert "125 to 1000 MiB/s" in msg and "pulumi config set slurm-gpu:scratchThroughputMBps" in msg


def test_scratch_throughput_not_a_number():
    assert "whole number" in refused("scratchThroughputMBps", scratchThroughputMBps="1GB/s")


def test_scratch_iops_too_few_for_the_throughput_names_both_and_the_least():
    msg = refused("scratchIops", scratchThroughputMBps="1000", scratchIops="3999")
    assert "slurm-gpu:scratchThroughputMBps 1000" in msg and "at least 4000" in msg
    assert "pulumi config set slurm-gpu:scratchIops 4000" in msg


@pytest.mark.parametrize("value", ["2999", "16001"])
def test_scratch_iops_out_of_gp3_range(value):
    assert "3000 to 16000 IOPS" in refused("scratchIops", scratchIops=value)


def test_scratch_size_defaults_to_100_gib_and_takes_the_setting():
    assert parse().scratch_size_gib == 100
    assert parse(scratchSizeGiB="2000").scratch_size_gib == 2000


@pytest.mark.parametrize("value", ["9", "0", "16385", "-1"])
def test_scratch_size_out_of_range_names_the_setting_and_the_fix(value):
    msg = refused("scratchSizeGiB", scratchSizeGiB=value)
    assert "10 to 16384 GiB" in msg and "`pulumi config set slurm-gpu:scratchSizeGiB 100`" in msg


def test_scratch_size_too_small_for_its_iops():
    msg = refused("scratchSizeGiB", scratchSizeGiB="10", scratchIops="6000")
    assert "slurm-gpu:scratchIops 6000" in msg and "500 IOPS per GiB" in msg
    assert "`pulumi config set slurm-gpu:scratchSizeGiB 12`" in msg


def test_scratch_size_not_a_number():
    assert "whole number" in refused("scratchSizeGiB", scratchSizeGiB="1TB")


# ---- networks ----

def test_subnet_outside_the_vpc():
    msg = refused("subnetCidr", vpcCidr="10.0.0.0/16", subnetCidr="10.1.1.0/24")
    assert "slurm-gpu:vpcCidr" in msg and "10.0.0.0/16" in msg


@pytest.mark.parametrize("setting,value", [
    ("vpcCidr", "10.0.0.0/33"), ("vpcCidr", "10.0.0.1/16"), ("vpcCidr", "ten/16"),
    ("vpcCidr", "10.0.0.0/8"), ("vpcCidr", "8.8.0.0/16"), ("subnetCidr", "10.0.1.0"),
    ("subnetCidr", "10.0.1.0/30"), ("subnetCidr", "10.0.1.7/24"), ("vpcCidr", "fd00::/48"),
])
def test_malformed_networks(setting, value):
    refused(setting, **{setting: value})


# ---- the rest ----

@pytest.mark.parametrize("value", ["Mini", "my cluster", "-mini", "mini-", "1mini", "a" * 40, "mini_1", "mini.x"])
def test_cluster_name_must_be_a_slurm_and_host_token(value):
    refused("clusterName", clusterName=value)


@pytest.mark.parametrize("value", ["yes", "1", "on", 1])
def test_efa_must_be_a_bool(value):
    assert "true or false" in refused("efa", efa=value)


@pytest.mark.parametrize("setting,value", [
    ("gpuInstanceType", "G6.12XLARGE"), ("gpuInstanceType", "g6"), ("controllerInstanceType", "big one"),
    ("amiId", "ami-xyz"), ("amiId", "0fd3bc7a446d73ca2"), ("availabilityZone", "zone-a"),
])
def test_malformed_names(setting, value):
    refused(setting, **{setting: value})


def test_unknown_setting_is_named():
    msg = refused("gpuNodecount", gpuNodecount="3")
    assert "unknown" in msg and "pulumi config rm" in msg


def test_error_gives_the_fix_command():
    msg = refused("adminCidr", adminCidr="0.0.0.0/0")
    assert "`pulumi config set slurm-gpu:adminCidr 203.0.113.7/32`" in msg
