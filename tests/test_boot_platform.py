"""The boot platforms' facts as the rendered files read them (fast; the boot itself is
tests/test_boot_cluster.py)."""

from pathlib import Path

import pytest

from bootstrap import render
from bootstrap.facts import ClusterFacts, NodeShape, plan_hosts
from bootstrap.platform import AWS, BOOT_DEBIAN12, BOOT_DEBIAN13, PLATFORMS
from boottest import host

REPO = Path(__file__).resolve().parent.parent


def _facts(platform):
    ctl, nodes = plan_hosts("10.213.1.0/24", 2)
    return ClusterFacts("boot", ctl, nodes, NodeShape(2, 1000, 2, "l4"), "10.213.1.0/24", platform=platform)


@pytest.mark.parametrize("platform", [BOOT_DEBIAN12, BOOT_DEBIAN13], ids=lambda p: p.name)
def test_boot_platform_scratch_is_a_bind_and_no_nfs_server(platform):
    facts = _facts(platform)
    gpu = render.bootstrap_script(facts, "gpu", "gpu-node-01")
    assert "'/srv/cluster-scratch /scratch none bind,_netdev,nofail 0 0' >> /etc/fstab" in gpu
    ctl = render.bootstrap_script(facts, "controller")
    assert "nfs-kernel-server" not in ctl.split("step_nfs()", 1)[1].split("}", 1)[0]
    assert platform.name in PLATFORMS and platform.debian_suite


def test_aws_scratch_is_the_controllers_nfs_export():
    facts = _facts(AWS)
    gpu = render.bootstrap_script(facts, "gpu", "gpu-node-01")
    assert "'10.213.1.10:/scratch /scratch nfs defaults,_netdev,nofail 0 0' >> /etc/fstab" in gpu
    assert "systemctl enable --now nfs-kernel-server" in render.bootstrap_script(facts, "controller")


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
