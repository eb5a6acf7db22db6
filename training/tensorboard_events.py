"""TensorBoard events of a run, beside the ones Transformers' TensorBoardCallback writes (report_to).

The callback logs every logged step (train/loss, train/learning_rate, train/grad_norm, eval/loss when
evaluating every N steps, ...) into output_dir/tensorboard (TENSORBOARD_LOGGING_DIR); at the end rank 0 adds
what the callback never sees: the base model's and the tuned model's held-out numbers, the throughput and
each phase of this run (seconds), through the same SummaryWriter the callback uses (tensorboard's, else
tensorboardX's: transformers/integrations/integration_utils.py, TensorBoardCallback).
"""

from __future__ import annotations

import os

LOG_DIR = "tensorboard"


def enabled(train_args) -> bool:
    report_to = train_args.report_to or []
    return "tensorboard" in ([report_to] if isinstance(report_to, str) else report_to)


def use_log_dir(train_args) -> str:
    """Point the callback at output_dir/tensorboard (what `fab train` brings home), read when it is made."""
    os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(train_args.output_dir, LOG_DIR)
    return os.environ["TENSORBOARD_LOGGING_DIR"]


def _writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from tensorboardX import SummaryWriter
    return SummaryWriter(log_dir=log_dir)


def phase_seconds(phases: list[dict]) -> dict[str, float]:
    """Rank 0's phases as seconds per name (checkpoints summed)."""
    out: dict[str, float] = {}
    for item in phases:
        out[item["name"]] = out.get(item["name"], 0.0) + item["end"] - item["start"]
    return out


def write_run_scalars(log_dir: str, metrics: dict) -> None:
    step = int(metrics.get("train_steps") or 0)
    writer = _writer(log_dir)
    try:
        evaluation = metrics.get("eval") or {}
        for which, at in (("base", 0), ("tuned", step)):
            result = evaluation.get(which)
            if result:
                writer.add_scalar(f"eval/{which}_loss", result["loss"], at)
                writer.add_scalar(f"eval/{which}_token_accuracy", result["token_accuracy"], at)
        if metrics.get("tokens_per_s") is not None:
            writer.add_scalar("throughput/tokens_per_s", metrics["tokens_per_s"], step)
        if metrics.get("train_runtime") is not None:
            writer.add_scalar("throughput/train_runtime_s", metrics["train_runtime"], step)
        for name, seconds in phase_seconds((metrics.get("phases") or [{}])[0].get("phases", [])).items():
            writer.add_scalar(f"phases/{name}_s", seconds, step)
    finally:
        writer.close()
