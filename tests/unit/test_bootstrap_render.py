"""Rendered files follow from the facts: slurm.conf, gres.conf, hosts, exports, user-data."""

import base64
import gzip
import re
from dataclasses import replace

import jinja2
import pytest
import yaml

from bootstrap import node_layout, node_pins, render, shipped_form, user_data
from cluster import hostpaths
from cluster.facts import ClusterFacts, NodeShape, plan_hosts
from cluster.platform import LOCAL


def make_facts(name, subnet, nodes, shape, **kw) -> ClusterFacts:
    controller, gpu_nodes = plan_hosts(subnet, nodes)
    return ClusterFacts(name, controller, gpu_nodes, shape, subnet, **kw)


# The shapes the project targets: the baseline's 2x g6.12xlarge (4x L4), a 3-node
# 8x H100 cluster, and the smallest possible one (1 node, 1 GPU, no EFA).
FACTS = {
    "l4x2": make_facts("mini", "10.0.1.0/24", 2, NodeShape(48, 185000, 4, "l4", threads_per_core=2)),
    "h100x3": make_facts(
        "big", "10.20.0.0/24", 3, NodeShape(192, 2000000, 8, "h100", sockets=2, threads_per_core=2),
        nvlink=True, nvswitch=True,
    ),
    "single": make_facts(
        "solo", "172.31.16.0/20", 1, NodeShape(8, 30000, 1, "a10g"), efa=False,
        ssh_user="admin", scratch="/shared",
    ),
}
CASES = list(FACTS)


def conf_lines(text):
    return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def kv(line):
    return dict(part.split("=", 1) for part in line.split())


def settings(slurm_conf):
    """Top-level Key=Value settings (node and partition lines excluded)."""
    out = {}
    for ln in conf_lines(slurm_conf):
        if ln.startswith(("NodeName=", "PartitionName=")):
            continue
        key, value = ln.split("=", 1)
        assert key not in out, f"{key} set twice"
        out[key] = value
    return out


@pytest.mark.parametrize("case", CASES)
def test_slurm_conf_node_lines_match_facts(case):
    facts = FACTS[case]
    lines = [kv(ln) for ln in conf_lines(render.render_slurm_conf(facts)) if ln.startswith("NodeName=")]
    # The shape once (every node is the same instance type), then each node's name and address.
    assert lines[0]["NodeName"] == "DEFAULT"
    nodes = [{**lines[0], **ln} for ln in lines[1:]]
    assert len(nodes) == len(facts.gpu_nodes)
    for node, host in zip(nodes, facts.gpu_nodes, strict=False):
        assert node == {
            "NodeName": host.name,
            "NodeAddr": host.ip,
            "CPUs": str(facts.shape.cpus),
            "Sockets": str(facts.shape.sockets),
            "CoresPerSocket": str(facts.shape.cores_per_socket),
            "ThreadsPerCore": str(facts.shape.threads_per_core),
            "RealMemory": str(facts.shape.real_memory_mib),
            "Gres": f"gpu:{facts.shape.gpu_type}:{facts.shape.gpu_count}",
            "State": "UNKNOWN",
        }


