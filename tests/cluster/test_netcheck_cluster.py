"""The network check on the real local cluster (3 GPU hosts x 1 rank, gloo over the bridge).

- `fab check` across every node passes: every pair within the expected figure, every node's
  ranks on the interface the target names, runs/<job>/network.json and the timeline kept;
- a node made slow with `tc` (a token-bucket filter on both ends of its veth pair: its traffic
  stays on our own bridge) makes `fab train` stop before submitting: the node is named slow and
  drained with the reason; with --healthy-only the fine-tune runs on the two others;
- a node without its transport is named. The local stand-in for "no EFA device, NCCL fell back
  to sockets": the node's eth0 (GLOO_SOCKET_IFNAME on this target) is renamed, so the check's
  ranks there fall back to the host name's address, as NCCL falls back to sockets; the traffic
  still flows, and the check names the node for the fallback, not for speed.
Every change to a host's network is undone in `finally`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from localcluster import topology as layout
from ops.ssh import remote
from tests.support.local_cluster import fresh_cluster, run

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
SLOW, SLOW_INDEX = "gpu-node-03", 3
BARE = "gpu-node-02"
TBF = ["tbf", "rate", "40mbit", "burst", "64kb", "latency", "400ms"]


@pytest.fixture(scope="module")
def lc(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    with fresh_cluster(nodes=3, gpus=1) as (inv, job_dirs):
        cl = remote.connect(inv)
        try:
            yield inv, cl, runs
        finally:
            cl.close()


def fab(runs: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs)}
    return subprocess.run([FAB, *args, "--target", "local"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=400)


def sinfo(ctl) -> dict[str, tuple[str, str]]:
    out = run(ctl, "sinfo -h -N -o '%N|%T|%E'").stdout
    rows = (line.split("|", 2) for line in out.splitlines() if line.strip())
    return {n: (state, reason) for n, state, reason in rows}


def newest_network_json(runs: Path) -> dict:
    files = sorted(runs.glob("*/network.json"), key=lambda p: p.stat().st_mtime)
    assert files, f"no network.json under {runs}"
    return {**json.loads(files[-1].read_text()), "dir": files[-1].parent}


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def test_check_passes_across_every_node(lc):
    inv, cl, runs = lc
    res = fab(runs, "check")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    nodes = [n.name for n in inv.gpu_nodes]
    for a, b in (("gpu-node-01", "gpu-node-02"), ("gpu-node-01", "gpu-node-03"), ("gpu-node-02", "gpu-node-03")):
        assert any(line.strip().startswith(f"{a} - {b}") and line.rstrip().endswith("ok")
                   for line in out.splitlines()), out
    net = newest_network_json(runs)
    assert net["ok"] and not net["drained"], net
    assert sorted(net["nodes"]) == nodes
    assert all(v["transport"] == "gloo over eth0" for v in net["nodes"].values()), net["nodes"]
    assert len(net["pairs"]) == 3 and all(p["fraction"] >= net["expected"]["threshold"] for p in net["pairs"])
    tl = json.loads(next(runs.glob(f"{net['job_id']}*/timeline.json")).read_text())
    assert [p["key"] for p in tl["phases"] if p["key"] == "network"] == ["network"]
    print("\n".join(line for line in out.splitlines() if " - " in line or "all ranks" in line))


def test_slow_node_is_named_and_drained_and_train_stops_or_goes_on_without_it(lc):
    inv, cl, runs = lc
    veth, ns = layout.veth_name(SLOW_INDEX), layout.netns_name(SLOW)
    sh("tc", "qdisc", "add", "dev", veth, "root", *TBF)
    try:
        sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *TBF)
        res = fab(runs, "train")
        stopped = sinfo(cl.controller)[SLOW], run(cl.controller, "squeue -h -o %j").stdout
        on = fab(runs, "train", "--healthy-only")
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True)
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert f"{SLOW}: slow" in out and "Nothing was submitted" in out, out
    (state, reason), queue = stopped
    assert "drain" in state and reason.startswith("network check: slow"), (state, reason)
    assert "slurm-gpu-finetune" not in queue
    out = on.stdout + on.stderr
    assert on.returncode == 0, out
    assert "--healthy-only: training on 2 of the 2 node(s) that passed (gpu-node-01, gpu-node-02)" in out, out
    assert re.search(r"^\s+network\s+slowest pair .* failed: gpu-node-03: slow", out, re.M), out
    net = newest_network_json(runs)
    assert net["drained"] == [SLOW] and (net["dir"] / "metrics.json").exists()  # kept with the training run
    assert "drain" in sinfo(cl.controller)[SLOW][0]
    assert "qdisc tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", veth], capture_output=True,
                                             text=True).stdout


def test_node_without_its_transport_is_named(lc):
    inv, cl, runs = lc
    ns = layout.netns_name(BARE)
    addr = next(n.private_ip for n in inv.gpu_nodes if n.name == BARE)

    def rename(old: str, new: str) -> None:
        sh("ip", "-n", ns, "link", "set", "dev", old, "down")
        sh("ip", "-n", ns, "link", "set", "dev", old, "name", new)
        sh("ip", "-n", ns, "link", "set", "dev", new, "up")
        subprocess.run(["ip", "-n", ns, "route", "replace", "default", "via", layout.BRIDGE_IP],
                       capture_output=True)

    rename("eth0", "sgx0")
    try:
        res = fab(runs, "check")  # also returns the slow node of the test before to service
    finally:
        rename("sgx0", "eth0")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    line = next((line for line in out.splitlines() if line.strip().startswith(BARE) and "transport" in line), "")
    assert "FAILED" in line and "eth0" in line and "expected gloo over eth0" in line, out
    net = newest_network_json(runs)
    assert net["drained"] == [BARE] and net["nodes"][SLOW]["failed"] is None, net
    assert "inet " + addr in subprocess.run(["ip", "-n", ns, "-4", "addr", "show", "dev", "eth0"],
                                            capture_output=True, text=True).stdout
