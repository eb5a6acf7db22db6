"""Pinned host keys: the EC2 console-output parser on real-format text, the known_hosts
file, fetching through a fake `aws` CLI, and the `fab ssh` command line as OpenSSH reads
it (`ssh -G`, which resolves options without connecting). The real connections are in
test_hostkeys_cluster.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from cluster.inventory import Inventory
from cluster.spec import AwsResources
from ops.actions.options import OptionError
from ops.ssh import hostkeys, sshcmd
from tests.support import inventories


def keygen(tmp_path, name: str, keytype: str = "ed25519") -> tuple[str, str]:
    """A real host key pair: (public key line, `ssh-keygen -l` SHA256 fingerprint)."""
    path = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", keytype, "-N", "", "-C", f"root@{name}", "-f", str(path)],
                   check=True)
    pub = path.with_name(name + ".pub").read_text().strip()
    fp = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(path) + ".pub"], check=True,
                        capture_output=True, text=True).stdout.split()[1]
    return pub, fp


def console(keys: list[tuple[str, str]], host: str = "ip-10-0-1-10", fps: list[str] | None = None) -> str:
    """Console output as Ubuntu's cloud-init writes it on EC2: the fingerprints through
    logger (`<14>... ec2: `), the keys block bare, between boot noise."""
    labels = {"ssh-ed25519": "ED25519", "ecdsa-sha2-nistp256": "ECDSA", "ssh-rsa": "RSA"}
    lines = ["[   11.052117] cloud-init[1024]: Cloud-init v. 24.4 running 'modules:final'",
             "<14>Dec  4 01:02:03 ec2: ",
             "<14>Dec  4 01:02:03 ec2: #############################################################",
             "<14>Dec  4 01:02:03 ec2: -----BEGIN SSH HOST KEY FINGERPRINTS-----"]
    for (pub, _fp), shown in zip(keys, fps or [fp for _, fp in keys], strict=True):
        bits = "3072" if pub.startswith("ssh-rsa") else "256"
        lines.append(f"<14>Dec  4 01:02:03 ec2: {bits} {shown} root@{host} ({labels[pub.split()[0]]})")
    lines += ["<14>Dec  4 01:02:03 ec2: -----END SSH HOST KEY FINGERPRINTS-----",
              "<14>Dec  4 01:02:03 ec2: #############################################################",
              "-----BEGIN SSH HOST KEY KEYS-----"]
    lines += [pub.rsplit(" ", 1)[0] + f" root@{host}" for pub, _ in keys]
    lines += ["-----END SSH HOST KEY KEYS-----",
              "[   11.310022] cloud-init[1024]: Cloud-init v. 24.4 finished at Fri, 04 Dec 2026 01:02:03 +0000."]
    return "\n".join(lines) + "\n"


@pytest.fixture
def host_keys(tmp_path):
    if not shutil.which("ssh-keygen"):
        pytest.skip("ssh-keygen not installed")
    return [keygen(tmp_path, "k-ed25519"), keygen(tmp_path, "k-ecdsa", "ecdsa"), keygen(tmp_path, "k-rsa", "rsa")]


def test_fingerprint_matches_ssh_keygen(host_keys):
    for pub, fp in host_keys:
        assert hostkeys.fingerprint(pub.split()[1]) == fp


def test_parse_console_output(host_keys):
    keys = hostkeys.parse_console_output(console(host_keys))
    assert keys == [tuple(pub.split()[:2]) for pub, _ in host_keys]


def bootstrap_block(keys: list[tuple[str, str]], host: str = "ip-10-0-1-10") -> str:
    """What the bootstrap prints as it starts (bootstrap/scripts/_steps.sh.j2, print_host_keys): bare
    lines, `ssh-keygen -l` then `cut -d' ' -f1-2` of each public key."""
    labels = {"ssh-ed25519": "ED25519", "ecdsa-sha2-nistp256": "ECDSA", "ssh-rsa": "RSA"}
    lines = [hostkeys.FP_BEGIN]
    lines += [f"{3072 if pub.startswith('ssh-rsa') else 256} {fp} root@{host} ({labels[pub.split()[0]]})"
              for pub, fp in keys]
    lines += [hostkeys.FP_END, hostkeys.KEYS_BEGIN, *(" ".join(pub.split()[:2]) for pub, _ in keys), hostkeys.KEYS_END]
    return "\n".join(lines) + "\n"


STEPS = "slurm-gpu-bootstrap(gpu): step hostname\nslurm-gpu-bootstrap(gpu): step packages\n"


def forged(keys: list[tuple[str, str]]) -> str:
    """A block as a hostile file echoed to the console would forge it (bare, like the bootstrap's)."""
    return bootstrap_block(keys, host="evil")


def test_the_bootstrap_block_and_cloud_inits_agree_and_pin(host_keys):
    text = bootstrap_block(host_keys) + STEPS + "slurm-gpu-bootstrap(gpu): done\n" + console(host_keys)
    assert hostkeys.parse_console_output(text) == [tuple(pub.split()[:2]) for pub, _ in host_keys]


@pytest.mark.parametrize("layout", ["forged-after-the-steps", "forged-between-bootstrap-and-cloud-init",
                                    "forged-after-cloud-init", "old-boot-with-other-keys"])
def test_a_console_with_blocks_that_disagree_pins_nothing(host_keys, tmp_path, layout):
    """A step echoes attacker text (today: a failed wheel cache's first 300 bytes) that forges a block."""
    real, evil = host_keys[:1], [keygen(tmp_path, "evil")]
    text = {
        "forged-after-the-steps": bootstrap_block(real) + STEPS + forged(evil),  # cloud-init not done yet
        "forged-between-bootstrap-and-cloud-init": bootstrap_block(real) + STEPS + forged(evil) + console(real),
        "forged-after-cloud-init": bootstrap_block(real) + STEPS + console(real) + forged(evil),
        "old-boot-with-other-keys": console(evil) + console(real),
    }[layout]
    with pytest.raises(hostkeys.HostKeyError, match=r"[23] SSH HOST KEY KEYS blocks with different keys: something "
                                                    r"on the host printed a forged block; fab pins no key"):
        hostkeys.parse_console_output(text)


def test_a_block_printed_only_after_the_steps_began_pins_nothing(host_keys, tmp_path):
    """No bootstrap block before the first step (lost from EC2's last 64 KB, or never printed): the only
    block may be a step's output."""
    text = "[    0.000000] Linux version 6.8.0-1015-aws\n" + STEPS + forged([keygen(tmp_path, "evil")])
    with pytest.raises(hostkeys.HostKeyError, match=r"first SSH HOST KEY KEYS block was printed after the "
                                                    r"bootstrap's steps began .* fab pins no key"):
        hostkeys.parse_console_output(text)


def test_markers_count_only_as_whole_lines(host_keys, tmp_path):
    """Marker text inside a log line (a file's content echoed by a step) opens and closes no block."""
    evil_pub = keygen(tmp_path, "evil")[0]
    text = (bootstrap_block(host_keys[:1]) + STEPS
            + f"slurm-gpu-bootstrap(gpu): training stack from the package index: {hostkeys.KEYS_BEGIN}\n"
            + " ".join(evil_pub.split()[:2]) + "\n"
            + f"pip: {hostkeys.KEYS_END}\n")
    assert hostkeys.parse_console_output(text) == [tuple(host_keys[0][0].split()[:2])]


def test_a_block_opened_inside_a_block_pins_nothing(host_keys, tmp_path):
    text = (hostkeys.KEYS_BEGIN + "\n" + bootstrap_block([keygen(tmp_path, "evil")]) + hostkeys.KEYS_END + "\n")
    with pytest.raises(hostkeys.HostKeyError, match=r"inside another such block .* fab pins no key"):
        hostkeys.parse_console_output(text)


def _fake_aws(tmp_path, monkeypatch, output: str) -> None:
    """An `aws` CLI on PATH answering get-console-output with `output`."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps({"Output": output}))
    aws = bindir / "aws"
    aws.write_text(f"#!/bin/sh\ncat {answer}\n")
    aws.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setattr(hostkeys, "CONFIG_HOME", tmp_path / "config")


def test_a_refused_console_names_the_node_and_the_known_hosts_file(tmp_path, monkeypatch, host_keys):
    real, evil = host_keys[:1], [keygen(tmp_path, "evil")]
    _fake_aws(tmp_path, monkeypatch, bootstrap_block(real) + STEPS + forged(evil))
    inv = aws_inventory()
    with pytest.raises(hostkeys.HostKeyError) as info:
        hostkeys.Pins(inv).keys("gpu-node-01")
    msg = str(info.value)
    assert msg.startswith("controller (i-0ctl): the console output holds 2 SSH HOST KEY KEYS blocks")
    assert "EC2 serial console" in msg and str(hostkeys.known_hosts_path(inv)) in msg
    assert not hostkeys.known_hosts_path(inv).exists()  # nothing pinned


def test_a_key_whose_fingerprint_was_not_printed_is_refused(host_keys, tmp_path):
    other_fp = keygen(tmp_path, "other")[1]
    text = console(host_keys[:2], fps=[host_keys[0][1], other_fp])
    with pytest.raises(hostkeys.HostKeyError, match=r"ecdsa-sha2-nistp256 key \(SHA256:.*\) is not among the fingerprints"):
        hostkeys.parse_console_output(text)


def test_console_without_keys_says_to_wait():
    with pytest.raises(hostkeys.HostKeyError, match="no SSH HOST KEY KEYS block yet.*wait a minute"):
        hostkeys.parse_console_output("[    0.000000] Linux version 6.8.0-1015-aws\n")


def test_known_hosts_round_trip(tmp_path, host_keys):
    path = tmp_path / "cfg" / "known_hosts"
    hostkeys.write_known_hosts(path, [(("controller", "10.0.0.10"), [host_keys[0][0]]),
                                      (("gpu-node-01",), [host_keys[1][0], host_keys[2][0]])])
    pins = hostkeys.read_known_hosts(path)
    assert pins["controller"] == pins["10.0.0.10"] == [tuple(host_keys[0][0].split()[:2])]
    assert [t for t, _ in pins["gpu-node-01"]] == ["ecdsa-sha2-nistp256", "ssh-rsa"]
    # OpenSSH reads the same file: the key is found under the node name.
    res = subprocess.run(["ssh-keygen", "-F", "gpu-node-01", "-f", str(path)], capture_output=True, text=True)
    assert res.returncode == 0 and "gpu-node-01 ecdsa-sha2-nistp256" in res.stdout


def aws_inventory(known_hosts: str | None = None) -> Inventory:
    return inventories.make(
        public_ip="198.51.100.7", known_hosts=known_hosts, gpu_nodes=(("gpu-node-01", "10.0.1.11"), ("gpu-node-02", "10.0.1.12")),
        aws=AwsResources(instance_ids={
            "controller": "i-0ctl", "gpu-node-01": "i-0g01", "gpu-node-02": "i-0g02"}), region="ap-northeast-2")


def test_pins_are_read_from_the_ec2_console_once_and_kept(tmp_path, monkeypatch, host_keys):
    """A fake `aws` answers get-console-output as the EC2 API does (JSON, Output)."""
    outputs = {"i-0ctl": console(host_keys[:1]), "i-0g01": console(host_keys[1:2]),
               "i-0g02": console(host_keys[2:])}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "outputs.json").write_text(json.dumps(outputs))
    (bin_dir / "aws").write_text(
        "#!/usr/bin/env python3\nimport json, sys\n"
        f"open({str(tmp_path / 'calls')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv\niid = a[a.index('--instance-id') + 1]\n"
        f"print(json.dumps({{'InstanceId': iid, 'Output': json.load(open({str(tmp_path / 'outputs.json')!r}))[iid]}}))\n")
    (bin_dir / "aws").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(hostkeys, "CONFIG_HOME", tmp_path / "config")
    inv = aws_inventory()
    pins = hostkeys.Pins(inv)
    assert pins.path == tmp_path / "config" / "mini-i-0ctl" / "known_hosts"
    assert pins.keys("gpu-node-02") == [tuple(host_keys[2][0].split()[:2])]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3 and all("ec2 get-console-output" in c and "--region ap-northeast-2" in c for c in calls)
    # Kept: a new Pins reads the file and asks EC2 nothing.
    assert hostkeys.Pins(inv).keys("controller") == [tuple(host_keys[0][0].split()[:2])]
    assert len((tmp_path / "calls").read_text().splitlines()) == 3


def test_no_aws_cli_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(hostkeys, "CONFIG_HOME", tmp_path / "config")
    with pytest.raises(hostkeys.HostKeyError, match="no `aws` CLI to read them: install the AWS CLI"):
        hostkeys.Pins(aws_inventory()).keys("controller")


# ---------------------------------------------------------------- fab ssh's command line

def resolved(argv: list[str]) -> dict[str, str]:
    """What OpenSSH makes of the options (ssh -G: no connection is made)."""
    assert argv[0] == "ssh"
    dest = argv.index(next(a for a in argv if "@" in a and not a.startswith(("ProxyCommand", "-"))))
    out = subprocess.run(["ssh", "-G", *argv[1:dest + 1]], capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


@pytest.mark.skipif(not shutil.which("ssh"), reason="OpenSSH client not installed")
def test_ssh_to_a_gpu_node_jumps_through_the_controller_with_pinned_keys(tmp_path):
    inv = aws_inventory()
    kh = tmp_path / "known_hosts"
    argv = sshcmd.ssh_argv(inv, "gpu-node-02", kh, identity="/home/me/.ssh/id_ed25519", command="nvidia-smi")
    assert argv[-2:] == ["--", "nvidia-smi"]
    cfg = resolved(argv)
    assert cfg["hostname"] == "10.0.1.12" and cfg["user"] == "ubuntu"
    assert cfg["stricthostkeychecking"] == "true" and cfg["userknownhostsfile"] == str(kh)
    assert cfg["hostkeyalias"] == "gpu-node-02" and cfg["identitiesonly"] == "yes"
    jump = cfg["proxycommand"]
    assert jump.startswith("ssh ") and "-W 10.0.1.12:22 ubuntu@198.51.100.7" in jump
    for opt in ("StrictHostKeyChecking=yes", f"UserKnownHostsFile={kh}", "HostKeyAlias=controller",
                "-i /home/me/.ssh/id_ed25519"):
        assert opt in jump


@pytest.mark.skipif(not shutil.which("ssh"), reason="OpenSSH client not installed")
def test_ssh_to_the_controller_is_direct(tmp_path):
    argv = sshcmd.ssh_argv(aws_inventory(), "controller", tmp_path / "kh")
    cfg = resolved(argv)
    assert cfg["hostname"] == "198.51.100.7" and cfg["hostkeyalias"] == "controller"
    assert "proxycommand" not in cfg or cfg["proxycommand"] == "none"


def test_unknown_host_names_the_valid_ones(tmp_path):
    with pytest.raises(OptionError, match=r"unknown host 'gpu-node-9'; the hosts of cluster 'mini' are: "
                                          r"controller, gpu-node-01, gpu-node-02 \(e.g. `fab ssh gpu-node-01`\)"):
        sshcmd.ssh_argv(aws_inventory(), "gpu-node-9", tmp_path / "kh")


def test_a_console_cut_to_ec2s_64_kb_by_boot_messages_still_pins(tmp_path, monkeypatch, host_keys):
    """A big instance's kernel prints far more than 64 KB before the bootstrap starts; EC2 keeps the newest
    64 KB. No step's output reaches the console (cloud-config's `output`, tests/boot/test_boot_cluster.py), so
    the bootstrap's block in what is left pins the host (a refusal by size would lock out such nodes)."""
    kernel = "".join(f"[    {i / 1000:8.6f}] pci 0000:{i % 256:02x}:00.0: BAR 0: assigned [mem 0x{i:08x}]\n"
                     for i in range(2000))
    whole = kernel + bootstrap_block(host_keys) + STEPS + "slurm-gpu-bootstrap(gpu): done\n" + console(host_keys)
    kept = whole.encode()[-64 * 1024:].decode(errors="replace")
    assert len(whole.encode()) > 2 * 64 * 1024
    _fake_aws(tmp_path, monkeypatch, kept)
    assert hostkeys.Pins(aws_inventory()).keys("controller") == [tuple(pub.split()[:2]) for pub, _ in host_keys]
