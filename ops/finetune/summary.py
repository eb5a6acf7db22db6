"""The end-of-run summary, the loss curve and the GPUs' plot.

Numbers come from the run's own metrics.json (or its SLURM_GPU_METRICS line when the
file is missing) and trainer_state.json; the NCCL picture from the job log; the GPUs'
utilisation from the nodes' nvidia-smi samples (gpus-<node>.csv, jobs/finetune.sbatch.j2).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from cluster.errors import UserError
from ops.actions import nccl
from ops.finetune.joblog import JobLog


class SummaryError(UserError, ValueError):
    """A record the job wrote (metrics.json, trainer_state.json, the log's metrics line) of the wrong shape."""


# What the summary and `fab runs` read of a job's records (training/outputs.py, train.py, cost_cap.py write
# them), by type: a job can write anything there, so each value is checked before it is used.
_NUMBERS = ("train_runtime", "train_loss", "first_loss", "last_loss", "mean_token_accuracy", "tokens_per_s")
_COUNTS = ("train_steps", "world_size", "train_rows")
_COST_NUMBERS = ("max_usd", "spent_usd", "full_run_usd", "per_hour_usd", "step_s")
_COST_COUNTS = ("stopped_at_step", "max_steps")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 10**15


def _check(rec, where: str, numbers=(), counts=(), texts=(), dicts=(), lists=()) -> dict:
    """`rec` when it is an object whose named keys are missing, null or of their type, else SummaryError."""
    if not isinstance(rec, dict):
        raise SummaryError(f"{where} must be a JSON object, not {type(rec).__name__}: fix or delete that file")
    for keys, ok, what in ((numbers, _is_number, "a finite number"), (counts, _is_count, "a count"),
                           (texts, lambda v: isinstance(v, str), "text"), (dicts, lambda v: isinstance(v, dict),
                                                                         "an object"),
                           (lists, lambda v: isinstance(v, list), "a list")):
        for key in keys:
            if rec.get(key) is not None and not ok(rec[key]):
                raise SummaryError(f"{where}: {key} must be {what}, not {rec[key]!r:.60}: fix or delete that file")
    return rec


def _check_history(history, where: str) -> None:
    for i, h in enumerate(history or []):
        _check(h, f"{where} log_history[{i}]", numbers=("loss",), counts=("step",))


def checked_metrics(metrics, where: str) -> dict:
    """A job's metrics (metrics.json, or the log's SLURM_GPU_METRICS line) with every value the summary reads
    of its type, numbers finite; else SummaryError naming `where`."""
    _check(metrics, where, numbers=_NUMBERS, counts=_COUNTS, texts=("stopped_by",), dicts=("cost", "eval"),
           lists=("samples", "log_history"))
    _check(metrics.get("cost") or {}, f"{where} cost", numbers=_COST_NUMBERS, counts=_COST_COUNTS)
    ev = _check(metrics.get("eval") or {}, f"{where} eval", counts=("rows",), texts=("source",),
                dicts=("base", "tuned"))
    for side in ("base", "tuned"):
        _check(ev.get(side) or {}, f"{where} eval {side}", numbers=("loss", "token_accuracy"))
    for i, sample in enumerate(metrics.get("samples") or []):
        _check(sample, f"{where} samples[{i}]", texts=("prompt", "base", "tuned", "reference"))
        missing = [k for k in ("prompt", "base", "tuned") if sample.get(k) is None]
        if missing:
            raise SummaryError(f"{where} samples[{i}] has no {missing[0]}: fix or delete that file")
    _check_history(metrics.get("log_history"), where)
    return metrics


def checked_state(state, where: str) -> dict:
    """trainer_state.json with its global_step a count and its log_history's steps and losses typed."""
    _check(state, where, counts=("global_step",), lists=("log_history",))
    _check_history(state.get("log_history"), where)
    return state


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SummaryError(f"{path} cannot be read as JSON ({exc}): fix or delete that file") from None


@dataclass
class RunSummary:
    job_id: str
    slurm_runtime: str
    metrics: dict
    losses: list[tuple[int, float]]  # (step, loss) from the log history
    nccl: nccl.NcclPicture
    restarts: int = 0
    resumed_from: int | None = None
    # node -> [(seconds since the first sample, GPU index, utilisation %, memory MiB, power W)]
    gpus: dict[str, list[tuple[float, int, float, float, float]]] = field(default_factory=dict)
    real_gpus: bool = True  # False: the local cluster's stand-in GPUs (nothing to sample)
    dest: Path | None = None  # runs/<job>/ on this machine, once brought home
    network: str | None = None  # the network check's line (ops/actions/netcheck.py), when it ran
    # The summary's last lines: what the stack still bills and how to stop it (ops/cost/still_bills.py).
    closing: list[str] = field(default_factory=list)
    # The data the run trained on: its path on the cluster and content hash (run_home.data_digest), for run.json.
    data: dict | None = None

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
        out.extend(self.cost_lines())
        out.append(f"  loss          {_num(self.first_loss, '.4f')} first -> {_num(self.last_loss, '.4f')} last"
                   + (f" (train_loss {_num(m.get('train_loss'), '.4f')})" if m.get("train_loss") is not None else ""))
        out.append(f"  token acc     {_num(m.get('mean_token_accuracy'), '.3f')}")
        out.extend(self.eval_lines())
        out.append(f"  tokens/s      {_num(m.get('tokens_per_s'), ',.0f')}")
        out.append(f"  GPUs          {self.gpu_line()}")
        if self.restarts:
            out.append(f"  requeued      {self.restarts} time(s); resumed from step {self.resumed_from}")
        if self.network:
            out.append(f"  network       {self.network}")
        out.append(f"  NCCL          {self.nccl.describe()}")
        out.extend(f"  warning       {w}" for w in self.nccl.warnings(expect_efa))
        out.extend(self.closing)
        return out


    def cost_lines(self) -> list[str]:
        """The cost cap's line (`fab train --max-cost`; training/cost_cap.py's keys), when the run had one."""
        cost = self.metrics.get("cost") or {}
        if not cost:
            return []
        cap, spent = f"${_num(cost.get('max_usd'), '.2f')}", f"${_num(cost.get('spent_usd'), '.2f')}"
        if self.metrics.get("stopped_by") != "max_cost":
            return [f"  cost cap      {spent} spent of --max-cost {cap}: the run finished under the cap"]
        return [f"  cost cap      stopped by --max-cost {cap} at step {cost.get('stopped_at_step')} of "
                f"{cost.get('max_steps')} (checkpoint saved, its adapters brought home): {spent} spent; the full "
                f"run would have cost ~${_num(cost.get('full_run_usd'), '.2f')}"]

    def eval_lines(self) -> list[str]:
        ev = self.metrics.get("eval") or {}
        base, tuned = ev.get("base") or {}, ev.get("tuned") or {}
        if not tuned:
            return ["  eval          none (eval_split 0)"]
        out = [f"  eval loss     {_num(base.get('loss'), '.4f')} base -> {_num(tuned.get('loss'), '.4f')} tuned "
               f"({ev.get('source', str(ev.get('rows')) + ' rows')})",
               f"  eval acc      {_num(base.get('token_accuracy'), '.3f')} base -> "
               f"{_num(tuned.get('token_accuracy'), '.3f')} tuned"]
        samples = self.metrics.get("samples") or []
        if samples:
            first = samples[0]
            out.append(f"  sample        {_short(first['prompt'])}")
            out.append(f"    base        {_short(first['base'])}")
            out.append(f"    tuned       {_short(first['tuned'])}")
            out.append(f"    reference   {_short(first.get('reference', ''))}  (all: samples.md)")
        return out

    def gpu_line(self) -> str:
        if not self.gpus:
            return "no GPU metrics (stand-in GPUs)" if not self.real_gpus else "no GPU metrics (no samples)"
        parts = []
        for node, rows in sorted(self.gpus.items()):
            util = sum(r[2] for r in rows) / len(rows)
            parts.append(f"{node} {util:.0f}% busy, {max(r[3] for r in rows) / 1024:.1f} GiB peak")
        return "; ".join(parts) + " (mean utilisation, nvidia-smi)"


def _short(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def read_gpu_samples(run_dir: Path, relative: bool = True) -> dict[str, list[tuple[float, int, float, float, float]]]:
    """The nodes' nvidia-smi samples (timestamp, index, utilization.gpu, memory.used, power.draw; csv,
    noheader, nounits) by node, the time in seconds since the node's first sample (relative=False: since the
    epoch); lines a sampler cut short, or "[N/A]" fields, are skipped."""
    from datetime import UTC, datetime

    out = {}
    for path in sorted(run_dir.glob("gpus-*.csv")):
        rows = []
        for line in path.read_text(errors="replace").splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                # UTC: the sampler runs under TZ=UTC (jobs/finetune.sbatch.j2)
                t = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
                rows.append((t, int(fields[1]), float(fields[2]), float(fields[3]), float(fields[4])))
            except (ValueError, IndexError):
                continue
        if rows:
            t0 = rows[0][0] if relative else 0.0
            out[path.stem.removeprefix("gpus-")] = [(t - t0, *rest) for t, *rest in rows]
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
    """The run's summary from its records; SummaryError (one line naming the record) when one a job wrote is
    of the wrong shape (run_home.finish then summarises without them, `fab runs --job` says which)."""
    metrics, state = dict(checked_metrics(log.metrics or {}, "the job log's SLURM_GPU_METRICS line")), None
    if run_dir is not None:
        if (run_dir / "metrics.json").exists():
            path = run_dir / "metrics.json"
            metrics = checked_metrics(_load(path), str(path))
        if (run_dir / "trainer_state.json").exists():
            path = run_dir / "trainer_state.json"
            state = checked_state(_load(path), str(path))
    if state is None and metrics.get("log_history"):
        state = {"log_history": metrics["log_history"]}
    if "train_steps" not in metrics and state and "global_step" in state:
        metrics["train_steps"] = state["global_step"]
    return RunSummary(job_id=job_id, slurm_runtime=slurm_runtime, metrics=metrics,
                      losses=loss_history(state, log), nccl=nccl.parse(log.nccl_lines),
                      restarts=log.restarts, resumed_from=log.resumed_from,
                      gpus=read_gpu_samples(run_dir) if run_dir is not None else {})


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


def plot_gpus(gpus: dict[str, list[tuple]], path: Path, title: str) -> Path | None:
    """Each GPU's utilisation over the job (None without samples: no plot of nothing)."""
    if not gpus:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for node, rows in sorted(gpus.items()):
        for index in sorted({r[1] for r in rows}):
            mine = [r for r in rows if r[1] == index]
            ax.plot([r[0] for r in mine], [r[2] for r in mine], label=f"{node} GPU {index}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("utilisation %")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
