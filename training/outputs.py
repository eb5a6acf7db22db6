"""What a run leaves in output_dir: the resume point it starts from, metrics.json, the COMPLETED marker."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from training import protocol

log = logging.getLogger("training.train")

METRICS_PREFIX = protocol.prefix(protocol.METRICS)
# Written last, after the adapters, trainer_state.json and metrics.json: a requeued instance of a
# job that finished (a node lost after training, e.g. munged killed) sees it and does not retrain.
COMPLETED_MARKER = protocol.COMPLETED


_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def find_resume_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in output_dir (None on a fresh directory).

    Like transformers.trainer_utils.get_last_checkpoint, but skips a checkpoint cut short by a node
    loss: trainer_state.json is written last, so a checkpoint without it is incomplete.
    """
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(m.group(1)), name) for name in os.listdir(output_dir)
        if (m := _CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
        log.warning("skipping incomplete checkpoint %s (no trainer_state.json)", path)
    return None


def dataset_tokens(dataset) -> int:
    """Non-padding tokens in one pass over the prepared (tokenized, truncated) data set, all ranks together."""
    return sum(len(ids) for ids in dataset["input_ids"])


def _backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def collect_metrics(trainer, train_output, start_epoch: float, start_step: int, epoch_tokens: int) -> dict:
    state = trainer.state
    history = state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    accuracies = [h["mean_token_accuracy"] for h in history if "mean_token_accuracy" in h]
    end_epoch = state.epoch or 0.0
    runtime = train_output.metrics.get("train_runtime", 0.0)
    run_tokens = epoch_tokens * (end_epoch - start_epoch)  # processed by this run (after any resume)
    return {
        "train_runtime": runtime,
        "train_steps": state.global_step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "train_loss": train_output.training_loss,
        "mean_token_accuracy": accuracies[-1] if accuracies else None,
        "train_tokens": round(epoch_tokens * end_epoch),
        "tokens_per_s": run_tokens / runtime if runtime else None,
        "world_size": trainer.args.world_size,
        "distributed_backend": _backend(),
        "deferred_logs": bool(getattr(trainer, "defer_logs", False)),  # packed path: logs read a step later
        "resumed_from_step": start_step,
        "epoch": end_epoch,
        "log_history": history,
    }


# Left out of the one-line summaries (the METRICS line, COMPLETED): long lists that only metrics.json keeps.
LONG_KEYS = ("log_history", "phases", "samples")


def summary(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in LONG_KEYS}


def write_metrics(output_dir: str, metrics: dict) -> None:
    path = Path(output_dir) / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=2))
    tmp.replace(path)
    print(METRICS_PREFIX + json.dumps(summary(metrics)), flush=True)


def write_completed(output_dir: str, metrics: dict) -> None:
    """The completion marker (one JSON line of the final metrics), atomically, after everything else."""
    path = Path(output_dir) / COMPLETED_MARKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary(metrics)) + "\n")
    tmp.replace(path)
