"""The network check (`fab check`, and a step of `fab train`): all-reduce across every node, then
per node pair, measured against what the nodes' instance type should give.

jobs/allreduce_check.py measures (bus bandwidth as nccl-tests defines it, latency); this module
says what was expected, judges, names and drains the nodes that fail, and keeps the result
(runs/<job>/network.json). A node is failed when it misses its transport (NCCL on sockets where
EFA was expected; on the local cluster, gloo's interface missing), or when every pair it is in
runs below THRESHOLD of the expected bus bandwidth: a pair cannot say which of its two nodes is
slow, a node slow with every peer can. Two slow-paired nodes alone (a two-node cluster) are
named, not drained.

What a pair should reach, per message size: bus bandwidth rises with the size (a 1 MiB all-reduce
moves a tenth of what a 64 MiB one does on p5.48xlarge), so where nccl-tests all_reduce_perf figures
are published for the type over EFA (ops/data/instances.json network.nccl_tests, with the source:
aws-samples/awsome-distributed-training's 2-node p5.48xlarge and p4de.24xlarge runs) each measured
size is judged against the published figure at that size. Those runs use every network card of the
type (32 on p5.48xlarge, 4 on p4d: one EFA interface each, as the stack attaches them); the table
shows the bandwidth per card too. Elsewhere (G types, none published; or no EFA) only the largest
size is judged, against a conservative share of the type's published network bandwidth.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import re
import shlex
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster import targets
from cluster.errors import UserError
from cluster.inventory import Inventory
from ops.actions import nccl, node_power, slurm
from ops.finetune import runs, timeline
from ops.finetune import sbatch as jobs
from ops.ssh.remote import Cluster, put_bytes, put_text, read_remote, sudo

DATA = Path(__file__).resolve().parents[1] / "data"  # ops/data/
# Message sizes: one small (latency), one mid, one large (bandwidth; its busbw is judged). GPUs get
# nccl-tests-like sizes; the local CPU cluster, sizes its 2-core machine moves in well under a second.
GPU_SIZES = (8 << 10, 1 << 20, 64 << 20)
CPU_SIZES = (4 << 10, 256 << 10, 4 << 20)
BUDGET_S = 0.3  # timed seconds per size and group (warm-up aside)
TIME_LIMIT = "00:03:00"  # Slurm ends a hung check; fab waits a little longer
WAIT_S = 240


class NetCheckError(UserError, RuntimeError):
    pass


# ---------------------------------------------------------------- what to expect


@dataclass(frozen=True)
class Expected:
    busbw_gbps: float | None  # between two nodes; None: nothing to compare with
    transport: str | None  # what each node's traffic should go over ("EFA", "sockets", "gloo over eth0")
    threshold: float  # a pair below threshold * busbw_gbps is slow
    source: str  # where the figure comes from, for the table and network.json
    # Published nccl-tests bus bandwidth per message size ((bytes, Gbps), ascending): each measured
    # size is judged against it (busbw_gbps is then the figure at GPU_SIZES' largest). (): one figure.
    curve: tuple[tuple[int, float], ...] = ()
    cards: int = 1  # network cards the figure spans (the nodes' EFA interfaces, one a card)

    def at(self, nbytes: int) -> float | None:
        """The expected bus bandwidth at this message size: the published curve, interpolated
        log-log between its sizes (clamped at its ends); else the one figure."""
        if not self.curve:
            return self.busbw_gbps
        sizes = [s for s, _ in self.curve]
        if nbytes <= sizes[0]:
            return self.curve[0][1]
        if nbytes >= sizes[-1]:
            return self.curve[-1][1]
        i = bisect.bisect_right(sizes, nbytes)
        (s0, g0), (s1, g1) = self.curve[i - 1], self.curve[i]
        t = math.log(nbytes / s0) / math.log(s1 / s0)
        return math.exp(math.log(g0) + t * (math.log(g1) - math.log(g0)))


def _data(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def threshold() -> float:
    return float(_data("instances.json")["network"]["threshold"])


def expected_for_type(itype: str | None, efa: bool) -> Expected:
    """AWS: the type's published nccl-tests curve over EFA, else a conservative share of its published
    network bandwidth (ops/data/instances.json, module docstring)."""
    net = _data("instances.json")
    facts = net["types"].get(itype or "")
    transport = "EFA" if efa else "sockets"
    if not facts:
        return Expected(None, transport, threshold(),
                        f"{itype or 'unknown type'}: no network figure in ops/data/instances.json")
    cards = int(facts.get("network_cards", 1))
    published = net["network"].get("nccl_tests", {}).get(itype or "")
    if efa and published:
        curve = tuple(sorted((int(size), float(gbytes) * 8) for size, gbytes in published["busbw_GBps"].items()))
        exp = Expected(None, transport, threshold(), "", curve, cards)
        at_largest = exp.at(max(GPU_SIZES))
        per_card = f", {at_largest / cards:.3g} per network card of {cards}" if cards > 1 else ""
        return dataclasses.replace(
            exp, busbw_gbps=round(at_largest, 1),
            source=f"{itype}: nccl-tests all_reduce_perf over EFA, {at_largest:.4g} Gbps at "
                   f"{_size(max(GPU_SIZES))}{per_card}, judged per size ({published['source'].split(' ')[0]})")
    share = float(net["network"]["unpublished_threshold"])
    why = "no EFA" if published else "no published nccl-tests figure"
    return Expected(float(facts["network_gbps"]), transport, share,
                    f"{itype}: {facts['network_gbps']} Gbps published ({net['network']['date']}); {why}: "
                    f"the largest size judged at {share:.0%} of it", (), cards)


def expected_local(gloo_ifname: str | None) -> Expected:
    """The local cluster: its bridge's figure measured on the CI machine (ops/data/local.json)."""
    net = _data("local.json")["network"]
    transport = f"gloo over {gloo_ifname}" if gloo_ifname else None
    return Expected(float(net["busbw_gbps"]), transport, threshold(),
                    f"local bridge: {net['busbw_gbps']} Gbps measured ({net['source']})")


