"""The boot platforms' facts as the rendered files read them (fast; the boot itself is
tests/boot/test_boot_cluster.py)."""

import json
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from bootstrap import node_layout, node_pins, user_data
from boottest import aptrepo, host, wheelhouse
from cluster.facts import ClusterFacts, NodeShape, facts_from_dict, facts_to_dict, plan_hosts
from cluster.platform import AWS, BOOT_DEBIAN12, BOOT_DEBIAN13, PLATFORMS
from tests.unit.test_bootstrap_render import script_packages

REPO = Path(__file__).resolve().parents[2]


def _facts(platform):
    ctl, nodes = plan_hosts("10.213.1.0/24", 2)
    return ClusterFacts("boot", ctl, nodes, NodeShape(2, 1000, 2, "l4"), "10.213.1.0/24", platform=platform)


@pytest.mark.parametrize("platform", [BOOT_DEBIAN12, BOOT_DEBIAN13], ids=lambda p: p.name)
def test_boot_platform_scratch_is_a_bind_and_no_nfs_server(platform):
    facts = _facts(platform)
    gpu = user_data.bootstrap_script(facts, "gpu", "gpu-node-01")
    assert "'/srv/cluster-scratch /scratch none bind,_netdev,nofail 0 0' >> /etc/fstab" in gpu
    ctl = user_data.bootstrap_script(facts, "controller")
    assert "nfs-kernel-server" not in ctl.split("step_nfs()", 1)[1].split("}", 1)[0]
    assert platform.name in PLATFORMS and platform.debian_suite


def test_aws_scratch_is_the_controllers_nfs_export():
    facts = _facts(AWS)
    gpu = user_data.bootstrap_script(facts, "gpu", "gpu-node-01")
    assert "'10.213.1.10:/scratch /scratch nfs defaults,_netdev,nofail 0 0' >> /etc/fstab" in gpu
    assert "systemctl enable --now nfs-kernel-server" in user_data.bootstrap_script(facts, "controller")


def test_templates_read_facts_not_platform_names():
    for path in (REPO / "bootstrap").rglob("*.j2"):
        text = path.read_text()
        assert "platform.name ==" not in text and "platform.name !=" not in text, path


def test_debian_mirror_from_deb822_sources(tmp_path, monkeypatch):
    src = tmp_path / "debian.sources"
    src.write_text("Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n"
                   "Components: main\n\nTypes: deb\nURIs: http://mirror.invalid/debian\n"
                   "Suites: bookworm bookworm-updates\nComponents: main\n")
    monkeypatch.setattr(host, "APT_SOURCES", (src,))
    assert host.debian_mirror() == "http://mirror.invalid/debian"
    monkeypatch.setattr(host, "APT_SOURCES", (tmp_path / "none.list",))
    with pytest.raises(host.BootError, match="no Debian archive"):
        host.debian_mirror()


def _gpu_node_render(platform):
    facts = _facts(platform)
    script = user_data.bootstrap_script(facts, "gpu", "gpu-node-01")
    packages = script_packages(script)
    return script, packages


def test_os_torch_changes_only_the_gpu_nodes_torch():
    """Debian 13's torch is Debian's python3-torch (Platform.os_torch): the GPU node installs the
    package, its venv sees the system's site-packages and pins torch to the package's version.
    Nothing else of the rendered files differs from the same platform without the fact."""
    plain = replace(BOOT_DEBIAN13, os_torch=None)
    torch_deb = BOOT_DEBIAN13.os_torch
    assert torch_deb.package == "python3-torch"
    script, packages = _gpu_node_render(BOOT_DEBIAN13)
    plain_script, plain_packages = _gpu_node_render(plain)
    assert packages == [*plain_packages, "python3-torch"]
    pins = node_pins.training_pins()
    want = " ".join(f"{p}=={torch_deb.version if p == 'torch' else pins[p]}" for p in node_pins.TRAINING_PACKAGES)
    assert f"want='{want}'" in script and "torch==2.6.0+debian " in want
    venv = '[ -x "${venv}/bin/python" ] || python3 -m venv %s"$venv"'
    assert venv % "--system-site-packages " in script and venv % "" not in script
    assert venv % "" in plain_script and "--system-site-packages" not in plain_script
    # No wheel cache: pip download cannot resolve the other pins without a torch wheel.
    assert "wait_wheel_cache" in plain_script and "wait_wheel_cache" not in script
    assert 'WHEEL_MISS="no wheel cache: torch is the OS\'s python3-torch"' in script
    ctl = user_data.bootstrap_script(_facts(BOOT_DEBIAN13), "controller")
    plain_ctl = user_data.bootstrap_script(_facts(plain), "controller")
    assert "pip download" in plain_ctl and "pip download" not in ctl
    assert "no wheel cache: the GPU nodes' torch is the OS's python3-torch" in ctl
    # Nothing else differs on the controller: outside the wheels step, its header line and the
    # bootstrap version (a hash of the whole script).
    def without_wheels(text):
        text = re.sub(r"^BOOTSTRAP_VERSION=\S+$", "BOOTSTRAP_VERSION=", text, flags=re.M)
        text = re.sub(r"\nstep_wheels\(\) \{\n.*?\n\}\n", "\n", text, flags=re.S)
        return re.sub(r"\n#   wheels .*?(?=\n#   services)", "", text, flags=re.S)
    assert without_wheels(ctl) == without_wheels(plain_ctl)
    assert "python3-torch" not in node_layout.role_packages(BOOT_DEBIAN13, "controller")