@pytest.mark.parametrize("case", CASES)
def test_slurm_conf_settings(case):
    facts = FACTS[case]
    text = render.render_slurm_conf(facts)
    s = settings(text)
    assert s["ClusterName"] == facts.cluster_name
    assert s["SlurmctldHost"] == f"{facts.controller.name}({facts.controller.ip})"
    assert s["AuthType"] == "auth/munge"
    assert s["CredType"] == "cred/munge" and "CryptoType" not in s  # CryptoType: the old name
    assert s["GresTypes"] == "gpu"
    assert s["SelectType"] == "select/cons_tres"
    assert s["SelectTypeParameters"] in ("CR_Core", "CR_Core_Memory")
    # With memory as a resource, a job that asks for nothing must fit on a node.
    assert int(s["DefMemPerCPU"]) * facts.shape.cpus <= facts.shape.real_memory_mib
    assert s["SchedulerType"] == "sched/backfill"
    # AWS (cgroups): jobs confined; tasks keep slurmd's unlimited MEMLOCK (EFA).
    assert s["ProctrackType"] == "proctrack/cgroup"
    assert s["TaskPlugin"] == "task/cgroup,task/affinity"
    assert s["PropagateResourceLimitsExcept"] == "MEMLOCK"
    assert s["ReturnToService"] == "1"
    assert s["SlurmdTimeout"] == "180"
    assert s["JobRequeue"] == "1"
    assert s["StateSaveLocation"] == "/var/lib/slurm/slurmctld"
    assert s["SlurmdSpoolDir"] == "/var/lib/slurm/slurmd"
    assert s["SlurmctldLogFile"].startswith("/var/log/slurm/")
    assert s["SlurmdLogFile"].startswith("/var/log/slurm/")
    # Ubuntu 24.04's slurmctld runs under systemd (--systemd), which writes no pid file.
    assert "SlurmctldPidFile" not in s
    assert s["SlurmdPidFile"] == "/run/slurmd.pid"
    assert s["HealthCheckProgram"] == hostpaths.HEALTHCHECK_PATH
    assert s["HealthCheckNodeState"] == "ANY"
    assert s["HealthCheckInterval"] == "60"
    assert "SchedulerParameters" not in s  # Slurm's own scheduler interval (60 s) on AWS
    assert s["SlurmctldParameters"] == "enable_configless"  # GPU nodes fetch the config
    parts = [kv(ln) for ln in conf_lines(text) if ln.startswith("PartitionName=")]
    assert parts == [
        {"PartitionName": "gpu", "Nodes": "ALL", "Default": "YES", "MaxTime": "24:00:00", "State": "UP"}
    ]
    # Commented sections, node lines in their own block.
    assert "# GPU nodes" in text and "# Partitions" in text


@pytest.mark.parametrize("case", CASES)
def test_gres_conf_binds_device_files(case):
    facts = FACTS[case]
    lines = [kv(ln) for ln in conf_lines(render.render_gres_conf(facts))]
    last = facts.shape.gpu_count - 1
    want_file = "/dev/nvidia0" if last == 0 else f"/dev/nvidia[0-{last}]"
    assert lines == [
        {"NodeName": h.name, "Name": "gpu", "Type": facts.shape.gpu_type, "File": want_file}
        for h in facts.gpu_nodes
    ]


def test_gres_conf_uses_the_device_prefix():
    base = FACTS["l4x2"]
    facts = ClusterFacts(**{**base.__dict__, "gpu_device_prefix": "/var/lib/slurm/gpu-standin/nvidia"})
    assert "File=/var/lib/slurm/gpu-standin/nvidia[0-3]" in render.render_gres_conf(facts)
    assert "/var/lib/slurm/gpu-standin/nvidia3" in render.render_healthcheck(facts)


@pytest.mark.parametrize("case", CASES)
def test_hosts_block(case):
    facts = FACTS[case]
    block = render.render_hosts(facts)
    lines = block.splitlines()
    assert lines[0].startswith(node_layout.HOSTS_BEGIN) and lines[-1] == node_layout.HOSTS_END
    assert [ln.split() for ln in lines[1:-1]] == [[h.ip, h.name] for h in facts.hosts]


def test_merge_hosts_is_idempotent_and_replaces_an_old_block():
    base = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
    old = render.render_hosts(FACTS["l4x2"])
    new = render.render_hosts(FACTS["h100x3"])
    once = render.merge_hosts(base, old)
    assert render.merge_hosts(once, old) == once
    replaced = render.merge_hosts(once + "10.9.9.9 other\n", new)
    assert replaced.count(node_layout.HOSTS_BEGIN) == 1
    assert "10.0.1.11 gpu-node-01" not in replaced
    assert "10.20.0.13 gpu-node-03" in replaced
    assert replaced.startswith(base) and "10.9.9.9 other\n" in replaced


