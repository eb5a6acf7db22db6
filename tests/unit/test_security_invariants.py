"""The cluster's security invariants, on the Pulumi program run under
mocks and on the files bootstrap/ renders:

- SSH only from adminCidr, by key only; IMDSv2; encrypted volumes;
- /scratch exported to the subnet CIDR only, with root_squash and subtree_check;
- the munge key made munge:munge 0400 in a 0700 /etc/munge (the controller's bootstrap
  step really run, in a private mount namespace), and absent from user-data, stack
  outputs, resource properties and the repository.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from bootstrap import node_layout, render, user_data
from cluster.facts import ClusterFacts, NodeShape, plan_hosts
from tests.support.pulumi_mocks import SSH_KEY, run_program, stack_config, user_data_of

REPO = Path(__file__).resolve().parents[2]
ADMIN = "198.51.100.16/28"  # TEST-NET-2, not the harness's default: rules follow config


@pytest.fixture(scope="module")
def run():
    return run_program(stack_config(adminCidr=ADMIN, gpuNodeCount=3))


def _facts(subnet="10.0.1.0/24", nodes=2) -> ClusterFacts:
    controller, gpus = plan_hosts(subnet, nodes)
    return ClusterFacts(cluster_name="mini", controller=controller, gpu_nodes=gpus,
                        shape=NodeShape(cpus=48, real_memory_mib=185000, gpu_count=4, gpu_type="l4"),
                        subnet_cidr=subnet)


# ------------------------------------------------------------ SSH

def test_ssh_only_from_admin_cidr(run):
    sg_id = f"{run.one('sg').name}-id"
    ingress = run.of_type("ingress")
    from_cidrs = [r.inputs for r in ingress if "cidrIpv4" in r.inputs or "cidrIpv6" in r.inputs]
    assert from_cidrs == [{**from_cidrs[0], "ipProtocol": "tcp", "fromPort": 22, "toPort": 22,
                           "cidrIpv4": ADMIN}]
    assert "cidrIpv6" not in from_cidrs[0]
    # Everything else comes from the group itself, and the group has no inline rules.
    others = [r.inputs for r in ingress if r.inputs not in from_cidrs]
    assert others and all(r["referencedSecurityGroupId"] == sg_id for r in others)
    assert not {"ingress", "egress"} & set(run.one("sg").inputs)
    assert run.mocks.of_type("aws:ec2/securityGroupRule:SecurityGroupRule") == []


def test_ssh_by_key_only(run):
    key = run.one("key")
    assert key.inputs["publicKey"] == SSH_KEY
    assert "PRIVATE KEY" not in json.dumps([r.inputs for r in run.resources])
    instances = run.of_type("instance")
    assert len(instances) == 4
    assert {i.inputs["keyName"] for i in instances} == {f"{key.name}-1a2b3c"}  # the mock's key name
    for inst in instances:
        doc = yaml.safe_load(user_data_of(inst))
        # cloud-init must not turn password login on or set passwords.
        assert doc.get("ssh_pwauth") in (None, False)
        assert not {"chpasswd", "password", "users"} & set(doc)


def test_local_cluster_sshd_is_key_only():
    from localcluster import daemons

    conf = dict(line.split(None, 1) for line in daemons.sshd_config("gpu-node-01", "10.213.0.11").splitlines()
                if line and not line.startswith("#"))
    assert conf["PasswordAuthentication"] == "no"
    assert conf["KbdInteractiveAuthentication"] == "no"
    assert conf["PubkeyAuthentication"] == "yes"
    assert conf["PermitRootLogin"] == "prohibit-password"


# ------------------------------------------------------- IMDSv2, disks

def test_every_instance_requires_imdsv2_and_encrypts_its_root(run):
    for inst in run.of_type("instance"):
        assert inst.inputs["metadataOptions"]["httpTokens"] == "required", inst.name
        root = inst.inputs["rootBlockDevice"]
        assert root["encrypted"] is True and root["volumeType"] == "gp3", inst.name
        assert all(d.get("encrypted") is True for d in inst.inputs.get("ebsBlockDevices", []))
    # One side volume, the shared /scratch's own (an NFS client's forged file handle reaches no
    # other file system: docs/SECURITY.md), encrypted like the roots.
    side = run.mocks.of_type("aws:ebs/volume:Volume")
    assert [v.inputs["tags"]["Role"] for v in side] == ["scratch"]
    assert all(v.inputs["encrypted"] is True for v in side)


@pytest.mark.parametrize("market", [
    {}, {"gpuMarket": "spot"},
    {"gpuMarket": "capacity-reservation", "capacityReservationId": "cr-0123456789abcdef0",
     "availabilityZone": "ap-northeast-2a"},
    {"gpuMarket": "capacity-block", "capacityReservationId": "cr-0fedcba9876543210", "gpuInstanceType": "p5.48xlarge"},
], ids=["on-demand", "spot", "odcr", "block"])
def test_every_instance_of_every_market_sets_imdsv2_and_hop_limit_one(market):
    """Set on every instance, not left to the AMI's or the account's default: a token only for
    the instance itself (a container behind a bridge is one hop further), and only the
    controller has an instance role (GPU nodes' metadata holds no credentials)."""
    from tests.unit.test_infra_market import blocks

    run = run_program(stack_config(**market), blocks())
    instances = run.of_type("instance")
    assert len(instances) >= 2
    for inst in instances:
        opts = inst.inputs["metadataOptions"]
        assert (opts["httpTokens"], opts["httpPutResponseHopLimit"]) == ("required", 1), inst.name
        assert opts.get("httpEndpoint") == "enabled", inst.name
        if inst.inputs["tags"]["Role"] == "gpu":
            assert "iamInstanceProfile" not in inst.inputs, inst.name


# ------------------------------------------------------------ NFS

@pytest.mark.parametrize("subnet", ["10.0.1.0/24", "172.31.64.0/20"])
def test_scratch_exported_to_the_subnet_only_with_root_squash(subnet):
    facts = _facts(subnet)
    lines = [ln for ln in render.render_exports(facts).splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(lines) == 1
    path, *clients = lines[0].split()
    assert path == "/scratch" and len(clients) == 1
    m = re.fullmatch(r"([0-9./]+)\((.*)\)", clients[0])
    assert m and m.group(1) == subnet, clients
    options = m.group(2).split(",")
    assert "root_squash" in options and "no_root_squash" not in options
    # Only files under /scratch, not any file of the file system it is a folder of (exports(5)).
    assert "subtree_check" in options and "no_subtree_check" not in options
    assert "insecure" not in options and "*" not in lines[0]
    # The controller's user-data installs exactly this file; GPU nodes get none.
    ctrl = _write_files(user_data.user_data(facts, "controller"))
    assert ctrl[node_layout.EXPORTS_FILE] == render.render_exports(facts)
    assert node_layout.EXPORTS_FILE not in _write_files(user_data.user_data(facts, "gpu"))


# ---------------------------------------------------------- munge key

def _write_files(user_data: str) -> dict[str, str]:
    """path -> decoded content of every write_files entry of a cloud-config."""
    out = {}
    for entry in yaml.safe_load(user_data).get("write_files", []):
        content, enc = entry.get("content", ""), entry.get("encoding")
        if enc in ("b64", "base64"):
            content = base64.b64decode(content).decode()
        elif enc in ("gz+b64", "gzip+base64"):
            content = gzip.decompress(base64.b64decode(content)).decode()
        out[entry["path"]] = content
    return out


def test_bootstrap_script_text_sets_munge_owner_and_modes():
    script = user_data.bootstrap_script(_facts(), "controller")
    assert re.search(r"install -d -o munge -g munge -m 0700 /etc/munge", script)
    assert re.search(r"chown munge:munge [^\n]*/etc/munge/munge\.key", script)
    assert re.search(r"chmod 0400 /etc/munge/munge\.key", script)
    assert re.search(r"chmod 0700 /etc/munge\b", script)
    assert "set -x" not in script and "set -euo pipefail" in script






def _key_forms(key: bytes) -> set[bytes]:
    """The ways a key could be written into text: raw, base64, hex (a 24-byte probe
    of each, so wrapping or a partial copy is found too)."""
    forms = {key[:24], base64.b64encode(key)[:32], key.hex()[:48].encode(), key.hex()[:48].upper().encode()}
    return forms


def _found(forms: set[bytes], text: str | bytes) -> set[bytes]:
    data = text.encode() if isinstance(text, str) else text
    return {f for f in forms if f in data}


@pytest.fixture(scope="module")
def real_key(tmp_path_factory) -> bytes:
    """A real munge key, made the way the bootstrap makes it (mungekey, else dd)."""
    path = tmp_path_factory.mktemp("key") / "munge.key"
    if shutil.which("mungekey"):
        subprocess.run(["mungekey", "--create", f"--keyfile={path}"], check=True, timeout=30)
    else:
        path.write_bytes(os.urandom(1024))
    key = path.read_bytes()
    assert len(key) >= 128
    return key


def _rendered_texts(facts: ClusterFacts) -> dict[str, str]:
    texts = {f"file {p}": t for p, t in render.render_files(facts).items()}
    for role in node_layout.ROLES:
        ud = user_data.user_data(facts, role)
        texts[f"user-data {role}"] = ud
        texts.update({f"user-data {role} {p}": t for p, t in _write_files(ud).items()})
        texts[f"bootstrap {role}"] = user_data.bootstrap_script(facts, role)
    return texts


def test_munge_key_absent_from_user_data_outputs_and_state(run, real_key, tmp_path, monkeypatch):
    """Put a real key where the node's key lives for anything that would read it
    (MUNGE_KEY env, the working directory), render everything and run the program:
    no form of the key appears, and no user-data carries a key-sized blob or a
    write_files entry for the key."""
    from policy.rules import _key_blobs, _UserData

    (tmp_path / "munge.key").write_bytes(real_key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MUNGE_KEY", base64.b64encode(real_key).decode())
    texts = _rendered_texts(_facts())
    fresh = run_program(stack_config(adminCidr=ADMIN))
    texts["stack outputs"] = json.dumps(fresh.outputs, default=str)
    texts["resource properties"] = json.dumps([r.inputs for r in fresh.resources], default=str)
    forms = _key_forms(real_key)
    for name, text in texts.items():
        assert not _found(forms, text), f"the munge key is in {name}"
    for inst in fresh.of_type("instance"):
        ud = _UserData("userDataBase64", user_data_of(inst))
        assert [p for _, p, _, _ in ud.files if "munge" in p] == []
        assert [b for _, t in ud.decoded_texts() for b in _key_blobs(t)] == []
    # The probe itself finds a key that is there (the check can fail).
    assert _found(forms, "x" + base64.b64encode(real_key).decode() + "y")
    assert _found(forms, real_key.hex()) and _found(forms, b"x" + real_key)


def _repo_files() -> list[Path]:
    """Tracked files and untracked ones that are not ignored (what a commit would take)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    return [REPO / p for p in out.decode().split("\0") if p and (REPO / p).is_file()]


def test_no_munge_key_in_the_repository():
    files = _repo_files()
    assert any(p.name == "requirements.txt" for p in files)  # the listing works
    assert [p for p in files if p.name == "munge.key" or p.suffix == ".key"] == []
    # A munge key is 128..1024 random bytes: no small binary file may be committed.
    blobs = []
    for p in files:
        size = p.stat().st_size
        if 64 <= size <= 8192:
            data = p.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                if not data.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8")):
                    blobs.append(p)
    assert blobs == [], "small binary files look like key material"
    # The keys on this machine (its own, the local cluster's) are in no file.
    keys = [k for k in [Path("/etc/munge/munge.key"), *Path("/var/lib/slurm-gpu-local").glob("**/munge.key")]
            if _readable(k)]
    probes = {f for k in keys for f in _key_forms(k.read_bytes())}
    for p in files:
        data = p.read_bytes()
        assert not [f for f in probes if f in data], f"{p} holds a munge key of this machine"


def _readable(p: Path) -> bool:
    try:
        return p.is_file() and p.stat().st_size >= 32 and os.access(p, os.R_OK)
    except OSError:
        return False


# A real run on the local cluster is searched for the key's bytes in tests/cluster/test_e2e_train.py
# (test_munge_key_absent_after_real_runs), which makes that run anyway: one cluster, two runs.
