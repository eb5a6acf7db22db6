"""The network check's arithmetic, expectations, judgement and parsing (ops/actions/netcheck.py,
jobs/allreduce_check.py), on constructed results and recorded NCCL lines; no cluster."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from ops.actions import netcheck, options
from ops.finetune import sbatch as jobs
from ops.finetune import summary
from ops.finetune.joblog import JobLog
from tests.unit.test_jobs_render import inventory
from tests.unit.test_ops_nccl import EFA_RUN, SOCKET_RUN

REPO = Path(__file__).resolve().parents[2]


def program():
    spec = importlib.util.spec_from_file_location("allreduce_check", jobs.NETCHECK_PROGRAM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bus_bandwidth_is_nccl_tests_formula():
    # nccl-tests doc/PERFORMANCE.md: all-reduce busbw = algbw * 2(n-1)/n
    assert netcheck.bus_factor(2) == 1.0 and netcheck.bus_factor(8) == 1.75 and netcheck.bus_factor(1) == 0.0
    # 1 GB in 0.1 s across 8 ranks: algbw 10 GB/s = 80 Gbps, busbw 140 Gbps
    assert netcheck.busbw_gbps(10**9, 0.1, 8) == pytest.approx(140.0)
    prog = program()  # the program on the cluster computes the same
    assert [prog.bus_factor(n) for n in (1, 2, 4, 8)] == [netcheck.bus_factor(n) for n in (1, 2, 4, 8)]


def test_pairs_all_for_few_nodes_ring_neighbours_for_many():
    prog = program()
    assert prog.pairs_of(1) == [] and prog.pairs_of(2) == [(0, 1)]
    assert prog.pairs_of(3) == [(0, 1), (0, 2), (1, 2)]
    many = prog.pairs_of(10)
    assert len(many) == 10 and (0, 9) in many and (0, 2) not in many


def test_expected_figures_per_instance_type():
    g6 = netcheck.expected_for_type("g6.12xlarge", efa=True)
    assert g6.busbw_gbps == 40 and g6.transport == "EFA" and "g6.12xlarge" in g6.source
    # p5.48xlarge: the published nccl-tests figure at the largest size (64 MiB), not the 3200 Gbps instance figure.
    assert netcheck.expected_for_type("p5.48xlarge", efa=True).busbw_gbps == pytest.approx(209.19 * 8, abs=0.1)
    assert netcheck.expected_for_type("g6.12xlarge", efa=False).transport == "sockets"
    unknown = netcheck.expected_for_type("g9.huge", efa=True)
    assert unknown.busbw_gbps is None and "no network figure" in unknown.source
    data = json.loads((netcheck.DATA / "instances.json").read_text())["network"]
    assert data["date"] and data["sources"] and 0 < data["threshold"] < 1
    local = netcheck.expected(inventory(target="local", gpus=1), None)
    assert local.transport == "gloo over eth0" and local.busbw_gbps > 0
    boot = netcheck.expected(inventory(target="boot", gpus=1), None)  # figures reported, not judged
    assert boot.busbw_gbps is None and boot.transport is None


def result(pairs: dict[tuple[str, str], float], nodes=None, node_info=None) -> dict:
    nodes = nodes or sorted({n for p in pairs for n in p})
    sweep = lambda bw: [{"bytes": 4096, "time_us": 500.0, "busbw_gbps": bw / 100},  # noqa: E731
                        {"bytes": 4 << 20, "time_us": 9000.0, "busbw_gbps": bw}]
    return {"nodes": nodes, "all": sweep(min(pairs.values())), "seconds": 2.5,
            "pairs": [{"nodes": list(p), "results": sweep(bw)} for p, bw in pairs.items()],
            "node_info": node_info or {n: {"host": n, "transport": "gloo over eth0"} for n in nodes}}


EXP = netcheck.Expected(10.0, "gloo over eth0", 0.5, "test")
A, B, C = "gpu-node-01", "gpu-node-02", "gpu-node-03"


def judge(res):
    return netcheck.judge(res, EXP, netcheck.transports_of(res, "", backend_nccl=False))


def test_all_pairs_at_speed_pass():
    v = judge(result({(A, B): 9.0, (A, C): 8.0, (B, C): 6.0}))
    assert v.ok and v.healthy == [A, B, C] and not any(p.slow for p in v.pairs)
    assert v.pairs[2].fraction == pytest.approx(0.6)


def test_node_slow_with_every_peer_is_named():
    v = judge(result({(A, B): 9.0, (A, C): 1.0, (B, C): 0.8}))
    assert list(v.failed) == [C] and v.failed[C].startswith("slow:") and "1 Gbps" in v.failed[C]
    assert v.healthy == [A, B] and not v.unattributed and not v.ok


def test_a_slow_pair_alone_names_no_node():
    two = judge(result({(A, B): 1.0}))
    assert not two.failed and two.unattributed and "cannot say which node" in two.unattributed[0]
    everyone = judge(result({(A, B): 1.0, (A, C): 1.0, (B, C): 1.0}))  # the network, or the expectation
    assert not everyone.failed and len(everyone.unattributed) == 3 and not everyone.ok


def test_node_missing_its_transport_is_named():
    info = {A: {"transport": "gloo over eth0"}, B: {"transport": "gloo (host-name address)",
                                                     "missing": "interface eth0 (GLOO_SOCKET_IFNAME) is not on this node"}}
    v = judge(result({(A, B): 9.0}, node_info=info))
    assert list(v.failed) == [B] and "expected gloo over eth0" in v.failed[B] and "eth0" in v.failed[B]


def test_nccl_transport_per_node_from_its_lines():
    efa = netcheck.transports_of({"node_info": {}}, "\n".join(EFA_RUN), backend_nccl=True)
    assert efa == {"gpu-node-01": "EFA", "gpu-node-02": "EFA"}
    sock = netcheck.transports_of({"node_info": {}}, "\n".join(SOCKET_RUN), backend_nccl=True)
    assert sock == {"gpu-node-01": "sockets", "gpu-node-02": "sockets"}
    res = result({(A, B): 30.0})
    v = netcheck.judge(res, netcheck.expected_for_type("g6.12xlarge", efa=True),
                       {A: "EFA", B: "sockets"})
    assert list(v.failed) == [B] and v.failed[B] == "transport sockets, expected EFA"
    one = {"nodes": [A], "all": result({(A, B): 30.0})["all"], "pairs": []}  # one node: nothing crosses a link
    assert netcheck.judge(one, netcheck.expected_for_type("g6.12xlarge", efa=True), {A: netcheck.NO_INTER}).ok


def test_result_line_table_summary_and_json(tmp_path):
    res = result({(A, B): 9.0, (A, C): 1.0, (B, C): 0.8})
    assert netcheck.parse_result(json.dumps(res)) == res and netcheck.parse_result("{cut") is None
    v = judge(res)
    rows = netcheck.table(v)
    assert any(r.strip().startswith(f"{A} - {C}") and r.rstrip().endswith("SLOW") for r in rows), rows
    assert any(r.strip().startswith(f"{A} - {B}") and r.rstrip().endswith("ok") for r in rows), rows
    line = netcheck.summary_line(v)
    assert "slowest pair 0.8 Gbps" in line and "10 Gbps expected" in line and f"{C}: slow" in line
    path = netcheck.save(tmp_path / "network.json", v, res, "7", [C])
    saved = json.loads(path.read_text())
    assert saved["drained"] == [C] and saved["nodes"][C]["failed"] and saved["measured"] == res
    run = summary.RunSummary("8", "", {}, [], summary.nccl.parse([]), network=line)
    assert f"  network       {line}" in run.lines()
    assert not any(r.startswith("  network") for r in summary.build("8", "", JobLog(), None).lines())


def test_rendered_check_runs_the_program_with_the_targets_backend():
    aws = jobs.render_netcheck(jobs.base_spec(inventory(), jobs.NETCHECK_NAME, 2, 4, "/scratch/c",
                                              time_limit="00:03:00"), (8192, 1 << 20), 0.3, None)
    assert "backend=nccl" in aws and "NCCL_DEBUG=INFO" in aws and "GLOO_SOCKET_IFNAME" not in aws
    assert "'/scratch/c'/allreduce_check.py" in aws and "--sizes 8192,1048576" in aws
    assert "#SBATCH --time=00:03:00" in aws
    local = jobs.render_netcheck(jobs.base_spec(inventory(target="local", gpus=1), jobs.NETCHECK_NAME, 3, 1,
                                                "/scratch/c", time_limit="00:03:00"), (4096,), 0.3, "eth0")
    assert "backend=gloo" in local and "export GLOO_SOCKET_IFNAME=eth0" in local and "NCCL" not in local


def test_healthy_only_with_skip_check_is_refused_before_any_host():
    with pytest.raises(options.OptionError, match="--healthy-only .* --skip-check"):
        options.parse(target="local", skip_check=True, healthy_only=True)
    o = options.parse(target="local", healthy_only=True)
    assert o.healthy_only and not o.skip_check
    res = subprocess.run([str(REPO / ".venv/bin/fab"), "train", "--target", "local", "--skip-check",
                          "--healthy-only"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 1 and "--healthy-only goes on" in res.stderr and "Traceback" not in res.stderr


def test_a_failed_checks_message_shows_where_the_failure_began_and_how_it_ended():
    from ops.actions.netcheck import log_excerpt

    log = ["0: starting", "1: RuntimeError: Connection refused by 10.0.0.2", *[f"1: noise {i}" for i in range(40)],
           *[f"0: Traceback line {i}" for i in range(15)]]
    text = log_excerpt("\n".join(log), "/scratch/logs/x.out")
    assert text.index("first error lines of /scratch/logs/x.out") < text.index("RuntimeError: Connection refused")
    assert "last lines of /scratch/logs/x.out" in text and "0: Traceback line 14" in text
    assert "noise 3" not in text
    assert "first error" not in log_excerpt("a\nb", "p")  # nothing that looks like an error: the tail only


# ------------------------------------------------- per-size expectations (published nccl-tests)

def pair_sweep(sizes_gbps: dict[int, float]) -> dict:
    """Two p5.48xlarge nodes measured at the GPU sizes (bytes -> bus bandwidth in Gbps)."""
    results = [{"bytes": size, "time_us": 100.0, "busbw_gbps": bw} for size, bw in sizes_gbps.items()]
    return {"nodes": [A, B], "all": results, "seconds": 3.0, "pairs": [{"nodes": [A, B], "results": results}],
            "node_info": {}}


def test_published_nccl_tests_figures_are_data_with_their_source():
    net = json.loads((netcheck.DATA / "instances.json").read_text())["network"]
    for itype in ("p5.48xlarge", "p4d.24xlarge"):
        pub = net["nccl_tests"][itype]
        assert "awsome-distributed-training" in pub["source"]
        # aws-samples/awsome-distributed-training micro-benchmarks/nccl-tests/README.md, 2 nodes: busbw GB/s.
        assert len(pub["busbw_GBps"]) >= 20
    assert net["nccl_tests"]["p5.48xlarge"]["busbw_GBps"][str(64 << 20)] == 209.19
    assert "g6.12xlarge" in net["unpublished"]
    p5 = netcheck.expected_for_type("p5.48xlarge", efa=True)
    assert p5.cards == 32 and p5.at(64 << 20) == pytest.approx(209.19 * 8)
    assert p5.at(1 << 20) == pytest.approx(15.95 * 8) and p5.at(8 << 10) == pytest.approx(0.19 * 8)
    # Between two published sizes: on the log-log line through them.
    assert 15.95 * 8 < p5.at(3 << 19) < 26.70 * 8
    assert "per network card of 32" in p5.source
    # No published figure (G types), or no EFA: a conservative share of the instance bandwidth, largest size only.
    g6 = netcheck.expected_for_type("g6.12xlarge", efa=True)
    assert not g6.curve and g6.busbw_gbps == 40 and g6.threshold == net["unpublished_threshold"] < net["threshold"]
    assert "no published nccl-tests figure" in g6.source
    assert not netcheck.expected_for_type("p5.48xlarge", efa=False).curve


def test_a_healthy_p5_pair_passes_at_every_size():
    """About 90% of the published figure at each size: 1500 Gbps at 64 MiB is under half of the
    instance's 3200 Gbps, which a single figure would have called slow."""
    exp = netcheck.expected_for_type("p5.48xlarge", efa=True)
    healthy = pair_sweep({8 << 10: 1.4, 1 << 20: 115.0, 64 << 20: 1500.0})
    v = netcheck.judge(healthy, exp, {A: "EFA", B: "EFA"})
    assert v.ok, v.problems()
    assert not v.pairs[0].slow and v.pairs[0].fraction == pytest.approx(1500 / (209.19 * 8))  # its worst size