def expected(inv: Inventory, stack: str | None) -> Expected:
    target = targets.of(inv)
    if not target.real_gpus:
        if target.measured_network:
            return expected_local(target.gloo_ifname)
        return Expected(None, None, threshold(), f"no expected figure for {target.describe}")
    from ops.cost import estimate

    try:
        itype = estimate.stack_settings(stack).settings.gpu_instance_type
    except estimate.EstimateError:
        itype = None
    return expected_for_type(itype, target.expects_efa(inv))


# ---------------------------------------------------------------- judging


def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor: busbw = algbw * 2 (n - 1) / n."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def busbw_gbps(nbytes: int, seconds: float, ranks: int) -> float:
    return nbytes / seconds * bus_factor(ranks) * 8 / 1e9


@dataclass
class PairVerdict:
    nodes: tuple[str, str]
    busbw_gbps: float  # at the largest size
    latency_us: float  # the smallest size's time
    fraction: float | None  # of the expected busbw
    slow: bool


@dataclass
class Verdict:
    expected: Expected
    nodes: list[str]
    transports: dict[str, str]
    pairs: list[PairVerdict]
    all_busbw_gbps: float | None
    all_latency_us: float | None
    failed: dict[str, str] = field(default_factory=dict)  # node -> reason (drained)
    unattributed: list[str] = field(default_factory=list)  # slow pairs no single node explains
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.unattributed

    @property
    def healthy(self) -> list[str]:
        return [n for n in self.nodes if n not in self.failed]

    def problems(self) -> str:
        parts = [f"{n}: {why}" for n, why in self.failed.items()] + self.unattributed
        return "; ".join(parts)


def transports_of(result: dict, log_text: str, backend_nccl: bool) -> dict[str, str]:
    """Each node's transport: gloo's interface as the node reported it; NCCL's choice from its INFO lines."""
    out = {}
    for host, info in result.get("node_info", {}).items():
        out[host] = info.get("transport", "?")
        if info.get("missing"):
            out[host] += f" ({info['missing']})"
    if backend_nccl:
        for host, pic in nccl_by_host(log_text).items():
            out[host] = describe_nccl(pic)
    return out


