"""All-reduce check of every node, started by torchrun on each node (jobs/netcheck.sbatch.j2).

The same torch.distributed the fine-tune uses (NCCL on GPUs, gloo on CPU) all-reduces a few
message sizes across all ranks, then across the ranks of each pair of nodes, and rank 0 writes
the result as JSON to --out (on the shared scratch) for `fab` (ops/actions/netcheck.py), and a short
`SLURM_GPU_NETCHECK` line to the log (srun -l cuts long lines). Imports only torch and
the standard library: it runs from the job directory, before any training code.

Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md, "Bus bandwidth"): an all-reduce of S bytes
in t seconds has algbw = S / t and busbw = algbw * 2 (n - 1) / n, which compares with a link's speed
whatever the rank count. Every figure is the slowest rank's: a collective is as slow as it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from itertools import combinations
from pathlib import Path

import torch
import torch.distributed as dist

TAG = "SLURM_GPU_NETCHECK"
MAX_ALL_PAIRS = 6  # nodes; above this only ring neighbours are paired (n pairs, not n(n-1)/2)


def bus_factor(n: int) -> float:
    return 2 * (n - 1) / n if n > 1 else 0.0


def pairs_of(n: int) -> list[tuple[int, int]]:
    if n < 2:
        return []
    if n <= MAX_ALL_PAIRS:
        return list(combinations(range(n), 2))
    return sorted({tuple(sorted((i, (i + 1) % n))) for i in range(n)})


def transport(backend: str) -> dict:
    """What this node's traffic goes over, as far as the node itself can tell before the group forms.

    gloo: the interface GLOO_SOCKET_IFNAME names; when this node lacks it, gloo is told to fall back
    to the host name's address (unset), as NCCL falls back to sockets without EFA, and that is said.
    NCCL: the EFA devices present (/sys/class/infiniband); NCCL's own choice is in its INFO lines.
    """
    if backend == "gloo":
        want = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if not want:
            return {"transport": "gloo (host-name address)", "interface": None}
        # The interfaces of this process's own network namespace (sysfs may show another's).
        if want in {name for _, name in socket.if_nameindex()}:
            return {"transport": f"gloo over {want}", "interface": want}
        os.environ.pop("GLOO_SOCKET_IFNAME")
        return {"transport": "gloo (host-name address)", "interface": None,
                "missing": f"interface {want} (GLOO_SOCKET_IFNAME) is not on this node"}
    ib = Path("/sys/class/infiniband")
    devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    return {"transport": "nccl", "rdma_devices": devices}


def measure(t: torch.Tensor, group, n: int, budget_s: float, max_iters: int, sync) -> dict:
    """One message size on `group`: warm up, agree on an iteration count that fits the budget, time it."""
    dist.all_reduce(t, group=group)  # connections are built on the first use
    sync()
    t0 = time.perf_counter()
    dist.all_reduce(t, group=group)
    sync()
    probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=t.device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)  # every rank picks the same count
    iters = max(1, min(max_iters, int(budget_s / max(float(probe.item()), 1e-6))))
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    sync()
    took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=t.device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    seconds = float(took.item())
    nbytes = t.numel() * t.element_size()
    algbw = nbytes / seconds
    return {"bytes": nbytes, "iters": iters, "time_us": round(seconds * 1e6, 1),
            "algbw_gbps": round(algbw * 8 / 1e9, 4), "busbw_gbps": round(algbw * bus_factor(n) * 8 / 1e9, 4)}


def sweep(sizes: list[int], group, n: int, device, budget_s: float, max_iters: int, sync) -> list[dict]:
    return [measure(torch.ones(max(1, size // 4), dtype=torch.float32, device=device), group, n,
                    budget_s, max_iters, sync) for size in sizes]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    ap.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    ap.add_argument("--budget-s", type=float, default=0.5, help="seconds of timed iterations per size")
    ap.add_argument("--max-iters", type=int, default=50)
    ap.add_argument("--out", required=True, help="where rank 0 writes the result (JSON)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.time()
    host = socket.gethostname()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    info = {"host": host, **transport(args.backend)}
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)

        def sync():
            torch.cuda.synchronize()
    else:
        device = torch.device("cpu")

        def sync():
            pass
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    infos: list[dict] = [{}] * world
    dist.all_gather_object(infos, info)
    hosts = list(dict.fromkeys(i["host"] for i in infos))  # node order = rank order
    ranks_of = {h: [r for r, i in enumerate(infos) if i["host"] == h] for h in hosts}

    result = {"world": world, "backend": args.backend, "nodes": hosts,
              "ranks_per_node": {h: len(r) for h, r in ranks_of.items()},
              "node_info": {h: infos[ranks_of[h][0]] for h in hosts}}
    result["all"] = sweep(sizes, None, world, device, args.budget_s, args.max_iters, sync)
    pairs = []
    for a, b in pairs_of(len(hosts)):
        members = ranks_of[hosts[a]] + ranks_of[hosts[b]]
        if len(hosts) == 2:  # the one pair is everyone: its figures are the ones above
            pairs.append({"nodes": [hosts[a], hosts[b]], "results": result["all"]})
            continue
        group = dist.new_group(members)  # every rank takes part in making every group
        if rank in members:
            res = sweep(sizes, group, len(members), device, args.budget_s, args.max_iters, sync)
            pairs.append({"nodes": [hosts[a], hosts[b]], "results": res})
        dist.barrier()  # one pair at a time: pairs sharing the bridge or a switch must not overlap
    # Rank 0 is on the first node: it was in every pair of that node only; gather the others' pairs.
    gathered: list[list] = [[]] * world
    dist.all_gather_object(gathered, pairs if local_rank == 0 else [])
    seen, result["pairs"] = set(), []
    for lst in gathered:
        for p in lst:
            if tuple(p["nodes"]) not in seen:
                seen.add(tuple(p["nodes"]))
                result["pairs"].append(p)
    result["pairs"].sort(key=lambda p: (hosts.index(p["nodes"][0]), hosts.index(p["nodes"][1])))
    result["seconds"] = round(time.time() - started, 2)
    if rank == 0:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        tmp.replace(args.out)
        big = max(result["all"], key=lambda r: r["bytes"])
        print(f"{TAG} {world} ranks on {len(hosts)} node(s): {big['busbw_gbps']} Gbps bus bandwidth at "
              f"{big['bytes']} bytes, {len(result['pairs'])} pair(s), {result['seconds']} s; {args.out}", flush=True)
    leave(args.backend, local_rank)


def leave(backend: str, local_rank: int) -> None:
    """End the rank once every rank is past its last collective.

    gloo: without destroying the group. Destroying it can deadlock: the gloo group's destructor joins
    its worker threads while holding the GIL, and a worker still letting go of the last collective's
    tensor waits for the GIL. The boot test saw it on Debian 13's torch 2.6 (gdb: the main thread in
    ~ProcessGroupGloo's thread join, a runLoop thread in TensorImpl's Python-object release). The
    result is written; the process's exit closes the sockets.
    NCCL: destroyed as NCCL asks, so that no rank exits while its last sends to a peer are still in
    NCCL's proxy thread (ProcessGroupNCCL's warning; NCCL's guide, "Finalizing a communicator").
    """
    if backend == "nccl":
        dist.barrier(device_ids=[local_rank])
        dist.destroy_process_group()
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
