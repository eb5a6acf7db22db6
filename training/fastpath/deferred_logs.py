"""Logs that do not stop the GPU: a logging step's values are read one step later (`defer_logs: true`).

A logging step's loss, gradient norm and token accuracy are copied to the host behind that step's kernels
(under DDP after one all-reduce of every rank's loss, hits, scored tokens and flos, queued like the step's
gradient all-reduce) and written at the next step, once the GPU has them. The Trainer's own log reads them at
once (.item(); under DDP also its flos gather), which waits for every kernel queued and leaves the GPU idle
while the host prepares the next step: at logging_steps=1, every step. A checkpoint, an evaluation or the
run's end writes the pending log at once (so does an epoch's end: one more call). Log history and train_loss
are the Trainer's. Private Trainer methods overridden here: training/fastpath/trainer.py, PRIVATE_OVERRIDES.
"""

from __future__ import annotations

import torch


class DeferredLogs:
    """Mixin for PackedSFTTrainer (before SFTTrainer among the bases); `defer_logs` False: the Trainer's log."""

    defer_logs = True
    _pending_log: dict | None = None
    _log_accuracy: float | None = None  # set while a deferred log is written

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                 start_time, learning_rate=None):
        """See the module docstring."""
        if not self.defer_logs:
            return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch,
                                                    ignore_keys_for_eval, start_time, learning_rate)
        log_now = self.control.should_log and self.state.global_step > self._globalstep_last_logged
        self._write_pending_log()  # the previous logging step's (its on_log clears should_log)
        if log_now:
            self._snapshot_log(tr_loss, grad_norm, learning_rate, start_time)
        if self.control.should_save or self.control.should_evaluate or self.control.should_training_stop:
            self._write_pending_log()
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                                start_time, learning_rate)


    def _finalize_training(self, *args, **kwargs):
        self._write_pending_log()  # before the Trainer sums train_loss
        return super()._finalize_training(*args, **kwargs)

    def _snapshot_log(self, tr_loss, grad_norm, learning_rate, start_time) -> None:
        """Queue a copy of the step's values to the host (pinned memory, an event marks it done), reset
        the accumulators as the Trainer's log does, and keep the host numbers of the log. Under DDP the
        ranks' loss (mean), hits, scored tokens and flos (sums) are all-reduced first, in the stream."""
        device = tr_loss.device
        hits = self._correct if self._correct is not None else torch.zeros((), device=device)
        values = torch.stack([tr_loss.detach().double(), hits.detach().double().to(device)])
        distributed = self.args.world_size > 1 and torch.distributed.is_initialized()
        if distributed:
            counts = torch.tensor([float(self._scored), float(self.current_flos)], dtype=torch.float64,
                                  pin_memory=values.is_cuda).to(device, non_blocking=True)
            values = torch.cat([values, counts])
            torch.distributed.all_reduce(values)  # NCCL: queued, the host does not wait for it
            values[0] /= self.args.world_size  # the Trainer's gather + mean
            self.current_flos = 0  # its sum over the ranks is added to total_flos when written
        else:
            self.store_flos()
        if torch.is_tensor(grad_norm):  # the same on every rank; a host number (or None) stays on the host
            values = torch.cat([values, grad_norm.detach().double().reshape(1).to(device)])
        tr_loss -= tr_loss  # after the copy above, in stream order
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        host.copy_(values, non_blocking=True)
        event = None
        if values.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending_log = {
            "host": host, "event": event, "distributed": distributed,
            "scored": None if distributed else self._scored,  # under DDP: the reduced sum in host
            "grad_norm": None if torch.is_tensor(grad_norm) else grad_norm,
            "steps": self.state.global_step - self._globalstep_last_logged,
            "learning_rate": learning_rate if learning_rate is not None else self._get_learning_rate(),
            "global_step": self.state.global_step, "epoch": self.state.epoch, "start_time": start_time}
        self._correct, self._scored = None, 0
        self._globalstep_last_logged = self.state.global_step

    def _write_pending_log(self) -> None:
        pending, self._pending_log = self._pending_log, None
        if pending is None:
            return
        if pending["event"] is not None:
            pending["event"].synchronize()  # this log's step only, not the steps queued after it
        loss_sum, hits, *rest = pending["host"].tolist()
        scored = pending["scored"]
        if pending["distributed"]:
            scored, flos, *rest = rest
            self.state.total_flos += flos
        logs = {"loss": loss_sum / pending["steps"]}
        norm = rest[0] if rest else pending["grad_norm"]
        if norm is not None:
            logs["grad_norm"] = norm
        logs["learning_rate"] = pending["learning_rate"]
        self._total_loss_scalar += loss_sum
        # the log is the logging step's (step, epoch), as the Trainer would have written it then
        step, epoch = self.state.global_step, self.state.epoch
        self.state.global_step, self.state.epoch = pending["global_step"], pending["epoch"]
        self._log_accuracy = hits / scored if scored else float("nan")
        try:
            self.log(logs, pending["start_time"])
        finally:
            self.state.global_step, self.state.epoch, self._log_accuracy = step, epoch, None