_NCCL_HOST = re.compile(r"^(?:\d+: )?(?P<host>[\w.-]+):\d+:\d+ \[\d+\] NCCL INFO")


def nccl_by_host(log_text: str) -> dict[str, nccl.NcclPicture]:
    lines: dict[str, list[str]] = {}
    for line in log_text.splitlines():
        if m := _NCCL_HOST.search(line):
            lines.setdefault(m["host"], []).append(line)
    return {h: nccl.parse(ls) for h, ls in lines.items()}


NO_INTER = "no inter-node links"


def describe_nccl(pic: nccl.NcclPicture) -> str:
    """'EFA' (the OFI plugin with provider efa), 'sockets' (NET/Socket), or what NCCL said."""
    inter = set(pic.inter)
    if "efa" in pic.providers or any(f.startswith(("NET/Libfabric", "NET/AWS", "NET/OFI")) for f in inter):
        return "EFA"
    if "NET/Socket" in inter or any("Socket" in n for n in pic.networks):
        return "sockets"
    return NO_INTER if not inter else ", ".join(sorted(inter))


def _largest(results: list[dict]) -> dict:
    return max(results, key=lambda r: r["bytes"])


def _smallest(results: list[dict]) -> dict:
    return min(results, key=lambda r: r["bytes"])


def judged_from() -> int:
    """The smallest message size judged against a published curve (instances.json network.judged_from_bytes):
    below about 1 MiB an all-reduce is latency-bound, and its time varies with the NCCL and aws-ofi-nccl
    versions and the warm-up (the published p5 8 KiB point is about 81 us per op with NCCL 2.27.7), so a
    healthy pair could fall under half of it."""
    return int(_data("instances.json")["network"]["judged_from_bytes"])


def _fraction(results: list[dict], exp: Expected) -> float | None:
    """The pair's worst share of what it should reach: every size from judged_from() up against the
    published curve, else the largest size against the one figure (None: nothing to compare with)."""
    if exp.curve:
        big = [r for r in results if r["bytes"] >= judged_from()] or [_largest(results)]
        return min(r["busbw_gbps"] / exp.at(r["bytes"]) for r in big)
    return _largest(results)["busbw_gbps"] / exp.busbw_gbps if exp.busbw_gbps else None


def judge(result: dict, exp: Expected, transports: dict[str, str]) -> Verdict:
    nodes = list(result.get("nodes", []))
    pairs = []
    for p in result.get("pairs", []):
        big, small = _largest(p["results"]), _smallest(p["results"])
        frac = _fraction(p["results"], exp)
        pairs.append(PairVerdict(tuple(p["nodes"]), big["busbw_gbps"], small["time_us"], frac,
                                 frac is not None and frac < exp.threshold))
    everyone = result.get("all") or []
    v = Verdict(exp, nodes, transports, pairs,
                _largest(everyone)["busbw_gbps"] if everyone else None,
                _smallest(everyone)["time_us"] if everyone else None, seconds=float(result.get("seconds", 0)))
    if exp.transport:
        for n in nodes:
            got = transports.get(n, "no report")
            if got == NO_INTER and len(nodes) < 2:  # one node: no traffic leaves it, nothing to choose
                continue
            if not got.startswith(exp.transport) or "missing" in got or "not on this node" in got:
                v.failed[n] = f"transport {got}, expected {exp.transport}"
    slow = [p for p in pairs if p.slow]
    if slow:
        floor = (f"{exp.threshold:.0%} of the published figure at some size" if exp.curve
                 else f"{exp.threshold:.0%} of {exp.busbw_gbps:g} Gbps")
        mine = {n: [p for p in pairs if n in p.nodes] for n in nodes}
        culprits = [n for n in nodes if mine[n] and all(p.slow for p in mine[n])]
        if len(culprits) == len(nodes):  # every pair: the network as a whole, or the expectation, is off
            culprits = []
        for n in culprits:
            worst = max(p.busbw_gbps for p in mine[n])
            why = f"slow: every pair at or below {worst:.3g} Gbps bus bandwidth (under {floor})"
            v.failed[n] = f"{v.failed[n]}; {why}" if n in v.failed else why
        for p in slow:
            if not set(p.nodes) & set(culprits):
                v.unattributed.append(f"pair {p.nodes[0]}-{p.nodes[1]} slow: {p.busbw_gbps:.3g} Gbps "
                                      f"(under {floor}; one pair alone cannot say which node)")
    return v


