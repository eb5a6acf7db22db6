"""Checkpoints written by a background thread: the training loop waits only for a copy of the state.

The Trainer writes each checkpoint on the training thread: the adapters, the optimizer state (twice the
adapters, fp32), scheduler and RNG states, trainer_state.json, then it deletes checkpoints beyond
save_total_limit. For Qwen3-4B's adapters that is ~140 MB every save_steps (steps 5, 10 and 15 of the baseline
job's 16), on the cluster to the shared /scratch over NFS, while the other ranks wait for rank 0 at the next
step's all-reduce. Here the saving step's state is copied to host memory on the training thread (a
consistent snapshot of that step: the frozen base weights never change, so they are not copied), and one
writer thread writes the files in the Trainer's own formats. trainer_state.json is written last, so a
checkpoint cut short (a node lost, a SIGTERM) has none and the resume skips it
(train.find_resume_checkpoint); old checkpoints are deleted only once the new one is complete. The next
checkpoint and the end of training (also by an error) wait for the writer; a writer's error fails the run.
The writer makes no CUDA call (everything it writes is in host memory), so a CUDA graph being captured on the
training thread meanwhile is not disturbed.

`background_checkpoints: false` in the config keeps the Trainer's own checkpoints; so do the cases this does
not cover (DeepSpeed, FSDP, best-model tracking, pushing to the Hub, hyperparameter search). `_save_checkpoint`
is a private Trainer method: training/fastpath/trainer.py lists it in PRIVATE_OVERRIDES, with why.
"""

from __future__ import annotations

import copy
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def host_copy(obj):
    """`obj` with every tensor copied to host memory (new storage) and containers copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class BackgroundCheckpoints:
    """Mixin for a transformers Trainer (listed before it among the bases)."""

    _checkpoint_writer: ThreadPoolExecutor | None = None
    _checkpoint_pending: Future | None = None

    def _checkpoint_in_background(self, trial) -> bool:
        args = self.args
        return (getattr(args, "background_checkpoints", True) and trial is None and self.hp_search_backend is None
                and not args.push_to_hub
                and not self.is_deepspeed_enabled and not self.is_fsdp_enabled and not self.state.best_global_step
                and args.metric_for_best_model is None)

    def wait_for_checkpoint(self, last: bool = False) -> None:
        """Block until the checkpoint being written is complete; re-raise the writer's error.
        `last`: also end the writer thread."""
        pending, self._checkpoint_pending = self._checkpoint_pending, None
        if last and self._checkpoint_writer is not None:
            self._checkpoint_writer.shutdown(wait=True)
            self._checkpoint_writer = None
        if pending is not None:
            pending.result()

    def _save_checkpoint(self, model, trial):
        self.wait_for_checkpoint()
        if not self._checkpoint_in_background(trial):
            return super()._save_checkpoint(model, trial)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        if hasattr(self, "create_model_card"):  # TRL's SFTTrainer does this before every checkpoint
            hub_id = self.args.hub_model_id
            self.create_model_card(model_name=hub_id.split("/")[-1] if hub_id else Path(self.args.output_dir).name)
        self.store_flos()  # a collective under DDP: on the training thread, every rank
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(output_dir, exist_ok=True)
        if not self.args.save_only_model:
            self._save_scaler(output_dir)
            self._save_rng_state(output_dir)  # small, and per rank: written now
        if not self.args.should_save:
            return

        # The snapshot: the trained parameters copied, the frozen ones as they are (they do not change).
        trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
        model_state = {k: host_copy(v) if k in trained else v for k, v in self.model.state_dict().items()}
        optimizer = None if self.args.save_only_model else host_copy(self.optimizer.state_dict())
        scheduler = None if self.args.save_only_model else copy.deepcopy(self.lr_scheduler.state_dict())
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        state = copy.deepcopy(self.state)
        limit = self.args.save_total_limit

        def write() -> None:
            self._save(output_dir, state_dict=model_state)  # adapters, their config, tokenizer, training args
            if optimizer is not None:
                torch.save(optimizer, os.path.join(output_dir, OPTIMIZER_NAME))
                torch.save(scheduler, os.path.join(output_dir, SCHEDULER_NAME))
            # Last, and whole (renamed into place): its presence marks the checkpoint complete.
            state_file = os.path.join(output_dir, TRAINER_STATE_NAME)
            state.save_to_json(state_file + ".tmp")
            os.replace(state_file + ".tmp", state_file)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)

        if self._checkpoint_writer is None:
            self._checkpoint_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._checkpoint_pending = self._checkpoint_writer.submit(write)

    def train(self, *args, **kwargs):
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            try:  # let the writer finish the checkpoint in flight (the resume wants it), keep the first error
                self.wait_for_checkpoint(last=True)
            except Exception:
                log.exception("writing the last checkpoint failed too")
            raise
        self.wait_for_checkpoint(last=True)
        return result


def with_background_checkpoints(trainer_cls: type) -> type:
    """`trainer_cls` with its checkpoints written in the background (same name, same behaviour otherwise)."""
    return type(trainer_cls.__name__, (BackgroundCheckpoints, trainer_cls), {"__doc__": trainer_cls.__doc__})
