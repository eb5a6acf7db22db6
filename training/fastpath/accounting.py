"""What the packed trainer counts: floating point operations and top-1 token accuracy.

The Trainer's flos estimate looks for input_ids at the top of a batch and counts 0 for a packed one; the
accuracy is folded into the LM head's tiles (model.add_packed_lm_head) and summed on the GPU, read only when a
log is written.
"""

from __future__ import annotations

import math

import torch


class TokenAccounting:
    """Mixin for PackedSFTTrainer (before SFTTrainer among the bases)."""

    _correct = None  # device tensor: top-1 hits since the last log
    _scored = 0  # targets since the last log (host int)
    _flos_parameters: int | None = None
    _log_accuracy: float | None = None  # a deferred log's accuracy (deferred_logs.py), while it is written

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's estimate (6 x tokens x non-embedding parameters) over a packed step's
        micro-batches; its own looks for input_ids at the top of the batch and counts 0 here."""
        micro_batches = inputs.get("micro_batches") if isinstance(inputs, dict) else None
        if micro_batches is None or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._flos_parameters is None:  # counted once: the host is ahead of the GPU, keep it there
            self._flos_parameters = self.model.num_parameters(exclude_embeddings=True)
        return 6 * sum(m["input_ids"].numel() for m in micro_batches) * self._flos_parameters


    def log(self, logs, start_time=None):
        self._metrics["train" if self.model.training else "eval"].pop("num_tokens", None)
        if "loss" in logs:  # every rank logs the same steps: the all-reduce below meets
            accuracy = self._log_accuracy if self._log_accuracy is not None else self._token_accuracy()
            if accuracy is not None and not math.isnan(accuracy):  # nan: a deferred log scored nothing
                logs["mean_token_accuracy"] = accuracy
        super().log(logs, start_time)


    def _token_accuracy(self) -> float | None:
        """Top-1 hits / scored tokens since the last log, over all ranks (read at log time only)."""
        device = self.args.device
        hits = self._correct.float() if self._correct is not None else torch.zeros((), device=device)
        counts = torch.stack([hits.to(device), torch.tensor(float(self._scored), device=device)])
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        self._correct, self._scored = None, 0
        hits, scored = counts.tolist()
        return hits / scored if scored else None
