"""The nodes' GPU telemetry as TensorBoard events, beside the run's own, so `tensorboard --logdir runs` shows it.

Reads the nvidia-smi samples the job script's sampler wrote (gpus-<node>.csv, jobs/finetune.sbatch.j2) once the
run is home, and writes utilisation, memory and power per node and GPU into runs/<job>/tensorboard/gpus/: a
TensorBoard run of its own, so its steps (seconds since the job's first sample) never mix with the training's
optimizer steps in one event stream; each event keeps its sample's wall time, so TensorBoard's "Wall" axis
lines the GPUs up with the training curves. No samples (the local cluster's stand-in GPUs, a run whose nodes
have no nvidia-smi): no events at all, not zeros. Written with tensorboardX's SummaryWriter (a pinned
dependency), as Transformers' TensorBoardCallback falls back to it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ops.finetune.summary import read_gpu_samples

SUBDIR = "gpus"  # under the run's tensorboard/ directory
# tag prefix -> field of a sample (seconds, index, utilisation %, memory MiB, power W)
METRICS = {"gpu_utilization_pct": 2, "gpu_memory_used_mib": 3, "gpu_power_w": 4}


def tags(node: str, index: int) -> list[str]:
    return [f"{metric}/{node}/gpu{index}" for metric in METRICS]


def write(run_dir: Path) -> Path | None:
    """Write the GPU events of `run_dir` (a run brought home) into its tensorboard/gpus/, replacing any written
    before; the directory, or None where there are no samples or the run logged nothing to TensorBoard."""
    board = run_dir / "tensorboard"
    samples = read_gpu_samples(run_dir, relative=False)
    if not samples or not board.is_dir():
        return None
    from tensorboardX import SummaryWriter

    out = board / SUBDIR
    shutil.rmtree(out, ignore_errors=True)  # a second download of the same run writes them afresh
    t0 = min(rows[0][0] for rows in samples.values())
    writer = SummaryWriter(logdir=str(out))
    try:
        for node, rows in sorted(samples.items()):
            for row in rows:
                step = round(row[0] - t0)
                for metric, field in METRICS.items():
                    writer.add_scalar(f"{metric}/{node}/gpu{row[1]}", row[field], step, walltime=row[0])
    finally:
        writer.close()
    return out