@pytest.mark.parametrize("case", CASES)
def test_exports_subnet_only_with_root_squash(case):
    facts = FACTS[case]
    lines = conf_lines(render.render_exports(facts))
    assert len(lines) == 1
    path, client = lines[0].split()
    assert path == facts.scratch
    # subtree_check: /scratch is a folder of the controller's root file system, and without the
    # check nfsd takes a file handle of any file on it (a node's root could forge one for /).
    assert client == f"{facts.subnet_cidr}(rw,sync,subtree_check,root_squash)"
    assert "*" not in render.render_exports(facts)
    assert "no_root_squash" not in render.render_exports(facts)


def test_render_files_paths():
    files = render.render_files(FACTS["l4x2"])
    assert set(files) == {
        "/etc/slurm/slurm.conf", "/etc/slurm/gres.conf", "/etc/exports.d/slurm-gpu.exports",
        node_layout.HOSTS_BLOCK_FILE, hostpaths.HEALTHCHECK_PATH,
        "/etc/slurm-gpu/slurmd.env", "/etc/systemd/system/slurmd.service.d/slurm-gpu.conf",
        "/etc/slurm/cgroup.conf",  # the AWS platform has cgroups
        node_layout.IMDS_GUARD_RULES, node_layout.IMDS_GUARD_UNIT_PATH,  # the controller's metadata guard
        node_layout.SLURMCTLD_DROPIN,  # slurmctld requires the guard
    }
    assert all(p.startswith("/") and text.endswith("\n") for p, text in files.items())
    # The local platform has none: no cgroup.conf, and slurm.conf asks for no cgroup plugin.
    local = render.render_files(replace(FACTS["l4x2"], platform=LOCAL))
    assert set(local) == set(files) - {"/etc/slurm/cgroup.conf"}
    assert "cgroup" not in settings(local["/etc/slurm/slurm.conf"])["ProctrackType"]
    assert settings(local["/etc/slurm/slurm.conf"])["TaskPlugin"] == "task/none"


def test_missing_variable_raises(monkeypatch):
    real = render._context

    def without_gres(facts):
        ctx = real(facts)
        del ctx["gres"]
        return ctx

    monkeypatch.setattr(render, "_context", without_gres)
    with pytest.raises(jinja2.UndefinedError, match="gres"):
        render.render_slurm_conf(FACTS["l4x2"])


def test_bad_role_and_hostname_raise():
    facts = FACTS["l4x2"]
    for call in (user_data.user_data, user_data.bootstrap_script, render.role_files):
        with pytest.raises(ValueError, match="role must be one of controller, gpu"):
            call(facts, "worker")
    with pytest.raises(ValueError, match="not a gpu host"):
        user_data.user_data(facts, "gpu", "controller")
    with pytest.raises(ValueError, match="gpu_count must be >= 1"):
        render.render_gres_conf(ClusterFacts(**{**facts.__dict__, "shape": NodeShape(4, 100, 0, "l4")}))


def parse_user_data(text):
    assert text.startswith("#cloud-config\n")
    return yaml.safe_load(text)


def file_text(entry):
    """A write_files entry's content, decoded as cloud-init does."""
    if entry.get("encoding") == "gz+b64":
        return gzip.decompress(base64.b64decode(entry["content"])).decode()
    assert "encoding" not in entry
    return entry["content"]


def script_packages(script: str) -> list[str]:
    """The apt packages a rendered bootstrap script's `packages` step installs."""
    return re.search(r"^step_packages\(\) \{\n.*?^  for p in ([^\n]*); do$", script, re.S | re.M)[1].split()


