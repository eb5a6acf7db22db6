"""The local cluster, for real: namespaces on sgpu0 running munged, sshd, slurmctld
and slurmd from the rendered bootstrap/ files, reached over ssh with Fabric the
way `fab train` reaches it (controller direct, GPU hosts through it).

The module brings one cluster up (2 GPU hosts, fresh per-host munge keys as on a
new AWS node) and runs its tests in order: key mismatch, key distribution,
Slurm, idempotent `up`, `down` leaving nothing, and a failed `up` cleaning up.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from bootstrap import node_layout, render, user_data
from localcluster import hosts, netns, state
from localcluster import lifecycle as cluster
from localcluster import topology as layout
from ops.actions import munge
from ops.ssh import remote
from ops.ssh.remote import WholeInput
from tests.support.local_cluster import fresh_cluster, run, wait_for

NODES, GPUS = 2, 2
NODE_NAMES = ["gpu-node-01", "gpu-node-02"]


@pytest.fixture(scope="module")
def lc():
    """The running cluster: (inventory, controller Connection, {name: node Connection})."""
    with fresh_cluster(nodes=NODES, gpus=GPUS, fresh_keys=True) as (inventory, _):
        conns = remote.connect(inventory)
        yield inventory, conns.controller, conns.nodes
        conns.close()


def sinfo_nodes(controller) -> dict[str, tuple[str, str]]:
    out = run(controller, "sinfo -h -N -o '%N %T %G'").stdout
    return {n: (state, gres) for n, state, gres in (line.split() for line in out.splitlines())}


# ------------------------------------------------------------------ options (no root needed)










# ------------------------------------------------------------------ the cluster


@pytest.mark.cluster
def test_hosts_have_own_names_and_the_inventory_describes_them(lc):
    inventory, controller, nodes = lc
    assert inventory.target == "local" and inventory.ssh_user == "root"
    assert [n.name for n in inventory.gpu_nodes] == NODE_NAMES
    assert run(controller, "hostname").stdout.strip() == "controller"
    for name, c in nodes.items():
        assert run(c, "hostname").stdout.strip() == name
        # Each host sees its own stand-in GPU files; slurmd runs configless: no local slurm.conf.
        run(c, f"test -f {layout.GPU_DEVICE_PREFIX}{GPUS - 1}")
        run(c, f"test ! -e {node_layout.SLURM_CONF}")


@pytest.mark.cluster
def test_names_come_from_etc_hosts_and_no_dns_query_leaves_the_cluster(lc):
    """The bridge reaches no nameserver: a host using the machine's resolv.conf sent its DNS queries
    off the cluster's network and waited 10 s for each (torchrun's rendezvous made several a job)."""
    _, controller, nodes = lc
    for c in (controller, *nodes.values()):
        conf = run(c, "cat /etc/resolv.conf").stdout.splitlines()
        servers = [line.split()[1] for line in conf if line.startswith("nameserver")]
        assert servers == ["127.0.0.1"], conf
    peers = {"controller": "10.213.0.10", "gpu-node-02": "10.213.0.12"}
    for name, ip in peers.items():
        assert run(nodes["gpu-node-01"], f"getent ahostsv4 {name}").stdout.split()[0] == ip


@pytest.mark.cluster
def test_password_login_is_refused(lc):
    r = subprocess.run(
        ["ssh", "-o", "BatchMode=yes", "-o", "PubkeyAuthentication=no", "-o", "ConnectTimeout=5",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         f"root@{lc[0].controller.private_ip}", "true"], capture_output=True, text=True)
    assert r.returncode == 255 and "Permission denied" in r.stderr


@pytest.mark.cluster
def test_fresh_gpu_hosts_cannot_decode_the_controllers_credential(lc):
    _, controller, nodes = lc
    credential = munge.make_credential(controller)
    for name, c in nodes.items():
        ok, status = munge.decodes(c, credential)
        assert not ok, f"{name} decoded a credential with its own key"
        assert "Invalid credential" in status
        # ...and its own munged works: the keys differ, not the daemon.
        run(c, "munge -n | unmunge")
    # Nodes are not usable by Slurm yet, and each marks its node-local key (slurmd's drop-in
    # keeps a systemd slurmd off while the mark is there).
    assert all(state != "idle" for state, _ in sinfo_nodes(controller).values())
    for name, c in nodes.items():
        assert run(c, f"test -e {node_layout.NODE_LOCAL_KEY_MARKER} && echo marked").stdout.strip() == "marked", name


@pytest.mark.cluster
def test_key_distribution_then_rerun_skips(lc):
    inventory, controller, nodes = lc
    first = munge.distribute_key(controller, nodes, inventory.service_cmd)
    assert sorted(first.installed) == NODE_NAMES and first.skipped == []
    for name, c in nodes.items():
        ok, status = munge.decodes(c, munge.make_credential(controller))
        assert ok, f"{name}: {status}"
        assert run(c, "stat -c '%U:%G %a' /etc/munge /etc/munge/munge.key").stdout.split() \
            == ["munge:munge", "700", "munge:munge", "400"]
        # The cluster's key is in: the node-local key's mark is gone, so slurmd may start.
        assert run(c, f"test -e {node_layout.NODE_LOCAL_KEY_MARKER} || echo gone").stdout.strip() == "gone", name
    # The other direction too: a node's credential decodes on the controller.
    cred = run(nodes[NODE_NAMES[0]], "munge -n").stdout
    assert "ENCODE_HOST:" in run(controller, "unmunge", in_stream=WholeInput(cred)).stdout
    again = munge.distribute_key(controller, nodes, inventory.service_cmd)
    assert again.installed == [] and sorted(again.skipped) == NODE_NAMES


@pytest.mark.cluster
def test_every_node_goes_idle_with_its_gpus(lc):
    inventory, controller, nodes = lc
    # What `fab train` does after the key: restart slurmd, let the nodes register.
    for c in nodes.values():
        run(c, inventory.service_cmd.format(action="restart", service="slurmd"))
    table = wait_for(lambda: (t := sinfo_nodes(controller)) and
                     all(t.get(n, ("",))[0] == "idle" for n in NODE_NAMES) and t)
    assert table, f"nodes not idle: {sinfo_nodes(controller)}"
    assert {n: table[n] for n in NODE_NAMES} == {n: ("idle", f"gpu:sim:{GPUS}") for n in NODE_NAMES}
    # Configless: each slurmd fetched the controller's slurm.conf and gres.conf into its cache,
    # and client commands on the node read them there.
    for c in nodes.values():
        for conf in ("slurm.conf", "gres.conf"):
            assert run(c, f"cat /run/slurm/conf/{conf}").stdout == (layout.ETC_SLURM / conf).read_text()
        assert "gpu-node-01" in run(c, "sinfo -h -N -o %N").stdout


@pytest.mark.cluster
def test_srun_answers_from_every_host(lc):
    _, controller, _ = lc
    out = run(controller, f"srun -N{NODES} -t 1 hostname", timeout=60).stdout.split()
    assert sorted(out) == NODE_NAMES


@pytest.mark.cluster
def test_status_shows_hosts_and_node_table(lc):
    lines: list[str] = []
    assert cluster.status(out=lines.append)
    text = "\n".join(lines)
    for name, ip in [("controller", "10.213.0.10"), *zip(NODE_NAMES, ["10.213.0.11", "10.213.0.12"], strict=False)]:
        assert any(ln.split()[:3] == [name, ip, "up"] for ln in lines if ln.strip()), text
    assert sum("idle" in ln and f"gpu:sim:{GPUS}" in ln for ln in lines) == NODES, text


@pytest.mark.cluster
def test_up_again_is_a_no_op_and_another_size_is_refused(lc):
    before = [h.pid for h in state.load().hosts]
    messages: list[str] = []
    cluster.up(nodes=NODES, gpus=GPUS, out=messages.append)
    assert "already up" in messages[0]
    assert [h.pid for h in state.load().hosts] == before
    with pytest.raises(cluster.ClusterError, match="fab local.down"):
        cluster.up(nodes=NODES + 1, gpus=GPUS, out=lambda _m: None)
    assert [h.pid for h in state.load().hosts] == before


def assert_nothing_left(ns_ids: set[str]) -> None:
    assert netns.our_netns() == []
    assert not netns.link_exists(layout.BRIDGE)
    assert netns.our_veths() == []
    assert [p for p in hosts.processes_in(ns_ids) if hosts.alive(p)] == []
    # Live daemons only: zombies (state Z) are already dead, waiting for PID 1 to reap them.
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    daemons = [ln for ln in ps.splitlines() if not ln.lstrip().startswith("Z") and
               re.search(r"munged|slurmctld|slurmd|sshd -f /var/lib/slurm-gpu-local", ln)]
    assert daemons == [], daemons
    mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET,SOURCE"], capture_output=True, text=True).stdout
    assert "slurm-gpu-local" not in mounts and "sgpu-" not in mounts, mounts
    assert not layout.STATE_FILE.exists() and not layout.INVENTORY.exists()


@pytest.mark.cluster
def test_down_leaves_nothing(lc):
    ns_ids = {i for h in state.load().hosts for i in h.ns}
    assert hosts.processes_in(ns_ids)  # the test would be vacuous otherwise
    cluster.down(out=lambda _m: None)
    assert_nothing_left(ns_ids)
    cluster.down(out=lambda _m: None)  # a second down is harmless


@pytest.mark.cluster
def test_failed_up_cleans_up(lc, monkeypatch):
    # A bootstrap script that fails on the GPU hosts, after the controller is made.
    real = render.render_bootstrap_script

    def failing(facts, role, hostname, version):
        text = real(facts, role, hostname, version)
        return text if role == "controller" else "#!/bin/bash\necho 'no GPUs here' >&2\nexit 7\n"

    monkeypatch.setattr(user_data, "render_bootstrap_script", failing)
    with pytest.raises(hosts.HostSetupError, match="gpu-node-0[12].*no GPUs here"):
        cluster.up(nodes=NODES, gpus=GPUS, fresh_keys=True, out=lambda _m: None)
    assert_nothing_left(set())
