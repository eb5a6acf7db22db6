"""Checkpoint now: the spot watcher's signals, handled between optimizer steps on every rank.

The GPU node's watcher (bootstrap/spot_watch.py) sends this node's training ranks SIGUSR1 on an interruption
notice (checkpoint, then stop: the job script requeues the job) and SIGUSR2 on a rebalance
recommendation (checkpoint, go on). The handler only sets a flag. At the end of each optimizer step
every rank all-reduces the flags (MAX: one small CPU tensor over gloo, so no GPU sync is added), so
all ranks agree on the step whose checkpoint they write together, also when the signal reached only
some of them or reached them mid-step: the checkpoint is the step in progress, or the next one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

from transformers import TrainerCallback

from training import protocol

log = logging.getLogger(__name__)

NONE, CHECKPOINT, STOP = 0, 1, 2
SIGNALS = {signal.SIGUSR1: STOP, signal.SIGUSR2: CHECKPOINT}
PREFIX = protocol.prefix(protocol.SPOT)  # rank 0's line for `fab train` (ops/finetune/joblog.py)
MARKER = protocol.INTERRUPTED  # in output_dir: the job script requeues the job when it finds it


# What the signals asked since the last step. Module state, so handlers installed at the process's
# start (install(), before data and model loading) keep a notice that comes before the Trainer does:
# the job script's wrapper ignores these signals (torchrun's agent must not die of them), and a
# worker inherits that until it installs its own handlers.
_pending = [NONE]


def _handle(signum, _frame) -> None:
    _pending[0] = max(_pending[0], SIGNALS[signum])


def install() -> None:
    """Handle the watcher's signals from now on (main thread only: Python refuses elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handle)


class CheckpointOnSignal(TrainerCallback):
    """Install it in the main thread (signal handlers live there); one per run."""

    def __init__(self):
        self.stopped_at: int | None = None  # the step whose checkpoint ends the run (a STOP)
        self._group = None
        install()

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A CPU group: on NCCL the flag would otherwise cost a device sync every step.
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def on_train_end(self, args, state, control, **kwargs):
        self._group = None  # no reference left to keep the group's threads alive (train.teardown_process_group)

    def _agreed(self) -> int:
        if self._group is None:
            return _pending[0]
        import torch
        import torch.distributed as dist

        flag = torch.tensor([_pending[0]], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        wanted = self._agreed()
        _pending[0] = NONE
        if wanted == NONE or (state.max_steps and state.global_step >= state.max_steps):
            return control  # nothing asked, or the run ends here anyway
        control.should_save = True
        kind = "interruption" if wanted == STOP else "rebalance"
        if wanted == STOP:
            control.should_training_stop = True
            self.stopped_at = state.global_step
        if state.is_world_process_zero:
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            print(PREFIX + json.dumps({"kind": kind, "step": state.global_step, "checkpoint": checkpoint,
                                       "stop": wanted == STOP}), flush=True)
        return control


def mark_interrupted(output_dir: str, step: int) -> None:
    """Rank 0, after the checkpoint is complete: tell the job script to requeue the job."""
    path = Path(output_dir) / MARKER
    path.write_text(json.dumps({"step": step, "checkpoint": str(Path(output_dir) / f"checkpoint-{step}")}) + "\n")
    log.warning("stopped after the checkpoint of step %d (spot interruption notice); the job requeues", step)