def decoded_text(entry: dict) -> str:
    """A write_files entry's text, decoding cloud-init's gz+b64."""
    if entry.get("encoding") == "gz+b64":
        return gzip.decompress(base64.b64decode(entry["content"])).decode()
    return entry["content"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("role", node_layout.ROLES)
def test_user_data_content(case, role):
    facts = FACTS[case]
    cfg = parse_user_data(user_data.user_data(facts, role))
    assert cfg["preserve_hostname"] is True
    assert cfg["manage_etc_hosts"] is False
    # cloud-init's package module never runs (it fails the boot after 30 s of another apt's dpkg
    # lock): the bootstrap's packages step installs them, with apt's own wait.
    assert not {"package_update", "package_upgrade", "packages", "apt"} & set(cfg)
    packages = script_packages(user_data.bootstrap_script(facts, role))
    assert {"slurm-wlm", "munge", "nfs-common"} <= set(packages)
    assert ("nfs-kernel-server" in packages) == (role == "controller")
    written = {f["path"]: f for f in cfg["write_files"]}
    expected = render.role_files(facts, role)
    expected[hostpaths.BOOTSTRAP_PATH] = user_data.bootstrap_script(
        facts, role, facts.controller.name if role == "controller" else None
    )
    expected[node_layout.APT_LOCK_CONF] = render.render_apt_lock_conf(facts)
    # Every file arrives byte for byte (YAML block scalars keep the text), shell scripts without
    # their comment lines (shipped_form.shipped_shell; tests/unit/test_user_data_size.py: same commands).
    expected = shipped_form.shipped(expected)
    assert {p: file_text(f) for p, f in written.items()} == expected
    # apt on the node waits for a dpkg lock held by first-boot unattended upgrades.
    assert re.fullmatch(r'DPkg::Lock::Timeout "(\d+)";', expected[node_layout.APT_LOCK_CONF].splitlines()[-1])
    assert int(expected[node_layout.APT_LOCK_CONF].split('"')[1]) >= 600
    # First boot holds the apt timers so background upgrades do not race the bootstrap.
    assert any("apt-daily-upgrade.timer" in " ".join(map(str, cmd)) and "cloud-init-per" in cmd
               for cmd in cfg["bootcmd"])
    assert (node_layout.EXPORTS_FILE in written) == (role == "controller")
    assert (hostpaths.HEALTHCHECK_PATH in written) == (role == "gpu")
    assert written[hostpaths.BOOTSTRAP_PATH]["permissions"] == "0755"
    # Configless: only the controller holds slurm.conf and gres.conf; GPU nodes get slurmd's
    # --conf-server option and the systemd drop-in that passes it.
    assert (node_layout.SLURM_CONF in written) == (node_layout.GRES_CONF in written) == (role == "controller")
    assert (node_layout.SLURMD_DROPIN in written) == (node_layout.SLURMD_ENV_FILE in written) == (role == "gpu")
    if role == "controller":
        assert written[node_layout.SLURM_CONF]["permissions"] == "0644"
    else:
        env = file_text(written[node_layout.SLURMD_ENV_FILE])
        assert f'SLURMD_OPTIONS="--conf-server {facts.controller.ip}:6817"' in env.splitlines()
        dropin = file_text(written[node_layout.SLURMD_DROPIN]).splitlines()
        assert "ConditionPathExists=" in dropin and f"EnvironmentFile={node_layout.SLURMD_ENV_FILE}" in dropin
    assert cfg["runcmd"] == [["env", "SLURM_GPU_CONSOLE=1", hostpaths.BOOTSTRAP_PATH]]
    # no output of cloud-init or a step on the console, where fab pins host keys (to_console writes ours)
    assert cfg["output"] == {"all": ">> /var/log/cloud-init-output.log"}
    # No munge key: nothing is written under /etc/munge, no key-like blob.
    assert not any(p.startswith("/etc/munge") for p in written)
    plain = [f["content"] for f in written.values() if "encoding" not in f]
    assert not any(re.search(r"[A-Za-z0-9+/=]{200,}", t) for t in plain)


def test_user_data_names_the_host():
    facts = FACTS["h100x3"]
    script = user_data.bootstrap_script(facts, "gpu", "gpu-node-02")
    assert "local want='gpu-node-02'" in script
    # Without a name, the GPU script finds its name from its IP in the hosts block.
    assert "local want=''" in user_data.bootstrap_script(facts, "gpu")
    written = {f["path"]: f for f in parse_user_data(user_data.user_data(facts, "controller"))["write_files"]}
    assert "local want='controller'" in decoded_text(written[hostpaths.BOOTSTRAP_PATH])


def test_gpu_nodes_get_nothing_from_slurms_config_dir(monkeypatch):
    """Any file under /etc/slurm/ (a later cgroup.conf too) is the controller's: configless
    GPU nodes fetch them from slurmctld, and `fab reconfigure` installs them."""
    from ops.actions.reconfigure import controller_files

    real = render.render_files
    monkeypatch.setattr(render, "render_files", lambda f: {**real(f), "/etc/slurm/cgroup.conf": "x\n"})
    facts = FACTS["l4x2"]
    assert "/etc/slurm/cgroup.conf" in render.role_files(facts, "controller")
    assert not [p for p in render.role_files(facts, "gpu") if p.startswith("/etc/slurm/")]
    assert sorted(controller_files(render.render_files(facts))) == [
        "/etc/slurm-gpu/hosts.block", "/etc/slurm/cgroup.conf", node_layout.GRES_CONF, node_layout.SLURM_CONF]


def test_a_gpu_nodes_user_data_does_not_depend_on_the_node_count():
    """Scaling adds or removes nodes without changing any other node's user-data."""
    shape = NodeShape(192, 2000000, 8, "h100")
    texts = {n: user_data.user_data(make_facts("big", "10.20.0.0/24", n, shape), "gpu", "gpu-node-02")
             for n in (2, 3, 50)}
    assert texts[2] == texts[3] == texts[50]
    doc = parse_user_data(texts[3])
    block = next(file_text(f) for f in doc["write_files"] if f["path"] == node_layout.HOSTS_BLOCK_FILE)
    assert conf_lines(block) == ["10.20.0.10 controller", "10.20.0.12 gpu-node-02"]
    assert "gpu-node-03" not in texts[3] and "gpu-node-01" not in texts[3]
    # The node names itself from its user-data (the script may travel gzip+base64: decode as cloud-init does).
    script = next(file_text(f) for f in doc["write_files"] if f["path"] == hostpaths.BOOTSTRAP_PATH)
    assert "local want='gpu-node-02'" in script
    # The controller's does change: it holds the node list.
    ctl = {n: user_data.user_data(make_facts("big", "10.20.0.0/24", n, shape), "controller") for n in (2, 3)}
    assert ctl[2] != ctl[3]


# A full /24: 244 GPU nodes, the most plan_hosts allows.
FULL = make_facts("max", "10.0.0.0/24", 244, NodeShape(192, 2000000, 8, "h100"))


@pytest.mark.parametrize("role", node_layout.ROLES)
def test_user_data_fits_ec2_even_for_a_full_subnet(role):
    # EC2 counts the bytes it is given before base64: the gzip-compressed cloud-config.
    text = user_data.user_data(FULL, role)
    assert len(text.encode()) > user_data.MAX_USER_DATA_BYTES  # plain, it would not fit
    assert len(user_data.user_data_gzip(FULL, role)) <= user_data.MAX_USER_DATA_BYTES
    written = {f["path"]: file_text(f) for f in parse_user_data(text)["write_files"]}
    if role == "controller":
        assert written[node_layout.SLURM_CONF] == shipped_form.shipped_slurm_config(render.render_slurm_conf(FULL))
        assert written[node_layout.SLURM_CONF].count("\nNodeName=gpu-node-") == 244
    else:
        assert node_layout.SLURM_CONF not in written
    raw = base64.b64decode(user_data.user_data_base64(FULL, role))
    assert gzip.decompress(raw).decode() == text


@pytest.mark.parametrize("role", node_layout.ROLES)
def test_bootstrap_script_structure(role):
    script = user_data.bootstrap_script(FACTS["l4x2"], role)
    assert script.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in script and "trap '" in script and " ERR" in script
    assert not re.search(r"^\s*set -[a-z]*x", script, re.M)
    for step in node_layout.STEPS[role]:
        assert re.search(rf"^step_{step}\(\) {{", script, re.M), step
        assert re.search(rf"^#   {step} ", script, re.M), f"step {step} not documented"
    assert f"ALL_STEPS=({' '.join(node_layout.STEPS[role])})" in script


def test_controller_makes_the_key_gpu_nodes_never_copy_one():
    ctrl = user_data.bootstrap_script(FACTS["l4x2"], "controller")
    gpu = user_data.bootstrap_script(FACTS["l4x2"], "gpu")
    assert "munge-key.created" in ctrl and "munge-key.created" not in gpu
    for script in (ctrl, gpu):
        assert "chmod 0400 /etc/munge/munge.key" in script and "chmod 0700 /etc/munge" in script
        assert "scp" not in script and "cat /etc/munge/munge.key" not in script


def test_gpu_script_mounts_scratch_with_netdev_nofail():
    facts = FACTS["single"]
    gpu = user_data.bootstrap_script(facts, "gpu")
    line = f"{facts.controller.ip}:{facts.scratch} {facts.scratch} nfs defaults,_netdev,nofail 0 0"
    assert f"echo '{line}' >> /etc/fstab" in gpu
    assert f"HF_HOME={facts.scratch}/hf-cache" in gpu


def test_training_step_imports_what_the_pins_install():
    """The `training` step's import check, run here against the same pins (requirements.txt): a
    package whose module has another name (tensorboardx -> tensorboardX) must be imported by it."""
    import subprocess
    import sys

    gpu = user_data.bootstrap_script(FACTS["l4x2"], "gpu")
    line = re.search(r'"\$\{venv\}/bin/python" -c "(import [^"]+)"', gpu)[1]
    assert line == "import " + ", ".join(node_pins.training_modules())
    res = subprocess.run([sys.executable, "-c", line], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-500:]


def test_training_stack_pinned_like_requirements(tmp_path):
    pins = node_pins.training_pins()
    gpu = user_data.bootstrap_script(FACTS["l4x2"], "gpu")
    want = " ".join(f"{p}=={pins[p]}" for p in node_pins.TRAINING_PACKAGES)
    assert f"want='{want}'" in gpu
    assert node_layout.TRAINING_VENV in gpu
    req = (node_pins.REQUIREMENTS).read_text()
    for p in node_pins.TRAINING_PACKAGES:
        assert f"{p}=={pins[p]}" in req
    bad = tmp_path / "requirements.txt"
    bad.write_text("transformers==1.0\n")
    with pytest.raises(ValueError, match="no '==' pin for torch"):
        node_pins.training_pins(bad)


def test_first_boot_upgrades_cannot_run_before_the_gpu_stack_is_held():
    """Unattended upgrades run from apt-daily-upgrade.timer (Ubuntu 24.04's apt). The rendered user-data
    stops it and apt-daily.timer in bootcmd, on the first boot only; bootcmd runs in cloud-init's network
    stage, which on Ubuntu is ordered Before=sysinit.target (cloud-init systemd/cloud-init-network.service.tmpl),
    and a timer unit starts only After=sysinit.target (systemd.timer(5), "Implicit Dependencies"): the
    stop lands before either timer can fire, Persistent=true catch-up included. The bootstrap starts them
    again only in its last step, after the `holds` step has held the kernel and NVIDIA packages and
    blacklisted them for unattended-upgrades (docs/AWS.md, "What AWS answers")."""
    facts = FACTS["l4x2"]
    cfg = parse_user_data(user_data.user_data(facts, "gpu", "gpu-node-01"))
    (stop,) = [cmd for cmd in cfg["bootcmd"] if "apt-daily-upgrade.timer" in " ".join(map(str, cmd))]
    assert stop[:2] == ["cloud-init-per", "instance"]  # first boot only: later boots keep their timers
    assert re.search(r"systemctl stop apt-daily\.timer apt-daily-upgrade\.timer", stop[-1])
    script = user_data.bootstrap_script(facts, "gpu", "gpu-node-01")
    steps = node_layout.STEPS["gpu"]
    assert steps.index("holds") < steps.index("packages") and steps[-1] == "services"
    calls = [i for i, line in enumerate(script.splitlines()) if line.strip() == "release_apt_timers"]
    services = script.splitlines().index("step_services() {")
    assert len(calls) == 1 and calls[0] > services  # released once, in the last step only
    assert "apt-mark hold" in script and "Unattended-Upgrade::Package-Blacklist" in script
