"""The end-of-run summary and the loss curve.

Numbers come from the run's own metrics.json (or its SLURM_GPU_METRICS line when the
file is missing) and trainer_state.json; the NCCL picture from the job log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ops import nccl
from ops.joblog import JobLog


@dataclass
class RunSummary:
    job_id: str
    slurm_runtime: str
    metrics: dict
    losses: list[tuple[int, float]]  # (step, loss) from the log history
    nccl: nccl.NcclPicture
    restarts: int = 0
    resumed_from: int | None = None
    network: str | None = None  # the network check's line (ops/netcheck.py), when it ran

    def value(self, key: str):
        return self.metrics.get(key)

    @property
    def first_loss(self) -> float | None:
        return self.losses[0][1] if self.losses else self.value("first_loss")

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else self.value("last_loss")

    def lines(self, expect_efa: bool = False) -> list[str]:
        m = self.metrics
        runtime = m.get("train_runtime")
        out = [f"job {self.job_id}: completed"]
        out.append(f"  runtime       {_num(runtime, '.1f')} s training" +
                   (f", {self.slurm_runtime} in Slurm" if self.slurm_runtime else ""))
        out.append(f"  steps         {m.get('train_steps', len(self.losses))}"
                   + (f" (world size {m['world_size']})" if m.get("world_size") else ""))
        out.append(f"  loss          {_num(self.first_loss, '.4f')} first -> {_num(self.last_loss, '.4f')} last"
                   + (f" (train_loss {_num(m.get('train_loss'), '.4f')})" if m.get("train_loss") is not None else ""))
        out.append(f"  token acc     {_num(m.get('mean_token_accuracy'), '.3f')}")
        out.append(f"  tokens/s      {_num(m.get('tokens_per_s'), ',.0f')}")
        if self.restarts:
            out.append(f"  requeued      {self.restarts} time(s); resumed from step {self.resumed_from}")
        if self.network:
            out.append(f"  network       {self.network}")
        out.append(f"  NCCL          {self.nccl.describe()}")
        out.extend(f"  warning       {w}" for w in self.nccl.warnings(expect_efa))
        return out


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "n/a"


def loss_history(trainer_state: dict | None, log: JobLog | None = None) -> list[tuple[int, float]]:
    """(step, loss) pairs: trainer_state's log_history, else the steps seen in the log."""
    hist = (trainer_state or {}).get("log_history") or []
    pairs = [(int(h.get("step", i + 1)), float(h["loss"])) for i, h in enumerate(hist) if "loss" in h]
    if not pairs and log is not None:
        pairs = [(int(s.get("step", i + 1)), float(s["loss"])) for i, s in enumerate(log.steps)]
    return pairs


def build(job_id: str, slurm_runtime: str, log: JobLog, run_dir: Path | None) -> RunSummary:
    metrics, state = dict(log.metrics or {}), None
    if run_dir is not None:
        if (run_dir / "metrics.json").exists():
            metrics = json.loads((run_dir / "metrics.json").read_text())
        if (run_dir / "trainer_state.json").exists():
            state = json.loads((run_dir / "trainer_state.json").read_text())
    if state is None and metrics.get("log_history"):
        state = {"log_history": metrics["log_history"]}
    if "train_steps" not in metrics and state and "global_step" in state:
        metrics["train_steps"] = state["global_step"]
    return RunSummary(job_id=job_id, slurm_runtime=slurm_runtime, metrics=metrics,
                      losses=loss_history(state, log), nccl=nccl.parse(log.nccl_lines),
                      restarts=log.restarts, resumed_from=log.resumed_from)


def plot_loss(losses: list[tuple[int, float]], path: Path, title: str) -> Path | None:
    """Write the loss curve as a PNG (None when there is nothing to plot)."""
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, values = zip(*losses, strict=False)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, values, marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
