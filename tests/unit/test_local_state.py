"""The local cluster's saved state (localcluster/state.py). With no root and no cluster: it
round-trips through layout.STATE_FILE, reads a file from before idle stop existed, and turns a
corrupt file into an error that names the file and what `status` tells the user to run. The
last test (root, a one-host cluster) shows `up` and `down` getting past a corrupt file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time

import pytest

from localcluster import health, plan, state
from localcluster import lifecycle as cluster
from localcluster import topology as layout
from localcluster.state import ClusterState, HostEntry, StateFileError

# What `fab local.up` wrote before `--idle-stop` existed (no "idle_stop_s").
OLD_FILE = {
    "nodes": 1, "gpus": 2, "fresh_keys": True, "made_mount_points": ["/scratch"], "started": 1764800000.5,
    "hosts": [
        {"name": "controller", "ip": "10.213.0.10", "role": "controller", "index": 0,
         "netns": "sgpu-controller", "pid": 4242, "ns": ["mnt:[4026532001]", "net:[4026532000]"]},
        {"name": "gpu-node-01", "ip": "10.213.0.11", "role": "gpu", "index": 1,
         "netns": "sgpu-gpu-node-01", "pid": None, "ns": []},
    ],
}


@pytest.fixture
def state_file(tmp_path, monkeypatch):
    path = tmp_path / "cluster.json"
    monkeypatch.setattr(layout, "STATE_FILE", path)
    return path


def made(nodes: int = 2) -> ClusterState:
    """A cluster whose controller holder is ready and whose GPU hosts' are not yet."""
    ctl, *gpu_hosts = (HostEntry.of(s) for s in plan.host_specs(nodes))
    hosts = (dataclasses.replace(ctl, pid=123, ns=("net:[1]", "uts:[2]")), *gpu_hosts)
    return ClusterState(nodes=nodes, gpus=3, fresh_keys=False, idle_stop_s=30, cred_expire=20, hosts=hosts,
                        made_mount_points=("/etc/slurm-gpu",), started=12.5)


def test_round_trip(state_file):
    saved = made()
    state.save(saved)
    assert state.load() == saved
    data = json.loads(state_file.read_text())
    # The file a reader (or an older `fab`) sees: plain JSON, one object per host.
    assert [(h["name"], h["ip"], h["role"], h["index"], h["netns"]) for h in data["hosts"]] == [
        ("controller", "10.213.0.10", "controller", 0, "sgpu-controller"),
        ("gpu-node-01", "10.213.0.11", "gpu", 1, "sgpu-gpu-node-01"),
        ("gpu-node-02", "10.213.0.12", "gpu", 2, "sgpu-gpu-node-02")]
    assert (data["nodes"], data["gpus"], data["idle_stop_s"], data["cred_expire"], data["hosts"][0]["pid"]) == \
        (2, 3, 30, 20, 123)
    assert not state_file.with_suffix(".tmp").exists()


def test_no_file_is_no_cluster(state_file):
    assert state.load() is None
    lines: list[str] = []
    assert cluster.status(out=lines.append) is False
    assert lines == ["no local cluster (start one with `fab local.up`)"]


def test_a_file_from_before_idle_stop_reads(state_file):
    state_file.write_text(json.dumps(OLD_FILE))
    old = state.load()
    assert (old.nodes, old.gpus, old.fresh_keys, old.idle_stop_s, old.cred_expire) == (1, 2, True, 0, None)
    assert old.made_mount_points == ("/scratch",) and old.complete
    ctl = old.host("controller")
    assert (ctl.pid, ctl.ns, ctl.netns) == (4242, ("mnt:[4026532001]", "net:[4026532000]"), "sgpu-controller")
    assert old.host("gpu-node-01").pid is None
    with pytest.raises(KeyError, match="gpu-node-02"):
        old.host("gpu-node-02")


