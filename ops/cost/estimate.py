"""How long a run takes and what it costs, before anything is launched (`fab estimate`).

Every phase of the run's timeline (ops/finetune/timeline.py) gets a predicted time from a small model:
bytes over the throughput of the link they cross (hub through the NAT gateway, the shared
gp3 volume over NFS, a node's page cache), tokens over the GPU's throughput (measured on the
project's benchmark GPU and scaled by datasheet FLOPs where the GPU has no result of its
own), and fixed costs for the SSH and Slurm steps. Prices come from ops/data/prices.json.
docs/ESTIMATE.md gives the formulas, the inputs and the factor the estimate is held to.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.errors import UserError
from cluster.gp3 import GP3_IOPS, GP3_THROUGHPUT, gp3_min_iops
from cluster.stack_config import ConfigError, StackConfig, StackFile, read_stack_file
from ops.actions.flags import OptionError, number  # the one parser of number flags (ASCII digits, finite)
from ops.cost import market_prices

DATA = Path(__file__).resolve().parents[1] / "data"  # ops/data/
# The one benchmark result the estimate is calibrated on, chosen on purpose (not the newest file):
# the time-to-adapters run on the project's benchmark GPU, whose alpaca-102 workload also gives the mean
# row length. A new calibration is a new file named here (docs/ESTIMATE.md says how it is made).
MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "time-to-adapters-h100-2026-12-06.json"
MONTH_S = 730 * 3600  # AWS prices storage per GB-month of 730 hours

SCENARIOS = ("new", "first", "again")
SCENARIO_TITLES = {"new": "new stack: pulumi up -> adapters", "first": "first fab train (nothing cached)",
                   "again": "fab train again (cluster ran once)"}

# Bytes on disk of base models the estimate knows (bf16 safetensors), and their parameter counts.
MODELS = {
    "Qwen/Qwen3-4B": {"bytes": 8.05e9, "params": 4.02e9, "trainable": 11.8e6},
    "Qwen/Qwen3-1.7B": {"bytes": 4.06e9, "params": 1.72e9, "trainable": 6.4e6},
    "Qwen/Qwen3-8B": {"bytes": 16.4e9, "params": 8.19e9, "trainable": 15.3e6},
}
# Alpaca-style rows under the project's template: the benchmark workload's measured mean length.
DATASETS = {"tatsu-lab/alpaca": {"rows": 52002, "bytes": 24.2e6}}

# Assumed link rates (MB/s) and fixed costs (s), each named where it is used; docs/ESTIMATE.md lists them.
HUB_MBPS = 150.0          # Hugging Face's CDN to one EC2 node through the NAT gateway
PAGE_CACHE_MBPS = 4000.0  # a node reading a file its page cache holds (NFS client cache included)
NVME_MBPS = 1500.0        # one local NVMe instance-store disk
# gp3's baseline throughput and IOPS (the root volumes; the shared /scratch's own volume may have more) and
# its most throughput: cluster/gp3.py.
GP3_BASE_MBPS, GP3_MAX_MBPS = (float(mbps) for mbps in GP3_THROUGHPUT)
GP3_BASE_IOPS = GP3_IOPS[0]
SSH_STEP_S = 1.0          # one fab step of a few SSH round trips through the controller
WHEELS_BYTES = 3.8e9      # the CUDA training stack the GPU node's first boot installs (torch + nvidia-*)
WHEELS_INSTALL_S = 60.0   # pip unpacking and installing it on a node (assumed)
# A GPU node's apt packages at first boot (slurm-wlm, munge, nfs-common and their dependencies from
# the Ubuntu mirror, through the NAT gateway; the image has the compiler and headers): assumed.
APT_BYTES_PER_NODE = 0.1e9
# How much sooner the controller boots than the GPU nodes: they wait for the NAT gateway (~2 min to
# create), it does not (public subnet). Its download of the wheel cache runs in that time.
CONTROLLER_HEAD_START_S = 120.0


class EstimateError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class PricedCluster:
    target: str  # a key of cluster.targets
    region: str
    gpu_type: str  # instance type ("local" for the local cluster)
    controller_type: str
    nodes: int
    ranks_per_node: int
    root_volume_gib: int = 200
    idle_stop_min: int = 30
    scratch_gib: int = 100  # the shared /scratch's own gp3 volume on the controller (slurm-gpu:scratchSizeGiB)
    # The shared volume's gp3 throughput (MiB/s, taken as MB/s: 5% conservative) and IOPS; above
    # gp3's baseline both are billed. scratch_from: where the figure came from.
    scratch_mbps: float = GP3_BASE_MBPS
    scratch_iops: int = GP3_BASE_IOPS
    scratch_from: str = "gp3 baseline"
    source: str = ""
    stack_nodes: int = 0  # GPU nodes the stack runs (and bills), of which the job uses `nodes`
    # No real GPUs (the local cluster): phase times calibrated on the CI machine, nothing billed.
    calibrated: bool = False
    market: str = "on-demand"  # slurm-gpu:gpuMarket: ops/cost/market_prices.py prices spot and Capacity Blocks
    reservation_id: str = ""  # slurm-gpu:capacityReservationId (capacity-reservation, capacity-block)
    profile: str | None = None  # aws:profile: the credentials `pulumi` uses for the stack

    @property
    def billed_nodes(self) -> int:
        return max(self.nodes, self.stack_nodes)


@dataclass(frozen=True)
class PricedJob:
    model: str
    model_bytes: float
    trainable: float
    rows: int
    tokens_per_row: float
    batch: int
    accumulation: int
    epochs: float
    save_steps: int
    data_bytes: float = 0.0


@dataclass
class PhaseEstimate:
    key: str
    seconds: dict[str, float]  # scenario -> seconds
    basis: str


@dataclass
class Estimate:
    cluster: PricedCluster
    job: PricedJob
    phases: list[PhaseEstimate] = field(default_factory=list)
    nat_bytes: dict[str, float] = field(default_factory=dict)
    throughput: str = ""  # where the GPU throughput came from

    def total(self, scenario: str) -> float:
        return sum(p.seconds.get(scenario, 0.0) for p in self.phases)

    def predicted(self, scenario: str) -> dict[str, float]:
        """key -> seconds of one scenario (the timeline's prediction column)."""
        out: dict[str, float] = {}
        for p in self.phases:
            if p.seconds.get(scenario):
                out[p.key] = out.get(p.key, 0.0) + p.seconds[scenario]
        return out


# ---------------------------------------------------------------- data files


def _json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def instance(itype: str, setting: str) -> dict:
    types = _json("instances.json")["types"]
    if itype not in types:
        raise EstimateError(f"{setting} {itype!r}: the estimate has no facts for this type (known: "
                            f"{', '.join(sorted(types))}); add it to ops/data/instances.json")
    return types[itype]


def prices(region: str) -> dict:
    table = _json("prices.json")
    if region not in table["regions"]:
        raise EstimateError(f"region {region!r}: no prices in ops/data/prices.json (known: "
                            f"{', '.join(sorted(table['regions']))}); add the region's prices there or "
                            "pass --region")
    return table["regions"][region]


def price_per_h(region: str, itype: str) -> float:
    table = prices(region)["instance_per_h"]
    if itype not in table:
        raise EstimateError(f"{itype} in {region}: no on-demand price in ops/data/prices.json; add it there")
    return table[itype]


# ---------------------------------------------------------------- GPU throughput


def _gpu_key(reported: str) -> str:
    """The datasheet table's name for a GPU as torch reports it ("NVIDIA H100 80GB HBM3" -> "H100")."""
    name = reported.replace("NVIDIA ", "").strip()
    first = name.split(" ")[0] if name else name
    return first if first in _json("instances.json")["gpus"] else name


def gpu_throughput(gpu: str) -> tuple[float, float, str]:
    """(tokens/s per GPU of the job's training loop, seconds of fixed start-up, where it came from).

    The measured figure is MEASURED's warm time-to-adapters run: one rank's share of the
    baseline job (train_runtime, first step and warmup included). A GPU without a result of its own is
    scaled from that one by the ratio of datasheet dense BF16 FLOPs (ops/data/instances.json).
    """
    data = json.loads(MEASURED.read_text())
    rows = [row for row in data.get("time_to_adapters") or []
            if row.get("rc") == 0 and row.get("label") == "warm" and row.get("train_runtime")]
    if not rows:
        raise EstimateError(f"no warm time-to-adapters run in {MEASURED}; run benchmarks/bench_train.py")
    path, row = MEASURED, rows[-1]
    measured_gpu = _gpu_key(str(data.get("gpu", "")))
    tok_s = row["train_tokens"] / row["train_runtime"]
    startup = float(row["phases_s"]["args_parsed"])
    name = Path(path).name
    if gpu == measured_gpu:
        return tok_s, startup, f"{gpu}: measured ({name}, {tok_s:,.0f} tokens/s per GPU)"
    gpus = _json("instances.json")["gpus"]
    if gpu not in gpus or measured_gpu not in gpus:
        raise EstimateError(f"GPU {gpu}: no datasheet FLOPs in ops/data/instances.json to scale from {measured_gpu}")
    ratio = gpus[gpu]["bf16_tflops"] / gpus[measured_gpu]["bf16_tflops"]
    return tok_s * ratio, startup, (f"{gpu}: scaled from {measured_gpu} ({name}) by datasheet BF16 FLOPs "
                                    f"x{ratio:.3f}: {tok_s * ratio:,.0f} tokens/s per GPU")


# ---------------------------------------------------------------- inputs


def job_from_config(config: Path, model: str | None, data: str | None, examples: int | None,
                    model_gb: float | None = None, tokens_per_row: float | None = None) -> PricedJob:
    """The job's sizes from the training YAML and the flags (the flags win)."""
    cfg = yaml.safe_load(config.read_text()) or {}
    model = model or cfg.get("model_name_or_path", "")
    data = data or cfg.get("dataset_name", "")
    known = MODELS.get(model)
    if model_gb is not None:
        if model_gb <= 0:
            raise EstimateError(f"--model-gb must be positive, not {model_gb}")
        size = model_gb * 1e9
    elif known:
        size = known["bytes"]
    elif str(model).startswith("/scratch/tiny") or cfg.get("dtype") == "float32":
        size = 1.0e6  # the local cluster's tiny model (training.make_tiny)
    else:
        raise EstimateError(f"model {model!r}: its size is unknown to the estimate (known: {', '.join(MODELS)}); "
                            "pass --model-gb with the size of its weights")
    rows = examples or int(cfg.get("n_examples") or 0) or DATASETS.get(data, {}).get("rows", 400)
    if tokens_per_row is not None and tokens_per_row <= 0:
        raise EstimateError(f"--tokens-per-row must be positive, not {tokens_per_row}")
    tpr = tokens_per_row or _mean_tokens(cfg)
    return PricedJob(model=str(model), model_bytes=size, trainable=(known or {}).get("trainable", 1.0e5),
               rows=rows, tokens_per_row=tpr, batch=int(cfg.get("per_device_train_batch_size", 8)),
               accumulation=int(cfg.get("gradient_accumulation_steps", 1)),
               epochs=float(cfg.get("num_train_epochs", 1)), save_steps=int(cfg.get("save_steps") or 0),
               data_bytes=DATASETS.get(data, {}).get("bytes", 1e6))


def _mean_tokens(cfg: dict) -> float:
    """Mean tokens per row: the benchmark's Alpaca workload (real lengths), capped by max_length."""
    work = json.loads(MEASURED.read_text()).get("workloads", {}).get("alpaca-102")
    if work and work.get("mean_length"):
        return min(float(work["mean_length"]), float(cfg.get("max_length", 1024)))
    return 100.0


# ---------------------------------------------------------------- the model


def estimate(cl: PricedCluster, job: PricedJob) -> Estimate:
    if cl.nodes < 1 or cl.ranks_per_node < 1:
        raise EstimateError(f"the cluster needs at least one node and one rank per node, not "
                            f"{cl.nodes} x {cl.ranks_per_node}")
    return _local(cl, job) if cl.calibrated else _aws(cl, job)


def _steps(cl: PricedCluster, job: PricedJob) -> tuple[int, float]:
    world = cl.nodes * cl.ranks_per_node
    per_step = job.batch * job.accumulation * world
    steps = max(1, math.ceil(job.rows * job.epochs / per_step))
    return steps, job.rows * job.epochs * job.tokens_per_row / world  # steps, tokens per rank


def _aws(cl: PricedCluster, job: PricedJob) -> Estimate:
    node = instance(cl.gpu_type, "slurm-gpu:gpuInstanceType")
    ctl = instance(cl.controller_type, "slurm-gpu:controllerInstanceType")
    if not node["gpus"]:
        raise EstimateError(f"slurm-gpu:gpuInstanceType {cl.gpu_type} has no GPU")
    if cl.ranks_per_node > node["gpus"]:
        raise EstimateError(f"--gpus-per-node {cl.ranks_per_node}: {cl.gpu_type} has {node['gpus']} GPUs")
    tok_s, startup_s, basis = gpu_throughput(node["gpu"])
    est = Estimate(cl, job, throughput=basis)
    steps, tokens_rank = _steps(cl, job)
    mb = 1e6
    model, n = job.model_bytes, cl.nodes
    # Reading the weights: each node reads them once (its ranks share its page cache).
    net_ctl = ctl["network_gbps"] * 1000 / 8  # MB/s out of the controller (its burst figure)
    fits = ctl["memory_gib"] * 2**30 > 1.3 * model  # the controller's page cache keeps the weights
    disk_reads = 1 if fits else n
    nfs_s = max(disk_reads * model / (cl.scratch_mbps * mb), n * model / (net_ctl * mb))
    warm_s = model / (PAGE_CACHE_MBPS * mb) * cl.ranks_per_node
    gpu_load_s = 1.6  # measured: model_loaded - data_ready of the benchmark (weights already in memory)
    ph = est.phases

    def add(key: str, basis_: str, new: float, first: float | None = None, again: float | None = None):
        ph.append(PhaseEstimate(key, {"new": new, "first": new if first is None else first,
                                      "again": (new if first is None else first) if again is None else again},
                                basis_))

    add("pulumi", "pulumi up: VPC, NAT gateway (~2 min to create), instances (assumed)", 150, 0, 0)
    add("boot", "first boot: OS packages, Slurm, NFS (assumed 90 s)", 90, 0, 0)
    # The training stack: the controller downloads it once into /scratch (bootstrap `wheels` step)
    # while the NAT gateway is still being made; the nodes wait for whatever is left of that, read
    # it over NFS (just written: from the controller's page cache where it fits) and install.
    fetch_s = WHEELS_BYTES / (HUB_MBPS * mb)
    wait_s = max(0.0, fetch_s - CONTROLLER_HEAD_START_S)
    wheels_cached = ctl["memory_gib"] * 2**30 > 1.3 * WHEELS_BYTES
    read_s = max((0 if wheels_cached else n) * WHEELS_BYTES / (cl.scratch_mbps * mb),
                 n * WHEELS_BYTES / (net_ctl * mb))
    add("boot_stack", (f"first boot: training stack {WHEELS_BYTES / 1e9:.1f} GB fetched once by the controller "
                       f"({fetch_s:.0f} s at {HUB_MBPS:.0f} MB/s, no NAT; {CONTROLLER_HEAD_START_S:.0f} s head "
                       f"start: {wait_s:.0f} s left to wait), {n} node(s) read it over NFS in {read_s:.1f} s, "
                       f"+ {WHEELS_INSTALL_S:.0f} s to install (each node, in parallel)"),
        wait_s + read_s + WHEELS_INSTALL_S, 0, 0)
    add("setup", "fab's imports, the training config check, `pulumi stack output` (assumed)", 5)
    add("wake", "cloud-init done on every host: one SSH round (nodes on; a stopped node adds 2-4 min)",
        SSH_STEP_S)
    add("inputs", "model and data paths checked on the cluster", SSH_STEP_S)
    add("prefetch", (f"the controller fetches model and data ({(model + job.data_bytes) / 1e9:.1f} GB) from the "
                     f"hub at {HUB_MBPS:.0f} MB/s into /scratch (public subnet: no NAT); again: complete, skipped"),
        (model + job.data_bytes) / (HUB_MBPS * mb) + SSH_STEP_S, None, SSH_STEP_S)
    add("keys", "munge key read and compared on every node", 2 * SSH_STEP_S)
    add("reconfigure", "slurm.conf compared (no change: no restart)", SSH_STEP_S)
    add("service", "every node idle in sinfo", SSH_STEP_S)
    add("sanity", "sbatch of nvidia-smi on every node, its log read", 4.0)
    add("network", "all-reduce check: torchrun start-up, a few sizes across all ranks and per pair", 30.0)
    add("staging", "training/ as a tarball, config and script uploaded, sbatch", 2 * SSH_STEP_S)
    add("queue", "an idle cluster schedules the job within a scheduler pass", 1.0)
    add("startup", f"srun, torchrun rendezvous, Python imports: measured {startup_s:.1f} s (benchmark)", startup_s)
    add("data", f"tokenizing {job.rows:,} rows (measured 1.2 s)", 1.2)
    add("model", (f"{model / 1e9:.1f} GB: first run {n} node(s) read it over NFS ({disk_reads} read(s) of gp3 at "
                  f"{cl.scratch_mbps:.0f} MB/s, {cl.scratch_from}; controller page cache "
                  f"{'holds' if fits else 'cannot hold'} it); "
                  f"again: the nodes' page cache at {PAGE_CACHE_MBPS:.0f} MB/s x {cl.ranks_per_node} ranks; "
                  f"+ {gpu_load_s} s to the GPU"),
        nfs_s + gpu_load_s, None, warm_s + gpu_load_s)
    add("build", "trainer build (measured 0.8 s, benchmark)", 0.8)
    step_s = tokens_rank / tok_s / steps
    world = n * cl.ranks_per_node
    grad = job.trainable * 4  # fp32 LoRA gradients, all-reduced every optimizer step
    link = (node["network_gbps"] * 1000 / 8) * 0.5 if n > 1 else 50_000  # half the node's burst network
    allreduce_s = 2 * (world - 1) / world * grad / (link * mb)
    add("first_step", "one step's share of the training time + 2 s of NCCL/cuBLAS initialisation", step_s + 2)
    ckpts = (steps // job.save_steps) if job.save_steps else 0
    ckpt_s = ckpts * 3 * job.trainable * 4 / (cl.scratch_mbps * mb)  # adapter + Adam moments, on /scratch
    add("steps", (f"{steps - 1} more steps: {tokens_rank:,.0f} tokens per rank at {tok_s:,.0f} tokens/s, "
                  f"+ {allreduce_s * 1000:.0f} ms all-reduce per step, {ckpts} checkpoint(s)"),
        step_s * (steps - 1) + allreduce_s * steps + ckpt_s)
    add("save", f"adapters ({job.trainable * 4 / 1e6:.0f} MB) and state to /scratch", 0.5)
    add("exit", "metrics written, ranks and batch script end (measured 4 s locally)", 4.0)
    add("seen", "fab's next poll", 1.0)
    add("download", f"adapters and state ({job.trainable * 4 / 1e6 + 12:.0f} MB) at 12.5 MB/s (100 Mbit/s home)",
        1 + (job.trainable * 4 + 12e6) / 12.5e6)
    # The controller (public subnet) fetches model, data and the nodes' training stack (its wheels
    # step resolves with its own pip, so the cache fills: bootstrap-controller.sh.j2): the big
    # downloads never cross the NAT gateway. A new stack's nodes fetch only their apt packages through it.
    est.nat_bytes = {"new": n * APT_BYTES_PER_NODE, "first": 0.0, "again": 0.0}
    return est


def _local(cl: PricedCluster, job: PricedJob) -> Estimate:
    """The local cluster: fixed costs calibrated on the CI machine (ops/data/local.json), CPU tokens/s."""
    cal = _json("local.json")
    est = Estimate(cl, job, throughput=f"CPU ranks: {cal['tokens_per_s_per_rank']:,.0f} tokens/s each "
                                       f"({cal['source']})")
    steps, tokens_rank = _steps(cl, job)
    train_s = tokens_rank / cal["tokens_per_s_per_rank"]
    for key, seconds in cal["phases_s"].items():
        if key == "first_step":
            seconds += train_s / steps
        elif key == "steps":
            seconds += train_s * (steps - 1) / steps
        est.phases.append(PhaseEstimate(key, dict.fromkeys(SCENARIOS, float(seconds)), cal["source"]))
    return est


# ---------------------------------------------------------------- cost


@dataclass
class CostLine:
    what: str
    usd: float


def gp3_per_month(p: dict, gb: float, mbps: float = GP3_BASE_MBPS, iops: float = GP3_BASE_IOPS) -> float:
    """USD per month of one gp3 volume: its GB, plus the throughput and IOPS provisioned above gp3's
    baseline (https://aws.amazon.com/ebs/pricing/). `p`: prices(region). The one gp3 formula of the
    estimate, the cap, what still bills and the spend so far."""
    return (gb * p["gp3_per_gb_month"] + max(0.0, mbps - GP3_BASE_MBPS) * p["gp3_per_mbps_month"]
            + max(0.0, iops - GP3_BASE_IOPS) * p["gp3_per_iops_month"])


def per_h_of_month(usd_per_month: float) -> float:
    """A monthly price per hour: AWS prorates per second over a 730-hour month."""
    return usd_per_month * 3600 / MONTH_S


def idle_cost(per_h: float, idle_stop_min: int) -> float:
    """What nodes billing `per_h` cost while they wait idle for power saving to stop them."""
    return per_h * idle_stop_min / 60


def storage_per_h(cl: PricedCluster, volumes: int | None = None, scratch: bool | None = None) -> list[CostLine]:
    """The EBS bill per hour: `volumes` gp3 root volumes of cl.root_volume_gib (default: every node's and
    the controller's), then, with `scratch` (default: when `volumes` is), the shared /scratch's own gp3
    volume (the controller's: its GB, and its throughput and IOPS above gp3's baseline). AWS bills gp3
    per GB-month, prorated by the second (https://aws.amazon.com/ebs/pricing/)."""
    p = prices(cl.region)
    count = cl.billed_nodes + 1 if volumes is None else volumes
    vol_gb = count * cl.root_volume_gib
    lines = [CostLine(f"EBS gp3 {vol_gb} GB at ${p['gp3_per_gb_month']}/GB-month",
                      per_h_of_month(gp3_per_month(p, vol_gb)))] if count else []
    if not (volumes is None if scratch is None else scratch):
        return lines
    lines.append(CostLine(f"EBS gp3 /scratch volume {cl.scratch_gib} GB at ${p['gp3_per_gb_month']}/GB-month "
                          "(kept while the stack lives, deleted by pulumi destroy)",
                          per_h_of_month(gp3_per_month(p, cl.scratch_gib))))
    if cl.scratch_mbps > GP3_BASE_MBPS:
        extra = cl.scratch_mbps - GP3_BASE_MBPS
        lines.append(CostLine(f"gp3 throughput +{extra:.0f} MB/s at ${p['gp3_per_mbps_month']}/MB/s-month",
                              per_h_of_month(gp3_per_month(p, 0, mbps=cl.scratch_mbps))))
    if cl.scratch_iops > GP3_BASE_IOPS:
        extra_iops = cl.scratch_iops - GP3_BASE_IOPS
        lines.append(CostLine(f"gp3 IOPS +{extra_iops} at ${p['gp3_per_iops_month']}/IOPS-month",
                              per_h_of_month(gp3_per_month(p, 0, iops=cl.scratch_iops))))
    return lines


def cost(est: Estimate, scenario: str) -> list[CostLine]:
    """The run's bill: instances by the second, NAT gateway hours and GB, EBS GB-months (aws only)."""
    cl = est.cluster
    if cl.calibrated:
        return []
    p = prices(cl.region)
    wall = est.total(scenario)
    gpu_h, ctl_h = price_per_h(cl.region, cl.gpu_type), price_per_h(cl.region, cl.controller_type)
    gb = est.nat_bytes.get(scenario, 0.0) / 1e9
    return [
        CostLine(f"{cl.billed_nodes} x {cl.gpu_type} at ${gpu_h}/h for {wall:.0f} s",
                 cl.billed_nodes * gpu_h * wall / 3600),
        CostLine(f"controller {cl.controller_type} at ${ctl_h}/h", ctl_h * wall / 3600),
        CostLine(f"NAT gateway ${p['nat_per_h']}/h + {gb:.1f} GB at ${p['nat_per_gb']}/GB",
                 p["nat_per_h"] * wall / 3600 + gb * p["nat_per_gb"]),
        *(CostLine(c.what, c.usd * wall / 3600) for c in storage_per_h(cl)),
    ]


def spot_bill(est: Estimate, scenario: str) -> tuple[float, float] | None:
    """The run's bill with the GPU nodes on spot (low, high over the recorded range of
    ops/data/prices.json): cost()'s GPU line priced at the spot range instead."""
    cl = est.cluster
    spot = None if cl.calibrated else market_prices.spot_range(_json("prices.json"), cl.region, cl.gpu_type)
    if spot is None:
        return None
    rest = sum(c.usd for c in cost(est, scenario)[1:])  # its first line is the GPU nodes
    wall = est.total(scenario)
    low, high = (rest + cl.billed_nodes * p * wall / 3600 for p in (spot.low, spot.high))
    return low, high


def idle_tail(est: Estimate) -> CostLine | None:
    """What the GPU nodes cost while they wait idle for power saving to stop them after the job."""
    cl = est.cluster
    if cl.calibrated or not cl.idle_stop_min:
        return None
    h = price_per_h(cl.region, cl.gpu_type)
    return CostLine(f"then {cl.billed_nodes} idle node(s) until power saving stops them ({cl.idle_stop_min} min, "
                    "slurm-gpu:idleStopMinutes)", idle_cost(cl.billed_nodes * h, cl.idle_stop_min))


# ---------------------------------------------------------------- what the user sees


def lines(est: Estimate, scenarios: tuple[str, ...] = SCENARIOS) -> list[str]:
    from ops.finetune.timeline import LABELS

    cl, job = est.cluster, est.job
    steps, tokens_rank = _steps(cl, job)
    labels = {**LABELS, "pulumi": "pulumi up", "boot": "first boot: packages, Slurm",
              "boot_stack": "first boot: training stack"}
    out = [f"estimate: {cl.target} cluster, {cl.nodes} x {cl.gpu_type} ({cl.ranks_per_node} rank(s) each)"
           + ("" if cl.calibrated else f", {cl.region}") + (f" [{cl.source}]" if cl.source else ""),
           f"  job: {job.model} ({job.model_bytes / 1e9:.2f} GB), {job.rows:,} rows x ~{job.tokens_per_row:.0f} "
           f"tokens, {steps} optimizer steps, {tokens_rank:,.0f} tokens per rank",
           f"  GPU throughput: {est.throughput}"]
    head = f"  {'phase':<34}" + "".join(f" {s:>9}" for s in scenarios) + "  basis"
    out.append(head)
    for p in est.phases:
        if not any(p.seconds.get(s) for s in scenarios):
            continue
        out.append(f"  {labels.get(p.key, p.key)[:34]:<34}" + "".join(f" {p.seconds.get(s, 0):>8.1f}s"
                                                                   for s in scenarios) + f"  {p.basis}")
    out.append(f"  {'total':<34}" + "".join(f" {est.total(s):>8.1f}s" for s in scenarios)
               + "  " + "; ".join(f"{SCENARIO_TITLES[s]} {est.total(s) / 60:.1f} min" for s in scenarios))
    for s in scenarios:
        bill = cost(est, s)
        if bill:
            out.append(f"  cost, {SCENARIO_TITLES[s]}: ${sum(c.usd for c in bill):.2f}")
            out.extend(f"    ${c.usd:>7.3f}  {c.what}" for c in bill)
            out.extend(market_prices.market_lines(
                _json("prices.json"), region=cl.region, gpu_type=cl.gpu_type, nodes=cl.billed_nodes,
                wall=est.total(s), on_demand_h=price_per_h(cl.region, cl.gpu_type), market=cl.market))
    tail = idle_tail(est)
    if tail:
        out.append(f"  ${tail.usd:.2f} {tail.what}: `fab` does not stop them sooner")
    if not cl.calibrated:
        table = _json("prices.json")
        out.append(f"  prices: ops/data/prices.json ({table['date']}, {table['source'].split(',')[0]}); "
                   "instances bill per second (60 s minimum)")
    return out


def dominant(est: Estimate, scenario: str, n: int = 3) -> list[tuple[str, float]]:
    """The n phases that take the most of a scenario's time."""
    return sorted(((p.key, p.seconds.get(scenario, 0.0)) for p in est.phases), key=lambda kv: -kv[1])[:n]


# ---------------------------------------------------------------- the cluster, read without touching a host

REPO = Path(__file__).resolve().parents[2]


def stack_settings(stack: str | None, repo: Path = REPO) -> StackFile:
    """The stack's Pulumi.<stack>.yaml, parsed as `pulumi up` parses it (cluster/stack_config.py)."""
    files = sorted(repo.glob("Pulumi.*.yaml"))
    if stack:
        path = repo / f"Pulumi.{stack}.yaml"
        if not path.is_file():
            raise EstimateError(f"--stack {stack}: no Pulumi.{stack}.yaml in {repo} (stacks here: "
                                f"{', '.join(f.name[7:-5] for f in files) or 'none'})")
    elif len(files) == 1:
        path = files[0]
    else:
        raise EstimateError(f"{len(files)} stack files in {repo} ({', '.join(f.name for f in files) or 'none'}): "
                            "pass --stack NAME, or --gpu-instance-type and --region to price a cluster "
                            "without a stack")
    try:
        return read_stack_file(path)
    except ConfigError as exc:
        raise EstimateError(str(exc)) from None


def _positive(flag: str, value, kind=int):
    if value is None or value == "":
        return None
    try:
        v = number(flag, value, kind)
    except OptionError as exc:
        raise EstimateError(str(exc)) from None
    if v <= 0:
        raise EstimateError(f"--{flag} must be positive, not {v}")
    return v


def cluster_for(target: str, stack: str | None, inv=None, nodes: int | None = None, gpus: int | None = None,
                gpu_instance_type: str | None = None, region: str | None = None,
                scratch_mbps=None) -> PricedCluster:
    """The cluster to estimate: the stack's settings (and its inventory, when one was read), flags on top."""
    what_if = _positive("scratch-mbps", scratch_mbps, float)
    if what_if is not None and what_if > GP3_MAX_MBPS:
        raise EstimateError(f"--scratch-mbps {what_if:.0f}: gp3 provisions at most {GP3_MAX_MBPS:.0f} MB/s")
    from cluster import targets

    if not targets.get(target).real_gpus:  # the local cluster: no prices, its calibrated figures
        n = nodes or (len(inv.gpu_nodes) if inv else 2)
        g = gpus or (inv.gpus_per_node if inv else 2)
        return PricedCluster(target, "-", target, "-", n, g, source=f"{target} cluster", calibrated=True)
    stack_file = None if (gpu_instance_type and region) else stack_settings(stack)
    # Without a stack file: every setting's default, parsed as `pulumi up` parses them.
    settings = stack_file.settings if stack_file else StackConfig.from_mapping({}, access=False)
    source = stack_file.name if stack_file else "flags"
    itype = gpu_instance_type or settings.gpu_instance_type
    reg = region or (stack_file and stack_file.region) or (inv.facts.region if inv else None)
    if not reg:
        raise EstimateError(f"{source} sets no aws:region; pass --region (e.g. us-east-1)")
    facts = instance(itype, "--gpu-instance-type" if gpu_instance_type else "slurm-gpu:gpuInstanceType")
    stack_nodes = len(inv.gpu_nodes) if inv else settings.gpu_node_count
    n = nodes or stack_nodes
    g = gpus or (inv.gpus_per_node if inv else facts["gpus"])
    idle = settings.idle_stop_minutes
    if inv and inv.idle_stop_s is not None:
        idle = inv.idle_stop_s // 60
    scratch, iops, scratch_from = _scratch_volume(settings, inv, what_if)
    cl = PricedCluster(target, reg, itype, settings.controller_instance_type, n, g,
                 root_volume_gib=settings.root_volume_gib, idle_stop_min=idle, scratch_mbps=scratch,
                 scratch_gib=_scratch_gib(settings, inv),
                 scratch_iops=iops, scratch_from=scratch_from,
                 source=source + (" + inventory" if inv else ""), stack_nodes=stack_nodes,
                 market=settings.gpu_market, reservation_id=settings.capacity_reservation_id or "",
                 profile=stack_file.profile if stack_file else None)
    prices(reg)  # an unknown region or type fails here, naming the price table
    price_per_h(reg, cl.gpu_type)
    price_per_h(reg, cl.controller_type)
    return cl


def _inventory_volume(inv):
    """The shared volume the stack's inventory records (cluster/spec.py ScratchVolume), or None."""
    return inv.aws.scratch_volume if inv is not None and inv.aws else None


def _scratch_gib(settings: StackConfig, inv) -> int:
    """The shared /scratch volume's GB: the stack's inventory (what the volume got), else slurm-gpu:scratchSizeGiB."""
    volume = _inventory_volume(inv)
    return int(volume.size_gib if volume and volume.size_gib else settings.scratch_size_gib)


def _scratch_volume(settings: StackConfig, inv, what_if: float | None) -> tuple[float, int, str]:
    """The shared volume's throughput, IOPS and where they came from: the stack's inventory (what
    the volume got), else its slurm-gpu:scratchThroughputMBps / scratchIops; --scratch-mbps on top."""
    volume = _inventory_volume(inv)
    if volume and volume.throughput_mbps:
        mbps, iops, where = float(volume.throughput_mbps), int(volume.iops or 0), "the stack's inventory"
    else:
        mbps, iops = float(settings.scratch_throughput_mbps), settings.scratch_iops
        where = "slurm-gpu:scratchThroughputMBps" if mbps != GP3_BASE_MBPS else "gp3 baseline"
    if what_if is not None:
        mbps, where = what_if, "--scratch-mbps"
    return mbps, max(iops, gp3_min_iops(mbps)), where


# ---------------------------------------------------------------- `fab estimate` and `fab train`


def load_inventory(target: str, stack: str | None):
    """The target's inventory where it can be read without a host (None where it cannot, e.g. no Pulumi CLI)."""
    from cluster import targets
    from cluster.inventory import InventoryError

    try:
        return targets.load(target, stack)
    except InventoryError:
        return None


def for_run(opts, inv, gpu_instance_type=None, region=None, model_gb=None, tokens_per_row=None,
            scratch_mbps=None) -> Estimate:
    """The estimate of `fab train` with these options (ops.actions.options.TrainOptions) on this cluster."""
    cl = cluster_for(opts.target, opts.stack, inv, opts.nodes, opts.gpus_per_node, gpu_instance_type, region,
                     scratch_mbps)
    tokens = _positive("tokens-per-row", tokens_per_row, float)
    if tokens is None and cl.calibrated:
        tokens = _json("local.json")["tokens_per_row"]  # training.make_tiny's rows, not Alpaca's
    job = job_from_config(opts.config, opts.model_path, opts.data_path, opts.examples,
                          _positive("model-gb", model_gb, float), tokens)
    return estimate(cl, job)


def print_for_run(opts, inv, *args, say=print) -> Estimate:
    """`fab estimate` / `fab train --estimate`: the table for this run (one column locally)."""
    result = for_run(opts, inv, *args)
    for line in lines(result, ("again",) if result.cluster.calibrated else SCENARIOS):
        say(line)
    return result


def scenario_for(runs: Path, cluster_name: str) -> str:
    """'again' when this machine brought home a run of this cluster before, else 'first'."""
    for path in runs.glob("*/timeline.json"):
        try:
            if json.loads(path.read_text()).get("cluster") == cluster_name:
                return "again"
        except (OSError, ValueError):
            continue
    return "first"