def test_a_p5_pair_slow_only_at_a_latency_bound_size_passes():
    """8 KiB is latency-bound (about 81 us per op published with NCCL 2.27.7): a healthy pair on another
    NCCL or with less warm-up may take twice that, so sizes under judged_from_bytes are not judged."""
    exp = netcheck.expected_for_type("p5.48xlarge", efa=True)
    assert netcheck.judged_from() == 1 << 20
    v = netcheck.judge(pair_sweep({8 << 10: 0.5, 1 << 20: 115.0, 64 << 20: 1500.0}), exp, {A: "EFA", B: "EFA"})
    assert v.ok, v.problems()
    assert v.pairs[0].fraction == pytest.approx(1500 / (209.19 * 8))


def test_a_truly_slow_p5_pair_fails_at_the_size_it_is_slow_at():
    exp = netcheck.expected_for_type("p5.48xlarge", efa=True)
    links = {A: "EFA", B: "EFA"}
    # Everything slow (one EFA card's worth, say): fails.
    slow = netcheck.judge(pair_sweep({8 << 10: 1.4, 1 << 20: 20.0, 64 << 20: 400.0}), exp, links)
    assert not slow.ok and slow.pairs[0].slow
    # Full speed at 64 MiB but a fifth of it at 1 MiB: a size the old single figure never looked at.
    mid = netcheck.judge(pair_sweep({8 << 10: 1.4, 1 << 20: 25.0, 64 << 20: 1700.0}), exp, links)
    assert not mid.ok and mid.pairs[0].slow and "pair gpu-node-01-gpu-node-02 slow" in mid.problems()