# ---------------------------------------------------------------- output


def table(v: Verdict) -> list[str]:
    exp = v.expected
    out = [f"network check: {len(v.nodes)} node(s), {v.seconds:.1f} s; expected {exp.source}, "
           f"slow below {exp.threshold:.0%}"]
    if v.all_busbw_gbps is not None:
        out.append(f"  all ranks     {v.all_busbw_gbps:.3g} Gbps bus bandwidth, {v.all_latency_us:.0f} us "
                   "smallest all-reduce")
    if v.pairs:
        out.append(f"  {'pair':<28} {'busbw Gbps':>10} {'expected':>9} {'share':>6} {'latency us':>11}  verdict")
        for p in v.pairs:
            share = f"{p.fraction:.0%}" if p.fraction is not None else "-"
            want = f"{exp.busbw_gbps:g}" if exp.busbw_gbps else "-"
            out.append(f"  {p.nodes[0] + ' - ' + p.nodes[1]:<28} {p.busbw_gbps:>10.3g} {want:>9} {share:>6} "
                       f"{p.latency_us:>11.0f}  {'SLOW' if p.slow else 'ok'}")
    for n in v.nodes:
        out.append(f"  {n:<28} transport {v.transports.get(n, '?')}"
                   + (f"  FAILED: {v.failed[n]}" if n in v.failed else ""))
    out.extend(f"  {u}" for u in v.unattributed)
    return out


def summary_line(v: Verdict) -> str:
    """The run summary's line: measured against expected."""
    worst = min(v.pairs, key=lambda p: p.busbw_gbps) if v.pairs else None
    measured = (f"slowest pair {worst.busbw_gbps:.3g} Gbps" if worst else
                f"{v.all_busbw_gbps:.3g} Gbps (one node)" if v.all_busbw_gbps is not None else "no figure")
    want = f"{v.expected.busbw_gbps:g} Gbps expected" if v.expected.busbw_gbps else "no expected figure"
    state = "all nodes pass" if v.ok else f"failed: {v.problems()}"
    return f"{measured} bus bandwidth of {want} ({v.expected.source}); {state}"


def to_dict(v: Verdict, result: dict, job_id: str, drained: list[str]) -> dict:
    return {"job_id": job_id, "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ok": v.ok,
            "expected": asdict(v.expected), "nodes": {n: {"transport": v.transports.get(n), "failed": v.failed.get(n)}
                                                      for n in v.nodes},
            "pairs": [asdict(p) for p in v.pairs], "all_busbw_gbps": v.all_busbw_gbps,
            "all_latency_us": v.all_latency_us, "unattributed": v.unattributed, "drained": drained,
            "seconds": v.seconds, "measured": result}


def save(path: Path, v: Verdict, result: dict, job_id: str, drained: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(v, result, job_id, drained), indent=2) + "\n")
    return path


# ---------------------------------------------------------------- on the cluster


