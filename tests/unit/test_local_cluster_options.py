"""The local cluster's options and files, checked without bringing it up (the cluster itself:
tests/cluster/test_local_cluster.py).
"""

from __future__ import annotations

import subprocess

import pytest

from localcluster import files, plan, preflight
from localcluster import lifecycle as cluster
from localcluster import topology as layout


@pytest.mark.parametrize(
    "nodes,gpus,flag",
    [(0, 2, "--nodes"), (21, 2, "--nodes"), ("abc", 2, "--nodes"), ("2.5", 2, "--nodes"),
     (2, 0, "--gpus"), (2, 9, "--gpus"), (2, "two", "--gpus")],
)
def test_bad_options_are_refused_by_name(nodes, gpus, flag):
    with pytest.raises(cluster.ClusterError, match=flag):
        preflight.validate(nodes, gpus)


def test_good_options_pass():
    assert preflight.validate("3", 8) == (3, 8)


def test_hostctl_passes_shellcheck():
    r = subprocess.run(["shellcheck", str(files.HOSTCTL_SRC)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_inventory_points_at_the_repo_venv_and_hostctl():
    inv = plan.make_inventory(3, 2)
    assert inv.python == str(plan.REPO / ".venv" / "bin" / "python")
    assert inv.service_cmd.format(action="restart", service="munge") == f"{layout.HOSTCTL} restart munge"
    assert [(n.name, n.private_ip) for n in inv.nodes] == [
        ("controller", "10.213.0.10"), ("gpu-node-01", "10.213.0.11"),
        ("gpu-node-02", "10.213.0.12"), ("gpu-node-03", "10.213.0.13")]
    assert inv.controller.public_ip == "10.213.0.10" and inv.ssh_key_file == str(layout.CLUSTER_KEY)