@pytest.mark.parametrize("platform", [AWS, BOOT_DEBIAN12], ids=lambda p: p.name)
def test_platforms_without_os_torch_install_the_pinned_torch(platform):
    assert platform.os_torch is None
    script, packages = _gpu_node_render(platform)
    assert packages == list(node_layout.PACKAGES["gpu"])
    assert f"torch=={node_pins.training_pins()['torch']} " in script
    assert 'python3 -m venv "$venv"' in script and "--system-site-packages" not in script


def test_os_torch_is_in_the_apt_repository_without_its_recommends_and_not_in_the_wheelhouse():
    assert "python3-torch" in aptrepo.packages(BOOT_DEBIAN13)
    assert aptrepo.without_recommends(BOOT_DEBIAN13) == ("python3-torch",)
    assert "python3-torch" not in aptrepo.packages(BOOT_DEBIAN12) and not aptrepo.without_recommends(BOOT_DEBIAN12)
    pins = node_pins.training_pins()
    assert wheelhouse.requirements(BOOT_DEBIAN12) == [f"{p}=={pins[p]}" for p in node_pins.TRAINING_PACKAGES]
    assert wheelhouse.requirements(BOOT_DEBIAN13) == [f"{p}=={pins[p]}" for p in node_pins.TRAINING_PACKAGES
                                                      if p != "torch"]


def test_wheel_requirements_for_the_platforms_python(tmp_path):
    """The dependencies the Debian 13 wheelhouse fetches: a wheel's Requires-Dist, markers
    evaluated for the platform's Python, no extras."""
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                   "Requires-Dist: numpy>=1.17\nRequires-Dist: tomli; python_version < \"3.12\"\n"
                   "Requires-Dist: pytest; extra == \"test\"\nRequires-Dist: fsspec[http]<=2026.9.0,>=2023.1.0\n"
                   "Requires-Dist: pywin32; sys_platform == \"win32\"\n")
    assert wheelhouse.wheel_requirements(whl, "3.13") == ["numpy>=1.17", "fsspec[http]<=2026.9.0,>=2023.1.0"]
    assert "tomli" in wheelhouse.wheel_requirements(whl, "3.11")


def _torch_deb(repo: Path, version: str) -> None:
    """A python3-torch .deb (dpkg-deb -b) holding only torch's egg-info, as Debian's does."""
    root = repo.parent / "pkg"
    info = root / f"usr/lib/python3/dist-packages/torch-{version}.egg-info"
    info.mkdir(parents=True)
    (info / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
                                   "Requires-Dist: filelock\nRequires-Dist: setuptools; python_version >= \"3.12\"\n"
                                   "Requires-Dist: sympy==1.13.1\nRequires-Dist: optree>=0.13.0; extra == \"optree\"\n")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text("Package: python3-torch\nVersion: 2.6.0+dfsg-7\nArchitecture: amd64\n"
                                         "Maintainer: test <test@localhost>\nDescription: test\n")
    repo.mkdir()
    host.run("dpkg-deb", "-b", str(root), str(repo / "python3-torch_2.6.0+dfsg-7_amd64.deb"))


def test_os_torch_requirements_read_from_the_package(tmp_path):
    """The node's pip reads the OS torch's own metadata (setuptools and sympy==1.13.1 on
    Python 3.13): the wheelhouse must hold them; a package of another version than the
    platform states is refused, naming the fact."""
    _torch_deb(tmp_path / "repo", BOOT_DEBIAN13.os_torch.version)
    reqs = wheelhouse.os_torch_requirements(BOOT_DEBIAN13, tmp_path / "repo")
    assert reqs == ["filelock", "setuptools", "sympy==1.13.1"]
    other = replace(BOOT_DEBIAN13, os_torch=replace(BOOT_DEBIAN13.os_torch, version="2.7.0+debian"))
    with pytest.raises(host.BootError, match="os_torch.version is 2.7.0"):
        wheelhouse.os_torch_requirements(other, tmp_path / "repo")


@pytest.mark.parametrize("platform", [AWS, BOOT_DEBIAN12, BOOT_DEBIAN13], ids=lambda p: p.name)
def test_facts_round_trip_keeps_os_torch(platform):
    """The inventory carries the facts as JSON (`fab reconfigure`, the job's rendezvous read them)."""
    facts = _facts(platform)
    back = facts_from_dict(json.loads(json.dumps(facts_to_dict(facts))))
    assert back == facts and back.platform.os_torch == platform.os_torch
