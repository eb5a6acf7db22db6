"""Rendering the sbatch scripts in jobs/ (Jinja2, StrictUndefined).

`fab train` renders them on the user's machine from the inventory and its options,
then uploads the result: what runs on the cluster is a plain, readable file.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jinja2

from cluster import targets
from cluster.inventory import Inventory
from cluster.platform import AWS
from cluster.shell_quote import shell_quote
from training import protocol, requeue

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"
FINETUNE_NAME = "slurm-gpu-finetune"
SANITY_NAME = "slurm-gpu-sanity"
NETCHECK_NAME = "slurm-gpu-netcheck"
MERGE_NAME = "slurm-gpu-merge"
MERGE_PROGRAM = JOBS_DIR / "merge_adapters.py"  # uploaded beside the rendered script
NETCHECK_PROGRAM = JOBS_DIR / "allreduce_check.py"  # uploaded beside the rendered script
# In each job's folder, the folders the job writes (slurm.make_job_dir gives them to the job user).
WORK = "work"
OUTPUT = "output"
RDZV_PORT = 29500
MAX_RESTARTS = 3
# Spot requeues lose at most a step each; this bound only stops a loop that would never end.
MAX_SPOT_REQUEUES = 20

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(JOBS_DIR)),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    autoescape=False,
)
_env.filters["shquote"] = shell_quote


@dataclass(frozen=True)
class JobSpec:
    """Everything a job template may use; nothing else reaches it (the platform as facts, not its name)."""

    # Real GPUs that nvidia-smi lists (else stand-in files at device_prefix N).
    real_gpus: bool
    # Ranks talk NCCL through the aws-ofi-nccl EFA plugin (else gloo on CPU, Hub offline).
    nccl_efa: bool
    cluster_name: str
    job_name: str
    nodes: int
    gpus_per_node: int
    gpu_type: str
    nvlink: bool
    python: str
    scratch: str
    log_dir: str
    job_dir: str  # the job's code, config and script: the admin user's, read-only to the job
    work_dir: str  # what the job writes besides its output: rendezvous files, results (the job user's)
    script_path: str = ""
    config: str = ""
    output_dir: str = ""
    train_args: tuple[str, ...] = field(default_factory=tuple)  # already shell-quoted
    device_prefix: str = AWS.gpu_device_prefix
    rdzv_port: int = RDZV_PORT
    max_restarts: int = MAX_RESTARTS
    max_spot_requeues: int = MAX_SPOT_REQUEUES
    gpu_sample_s: int = 5  # GPU telemetry: seconds between nvidia-smi samples on each node
    time_limit: str = ""
    # The GPU nodes' torch has a libuv TCPStore (torchrun's c10d rendezvous needs one); else the
    # job rendezvous statically (Platform.os_torch.libuv: Debian's torch in the boot test).
    torch_libuv: bool = True


def torch_libuv(inv: Inventory) -> bool:
    """Whether the GPU nodes' torch has a libuv TCPStore: all but an OS torch built without it."""
    os_torch = inv.facts.platform.os_torch
    return os_torch is None or os_torch.libuv


def base_spec(inv: Inventory, job_name: str, nodes: int, gpus_per_node: int, job_dir: str, **kw) -> JobSpec:
    target = targets.of(inv)
    return JobSpec(
        real_gpus=target.real_gpus, nccl_efa=target.nccl_efa,
        cluster_name=inv.cluster_name, job_name=job_name, nodes=nodes, gpus_per_node=gpus_per_node,
        gpu_type=inv.gpu_type, nvlink=inv.nvlink, python=inv.python, scratch=inv.scratch,
        log_dir=f"{inv.scratch}/logs", job_dir=job_dir, work_dir=f"{job_dir}/{WORK}",
        device_prefix=inv.gpu_device_prefix, torch_libuv=torch_libuv(inv), **kw,
    )


def train_flags(flags: dict[str, object]) -> tuple[str, ...]:
    """{"model_name_or_path": "/x y"} -> ("--model_name_or_path '/x y'",) in a stable order."""
    return tuple(f"--{k} {shlex.quote(str(v))}" for k, v in flags.items() if v is not None)


def context(spec: JobSpec) -> dict:
    """The spec, the job protocol's names (training/protocol.py: `tags.JOB`, `markers.COMPLETED`) and the
    requeue policy's "go on and train" status (training/requeue.py)."""
    return {**asdict(spec), **protocol.template_context(), "requeue_continue": requeue.CONTINUE}


def render(template: str, spec: JobSpec) -> str:
    return _env.get_template(template).render(**context(spec))


def render_finetune(spec: JobSpec) -> str:
    return render("finetune.sbatch.j2", spec)


def render_sanity(spec: JobSpec) -> str:
    return render("sanity.sbatch.j2", spec)


def render_netcheck(spec: JobSpec, sizes: tuple[int, ...], budget_s: float, gloo_ifname: str | None) -> str:
    """The network check's script; `gloo_ifname`: the interface gloo must use (None: gloo's own choice)."""
    return _env.get_template("netcheck.sbatch.j2").render(
        **context(spec), sizes=",".join(str(s) for s in sizes), budget_s=budget_s, gloo_ifname=gloo_ifname or "")


def render_merge(spec: JobSpec, adapters: str) -> str:
    """`fab merge`'s script: the adapters in `adapters` merged into their base model, into spec.output_dir."""
    return _env.get_template("merge.sbatch.j2").render(**context(spec), adapters=adapters)