@pytest.mark.parametrize("text, problem", [
    ('{"nodes": 2, "gpus"', "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({k: v for k, v in OLD_FILE.items() if k != "hosts"}), "no 'hosts'"),
    (json.dumps({**OLD_FILE, "nodes": "2"}), "'nodes' is '2'"),
    (json.dumps({**OLD_FILE, "gpus": True}), "'gpus' is True"),
    (json.dumps({**OLD_FILE, "cred_expire": "20"}), "'cred_expire' is '20'"),
    (json.dumps({**OLD_FILE, "hosts": [{k: v for k, v in OLD_FILE["hosts"][0].items() if k != "ip"}]}),
     "hosts[0]: no 'ip'"),
    (json.dumps({**OLD_FILE, "hosts": ["controller"]}), "hosts[0]: not an object"),
    (json.dumps({**OLD_FILE, "hosts": [{**OLD_FILE["hosts"][0], "role": "login"}]}), "hosts[0]: role 'login'"),
    (json.dumps({**OLD_FILE, "hosts": [{**OLD_FILE["hosts"][0], "pid": "4242"}]}), "hosts[0]: pid '4242'"),
    (json.dumps({**OLD_FILE, "hosts": [{**OLD_FILE["hosts"][0], "ns": [4026532000]}]}), "hosts[0]: 'ns' holds a non-string"),
])
def test_a_corrupt_file_is_named_with_the_fix(state_file, text, problem):
    state_file.write_text(text)
    with pytest.raises(StateFileError) as info:
        state.load()
    assert str(state_file) in str(info.value) and problem in str(info.value)
    lines: list[str] = []
    assert cluster.status(out=lines.append) is False
    assert len(lines) == 1 and problem in lines[0] and "`fab local.down`" in lines[0], lines


def test_a_half_made_cluster_is_not_healthy():
    saved = made()
    assert health.problems(ClusterState(nodes=2, gpus=3, hosts=saved.hosts[:2])) == ["not every host was made"]




@pytest.mark.root
def test_a_state_file_that_outlived_its_cluster_names_no_other_process(state_file, monkeypatch):
    """The kernel reuses namespace ids: a stale state's recorded ids may now be another process's (here a
    stand-in for a container: its own network, UTS and mount namespaces). `fab local.down` finds the cluster's
    processes by its named network namespaces only, never by recorded ids: with none left, nothing is killed,
    whatever the state file says; with one, only what is in it."""
    from pathlib import Path

    from localcluster import dismantle, hosts, netns

    stranger = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "sleep", "120"])
    try:
        own = hosts.ns_ids(os.getpid())
        deadline = time.monotonic() + 10
        while (ids := hosts.ns_ids(stranger.pid)).get("net") in (None, own["net"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ids["net"] != own["net"] and ids["uts"] != own["uts"] and ids["mnt"] != own["mnt"], ids
        ctl = HostEntry.of(plan.host_specs(1)[0])
        stale = ClusterState(nodes=1, gpus=1, hosts=(dataclasses.replace(ctl, pid=stranger.pid,
                                                                          ns=tuple(sorted(ids.values()))),))
        state.save(stale)  # what `local.down` reads: the stranger's ids, recorded
        monkeypatch.setattr(netns, "our_netns", lambda: [])  # the cluster's namespaces are gone
        assert state.load() == stale and dismantle.namespaces() == set()
        # A named namespace of the cluster (here: one that is this test's own network namespace) counts, and
        # only it: the stranger's recorded ids do not come with it.
        monkeypatch.setattr(netns, "our_netns", lambda: [ctl.netns])
        monkeypatch.setattr(netns, "netns_path", lambda name: Path("/proc/self/ns/net"))
        assert dismantle.namespaces() == {own["net"]}
        monkeypatch.setattr(netns, "netns_path", lambda name: Path(f"/proc/{stranger.pid}/ns/net"))
        assert dismantle.namespaces() == {ids["net"]}  # its processes are the ones `local.down` would end
        assert stranger.pid in hosts.processes_in(dismantle.namespaces())
    finally:
        stranger.kill()
        stranger.wait()