def parse_result(text: str) -> dict | None:
    """The program's result.json (None when it is cut short or not JSON)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) and "nodes" in data else None


def _bad(where: str, problem: str) -> NetCheckError:
    return NetCheckError(f"{where}: {problem}; a job, not the check program, wrote it: nothing is drained. "
                         "Run `fab check` again (or pass --skip-check to train without the check)")


def _is_number(v, low: float = 0.0) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def _check_results(rows, where: str, what: str, may_be_empty: bool = False) -> None:
    if not isinstance(rows, list) or not (rows or may_be_empty):
        raise _bad(where, f"{what} must be a list of measurements, not {rows!r:.80}")
    for r in rows:
        if not (isinstance(r, dict) and isinstance(r.get("bytes"), int) and not isinstance(r["bytes"], bool)
                and r["bytes"] > 0 and _is_number(r.get("busbw_gbps")) and _is_number(r.get("time_us"))):
            raise _bad(where, f"{what} holds {r!r:.80}, not {{bytes: a count, busbw_gbps and time_us: numbers}}")


def checked_result(result: dict, job_nodes: list[str], where: str) -> dict:
    """The check's result.json as the program writes it (jobs/allreduce_check.py), or NetCheckError naming
    the file: a job can write that file, so every node it names must be one of `job_nodes` (the job's node
    list as Slurm gave it to fab, never the file's word), and every field has its type (numbers finite)."""
    nodes = result.get("nodes")
    if not (isinstance(nodes, list) and nodes and all(isinstance(n, str) for n in nodes)
            and len(set(nodes)) == len(nodes)):
        raise _bad(where, f"nodes must be a list of distinct node names, not {nodes!r:.80}")
    strangers = [n for n in nodes if n not in job_nodes]
    if strangers:
        raise _bad(where, f"names {', '.join(repr(n) for n in strangers[:3])[:120]}, not among the check job's "
                          f"nodes ({', '.join(job_nodes)[:200]})")
    info = result.get("node_info", {})
    if not isinstance(info, dict) or any(h not in nodes or not isinstance(i, dict)
                                         or not isinstance(i.get("transport", ""), str)
                                         or not isinstance(i.get("missing", ""), (str, type(None)))
                                         for h, i in info.items()):
        raise _bad(where, "node_info must map the check's nodes to {transport: text}")
    pairs = result.get("pairs", [])
    if not isinstance(pairs, list):
        raise _bad(where, f"pairs must be a list, not {pairs!r:.80}")
    for p in pairs:
        two = p.get("nodes") if isinstance(p, dict) else None
        if not (isinstance(two, list) and len(two) == 2 and all(n in nodes for n in two) and two[0] != two[1]):
            raise _bad(where, f"a pair must name two of the check's nodes, not {two!r:.80}")
        _check_results(p.get("results"), where, f"pair {two[0]}-{two[1]}'s results")
    _check_results(result.get("all") or [], where, "all", may_be_empty=True)
    if not _is_number(result.get("seconds", 0)) or not isinstance(result.get("backend", ""), str):
        raise _bad(where, "seconds must be a number and backend a name")
    return result


DRAIN_PREFIX = "network check"
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # one node: no hostlist brackets, commas, quotes


def drain(ctl, failed: dict[str, str]) -> list[str]:
    """Drain each failed node with its reason (fab train's return to service resumes it: checked again).
    Only single node names (checked_result: from the job's own node list) are ever drained."""
    odd = [n for n in failed if not (isinstance(n, str) and _NODE_NAME.fullmatch(n))]
    if odd:
        raise NetCheckError(f"refusing to drain {odd[0]!r:.80}: not a single node name; nothing is drained")
    for node, why in failed.items():
        reason = f"{DRAIN_PREFIX}: {why}"[:250]
        sudo(ctl, f"scontrol update nodename={shlex.quote(node)} state=drain reason={shlex.quote(reason)}")
    return sorted(failed)


@dataclass
class Checked:
    verdict: Verdict
    result: dict
    job_id: str
    log_text: str
    check_dir: str = ""
    drained: list[str] = field(default_factory=list)


def run(cl: Cluster, stack: str | None, say, nodes: int | None = None) -> Checked:
    """Submit the check over `nodes` (default: all GPU nodes), wait, judge, drain the failed nodes."""
    inv, ctl = cl.inventory, cl.controller
    target = targets.of(inv)
    q = shlex.quote
    n = nodes or len(inv.gpu_nodes)
    cdir = f"{inv.scratch}/slurm-gpu/netcheck/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    slurm.make_job_dir(ctl, inv, cdir, jobs.WORK)  # the check's result and rendezvous: its work folder
    put_bytes(ctl, jobs.NETCHECK_PROGRAM.read_bytes(), f"{cdir}/allreduce_check.py")
    spec = jobs.base_spec(inv, jobs.NETCHECK_NAME, n, inv.gpus_per_node, cdir,
                          script_path=f"{cdir}/netcheck.sbatch", time_limit=TIME_LIMIT)
    sizes = GPU_SIZES if target.real_gpus else CPU_SIZES
    script = jobs.render_netcheck(spec, sizes, BUDGET_S, target.gloo_ifname)
    put_text(ctl, script, spec.script_path, 0o755)
    job_id = slurm.submit(ctl, spec.script_path, user=slurm.job_user(inv))
    say(f"      network check: job {job_id} on {n} node(s) x {inv.gpus_per_node} rank(s), "
        f"{', '.join(_size(s) for s in sizes)} all-reduces")
    try:
        job = slurm.wait_job(ctl, job_id, WAIT_S)
    except slurm.SlurmError as exc:  # a check that cannot finish must not hold the nodes for the job
        sudo(ctl, f"scancel {q(job_id)}", warn=True)  # root: the job is the job user's
        raise NetCheckError(f"network check job {job_id} did not finish ({exc}); cancelled it. "
                            "See `fab status`, or pass --skip-check to train without the check") from None
    log_path = f"{inv.scratch}/logs/{jobs.NETCHECK_NAME}-{job_id}.out"
    text = read_remote(ctl, log_path, missing_ok=True)
    result = parse_result(read_remote(ctl, f"{spec.work_dir}/result.json", missing_ok=True))
    if result is None or not job.ok:
        raise NetCheckError(f"network check job {job_id} {job.state} (exit {job.exit_code}) without a result; "
                            f"{log_excerpt(text, log_path)}")
    try:
        job_nodes = [n for n in slurm.hostnames(job.nodes) if n in {g.name for g in inv.gpu_nodes}]
    except slurm.SlurmError as exc:
        raise NetCheckError(f"network check job {job_id}: Slurm's node list {exc}; see `fab status`") from None
    result = checked_result(result, job_nodes, f"{spec.work_dir}/result.json")
    exp = expected(inv, stack)
    v = judge(result, exp, transports_of(result, text, backend_nccl=result.get("backend") == "nccl"))
    checked = Checked(v, result, job_id, text, cdir)
    checked.drained = drain(ctl, v.failed)
    return checked


def check(cl: Cluster, stack: str | None, say=print) -> Checked:
    """`fab check`: nodes awake and idle, the check, its table; runs/<job>/network.json and timeline.json.
    A failed node is drained with the reason and the task fails naming it."""
    tl = timeline.Timeline(started=timeline.process_started(), cluster=cl.inventory.cluster_name)
    names = [n.name for n in cl.inventory.gpu_nodes]
    with tl.phase("wake"):
        node_power.wake(cl, say)
    with tl.phase("service"):  # down or earlier-drained nodes back to service, so every node is checked
        slurm.wait_idle(cl.controller, names, say=say)
    with tl.phase("network"):
        checked = run(cl, stack, say)
    for line in table(checked.verdict):
        say(line)
    dest = runs.run_dir(checked.job_id, checked.check_dir)
    tl.job_id = checked.job_id
    save(dest / "network.json", checked.verdict, checked.result, checked.job_id, checked.drained)
    tl.save(dest / "timeline.json")
    say(f"network check took {tl.seconds('network'):.1f} s; results in {dest}/network.json")
    if not checked.verdict.ok:
        drained = (f"; drained {', '.join(checked.drained)}: `fab train` returns them to service and checks "
                   "them again, or `scontrol update nodename=NODE state=resume` on the controller"
                   ) if checked.drained else ""
        raise NetCheckError(f"{checked.verdict.problems()}{drained}")
    return checked


def log_excerpt(text: str, log_path: str, first: int = 12, last: int = 15) -> str:
    """What a failed check's log says: its first error lines (where a hang or crash began: a timeout
    kills every rank, and their tracebacks fill the end) and its last lines."""
    lines = text.splitlines()
    errors = [ln for ln in lines[:-last] if re.search(r"[Ee]rror|[Tt]imed? ?out|Traceback|refused|[Ff]ailed", ln)]
    out = ""
    if errors:
        out += f"first error lines of {log_path}:\n" + "\n".join(f"  {ln}" for ln in errors[:first]) + "\n"
    return out + f"last lines of {log_path}:\n" + "\n".join(f"  {ln}" for ln in lines[-last:])


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


