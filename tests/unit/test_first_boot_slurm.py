"""CredType and SlurmctldPidFile: what slurm.conf, the GPU bootstrap
and the health check say about the node's CPUs and NVSwitch, from the instance facts (through
the provider's result types, mocked) and from this machine (checked against its real slurmd)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace

import pulumi
import pulumi_aws as aws
import pytest

from bootstrap import node_layout, render, user_data
from bootstrap.slurm_keys import RENAMED_KEYS, config_keys
from boottest import boot_cluster
from cluster.facts import ClusterFacts, NodeShape, plan_hosts
from cluster.platform import AWS, BOOT_DEBIAN12, BOOT_DEBIAN13, LOCAL, PLATFORMS
from infra.instance_types import gpu_node_facts
from localcluster import plan as local_plan
from tests.support.pulumi_mocks import ClusterMocks


@pytest.fixture
def info():
    pulumi.runtime.set_mocks(ClusterMocks(), project="slurm-gpu", stack="test", preview=False)
    return lambda itype: aws.ec2.get_instance_type(instance_type=itype)


def aws_facts(gpu, platform=AWS) -> ClusterFacts:
    ctl, nodes = plan_hosts("10.0.1.0/24", 2)
    return ClusterFacts("t", ctl, nodes, gpu.shape, "10.0.1.0/24", nvlink=gpu.nvlink,
                        nvswitch=gpu.nvswitch, platform=platform)


def node_line(text: str) -> dict[str, str]:
    line = next(ln for ln in text.splitlines() if ln.startswith("NodeName=DEFAULT "))
    return dict(w.split("=", 1) for w in line.split())


# ------------------------------------------------------------ point 4: CPU topology

@pytest.mark.parametrize("itype,want", [
    # DescribeInstanceTypes: 48 vCPUs = 24 cores x 2 threads; the type is part of a host (1 socket).
    ("g6.12xlarge", {"CPUs": "48", "Sockets": "1", "CoresPerSocket": "24", "ThreadsPerCore": "2"}),
    # 192 vCPUs = 96 cores x 2 threads, the whole two-socket host.
    ("p5.48xlarge", {"CPUs": "192", "Sockets": "2", "CoresPerSocket": "48", "ThreadsPerCore": "2"}),
])
def test_node_line_spells_out_the_topology_aws_reports(info, itype, want):
    gpu = gpu_node_facts(info(itype), efa=True)
    line = node_line(render.render_slurm_conf(aws_facts(gpu)))
    assert {k: line.get(k) for k in want} == want


def test_a_topology_that_does_not_add_up_is_refused():
    bad = NodeShape(cpus=48, real_memory_mib=1000, gpu_count=1, gpu_type="l4", sockets=5, threads_per_core=2)
    ctl, nodes = plan_hosts("10.0.1.0/24", 1)
    with pytest.raises(ValueError, match="48 CPUs are not 5 socket"):
        render.render_slurm_conf(ClusterFacts("t", ctl, nodes, bad, "10.0.1.0/24"))


def _slurmd_hardware() -> dict[str, str]:
    """What this machine's slurmd counts (slurmd -C: "NodeName=x CPUs=2 Boards=1 SocketsPerBoard=1 ...")."""
    if not shutil.which("slurmd"):
        pytest.skip("slurmd not installed")
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    return dict(w.split("=", 1) for w in out.split("\n")[0].split())


@pytest.mark.parametrize("facts", [local_plan.cluster_facts(2, 2), boot_cluster.cluster_facts(BOOT_DEBIAN12)],
                         ids=["local", "boot"])
def test_local_and_boot_node_lines_agree_with_this_machines_slurmd(facts):
    """The local cluster and the boot test run real slurmd here: a node line whose topology
    differs from what slurmd counts is re-split or (fewer cores) drained."""
    hw = _slurmd_hardware()
    line = node_line(render.render_slurm_conf(facts))
    assert (line["CPUs"], line["Sockets"], line["CoresPerSocket"], line["ThreadsPerCore"]) == \
        (hw["CPUs"], str(int(hw["Boards"]) * int(hw["SocketsPerBoard"])), hw["CoresPerSocket"], hw["ThreadsPerCore"])


# ------------------------------------------------------------ point 8: NVSwitch

@pytest.mark.parametrize("itype,nvswitch", [("g6.12xlarge", False), ("g6.48xlarge", False),
                                            ("p4d.24xlarge", True), ("p5.48xlarge", True)])
def test_nvswitch_is_an_instance_fact(info, itype, nvswitch):
    gpu = gpu_node_facts(info(itype), efa=True)
    assert gpu.nvswitch is nvswitch
    facts = aws_facts(gpu)
    script = user_data.bootstrap_script(facts, "gpu")
    hc = render.render_healthcheck(facts)
    assert ("systemctl enable --now nvidia-fabricmanager.service" in script) is nvswitch
    assert ("is-active --quiet nvidia-fabricmanager.service" in hc) is nvswitch


def test_nvswitch_scripts_pass_shellcheck(tmp_path, info):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    facts = aws_facts(gpu_node_facts(info("p5.48xlarge"), efa=True))
    (tmp_path / "gpu.sh").write_text(user_data.bootstrap_script(facts, "gpu"))
    (tmp_path / "hc.sh").write_text(render.render_healthcheck(facts))
    res = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(tmp_path / "gpu.sh"),
                          str(tmp_path / "hc.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


SYSTEMCTL = r"""#!/bin/bash
# Records its arguments; nvidia-fabricmanager is active when $FM_ACTIVE is 1.
printf '%s\n' "$*" >> "$CALLS"
case "$1 ${2:-}" in
  "is-active --quiet") [ "$FM_ACTIVE" = 1 ] ;;
  *) exit 0 ;;
esac
"""
NVIDIA_SMI = "#!/bin/bash\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 80GB HBM3\"; echo $i; done\n"


@pytest.fixture
def p5(tmp_path, info, monkeypatch):
    """A p5's gpus step and health check, run for real against stand-in devices with systemctl,
    nvidia-smi and scontrol as recording stubs; the bootstrap's state under tmp_path."""
    for name in ("STATE_DIR", "STEPS_DIR", "MARKER_PATH", "VERSION_PATH"):
        monkeypatch.setattr(render, name, str(tmp_path / "state" / name.lower()))
    devdir = tmp_path / "dev"
    devdir.mkdir()
    for i in range(8):
        (devdir / f"nvidia{i}").touch()
    facts = replace(aws_facts(gpu_node_facts(info("p5.48xlarge"), efa=True)), gpu_device_prefix=str(devdir / "nvidia"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("systemctl", SYSTEMCTL), ("nvidia-smi", NVIDIA_SMI),
                       ("scontrol", f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/drain\n')):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    gpu = tmp_path / "bootstrap-gpu"
    gpu.write_text(user_data.bootstrap_script(facts, "gpu", facts.gpu_nodes[0].name))
    hc = tmp_path / "healthcheck"
    hc.write_text(render.render_healthcheck(facts))
    skip = " ".join(s for s in node_layout.STEPS["gpu"] if s != "gpus")

    def run(which: str, active: bool):
        env = {"PATH": f"{bindir}:/usr/sbin:/usr/bin:/sbin:/bin", "CALLS": str(tmp_path / "calls"),
               "FM_ACTIVE": "1" if active else "0", "SLURM_GPU_SKIP_STEPS": skip,
               "SLURMD_NODENAME": "gpu-node-01", "SCRIPT": str(gpu if which == "gpus" else hc)}
        # have_systemd looks for /run/systemd/system: a private /run in a mount namespace.
        cmd = 'mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system && exec bash "$SCRIPT"'
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", cmd],
                              env=env, capture_output=True, text=True, timeout=60)

    return run, tmp_path


def test_p5_first_boot_starts_fabric_manager_and_fails_without_it(p5):
    run, tmp = p5
    res = run("gpus", active=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "enable --now nvidia-fabricmanager.service" in (tmp / "calls").read_text()
    assert "nvidia-fabricmanager is active (NVSwitch)" in res.stdout
    res = run("gpus", active=False)
    assert res.returncode != 0
    out = res.stdout + res.stderr  # a step's output goes through tee to stdout
    assert "GPU check: nvidia-fabricmanager is not active" in out
    assert 'step "gpus" failed' in out


def test_p5_health_check_drains_without_fabric_manager(p5):
    run, tmp = p5
    assert run("hc", active=True).returncode == 0
    assert not (tmp / "drain").exists()
    res = run("hc", active=False)
    assert res.returncode != 0
    drain = (tmp / "drain").read_text().splitlines()
    assert drain[:3] == ["update", "nodename=gpu-node-01", "state=drain"]
    assert "nvidia-fabricmanager is not active" in drain[3]


# ------------------------------------------------------------ CredType, SlurmctldPidFile

@pytest.mark.parametrize("name", sorted(PLATFORMS))
def test_slurm_conf_uses_credtype_and_no_renamed_key(name):
    ctl, nodes = plan_hosts("10.0.1.0/24", 1)
    text = render.render_slurm_conf(ClusterFacts("t", ctl, nodes, NodeShape(4, 1000, 1, "l4"), "10.0.1.0/24",
                                                 platform=PLATFORMS[name]))
    keys = {k for _, k in config_keys(text)}
    assert "CredType=cred/munge" in text.splitlines()
    assert not keys & set(RENAMED_KEYS), f"old key names: {keys & set(RENAMED_KEYS)}"


@pytest.mark.parametrize("platform,pidfile", [(AWS, None), (BOOT_DEBIAN13, None),
                                              (LOCAL, "/run/slurmctld.pid"), (BOOT_DEBIAN12, "/run/slurmctld.pid")])
def test_slurmctld_pidfile_only_where_slurmctld_writes_one(platform, pidfile):
    ctl, nodes = plan_hosts("10.0.1.0/24", 1)
    text = render.render_slurm_conf(ClusterFacts("t", ctl, nodes, NodeShape(4, 1000, 1, "l4"), "10.0.1.0/24",
                                                 platform=platform))
    found = re.findall(r"^SlurmctldPidFile=(.*)$", text, re.M)
    assert found == ([pidfile] if pidfile else [])

