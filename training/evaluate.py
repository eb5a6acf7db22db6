"""Held-out evaluation: the rows kept out of training, and the loss and token accuracy on them.

`split_eval` holds rows out of the training rows (`eval_split`: a count, a fraction, `auto`, or 0 = off) or
loads a separate file (`eval_dataset_name`). `evaluate` scores them with the model as it stands: the mean
negative log-likelihood over the completion tokens and the share of those tokens the model ranks first,
each prompt's tokens unscored, exactly as training scores them. On the packed path the rows go through the
packed LM head (training/fastpath/), on the padded path through the model's logits: the same tokens, the
same sums, so the two paths' numbers agree to rounding (tests/unit/test_eval_gpu.py). The base model's numbers
come from the same function with the LoRA adapters switched off, before the first step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random

import torch
from transformers import Trainer, TrainerCallback

from training import watchdog
from training.fastpath.batches import split_by_token_budget

log = logging.getLogger("training.train")

# `auto`: this share of the rows, at most AUTO_MAX_ROWS (seconds of evaluation on a GPU node), and none at all
# below AUTO_MIN_TRAIN rows (holding rows out of a handful would starve the training).
AUTO_FRACTION = 0.05
AUTO_MAX_ROWS = 64
AUTO_MIN_ROWS = 20


def eval_row_count(setting: str, n_rows: int) -> int:
    """How many of `n_rows` the setting `eval_split` holds out (a clear error for a bad value)."""
    word = str(setting).strip().lower()
    if word in ("auto", ""):
        return 0 if n_rows < AUTO_MIN_ROWS else max(1, min(AUTO_MAX_ROWS, round(n_rows * AUTO_FRACTION)))
    if word in ("0", "off", "false", "no", "none"):
        return 0
    try:
        value = float(word)
    except ValueError:
        value = -1.0
    if value <= 0 or (value >= 1 and value != int(value)):
        raise ValueError(f"eval_split={setting!r} is not allowed: set eval_split to auto, 0 (off), a number of "
                         f"rows (e.g. 32) or a fraction of the rows below 1 (e.g. 0.05)")
    count = int(value) if value >= 1 else max(1, round(n_rows * value))
    if count >= n_rows:
        raise ValueError(f"eval_split={setting!r} holds out {count} of {n_rows} rows, leaving none to train on: "
                         f"set eval_split lower (or 0 to turn evaluation off)")
    return count


def split_eval(dataset, setting: str, seed: int, eval_source=None):
    """(training rows, held-out rows or None). A separate eval data set (`eval_source`, already loaded)
    takes no training rows; otherwise `eval_split`'s rows, picked with the run's seed (the same on every
    rank), leave the training rows in their order."""
    if eval_source is not None:
        return dataset, eval_source
    count = eval_row_count(setting, len(dataset))
    if not count:
        return dataset, None
    held = set(random.Random(seed).sample(range(len(dataset)), count))
    keep = [i for i in range(len(dataset)) if i not in held]
    return dataset.select(keep), dataset.select(sorted(held))


def micro_batches(lengths: list[int], examples: int, token_budget: int) -> list[list[int]]:
    """Row indices, in order, in groups no larger than one training micro-batch: at most `examples` rows
    and, within those, at most `token_budget` tokens. A group packed only up to the token budget (the
    budget is what the GPU's free memory allows, not what training used) made one row of all the eval rows,
    and its dense document mask and attention scores raised the peak above the training's own."""
    groups = []
    for start in range(0, len(lengths), max(1, examples)):
        chunk = lengths[start:start + max(1, examples)]
        groups += [[start + i for i in g] for g in split_by_token_budget(chunk, token_budget)]
    return groups


def _scores_packed(model, rows: list[dict], pad_token_id: int, token_budget: int, examples: int,
                   device) -> torch.Tensor:
    """[nll sum, top-1 hits, scored tokens] of `rows` through the packed LM head (the fast path), `examples`
    rows (the training's micro-batch) at a time."""
    from training.fastpath.attention import attention_mask_for
    from training.fastpath.batches import pack_examples
    from training.fastpath.model import unwrap

    total = torch.zeros(3, dtype=torch.float64, device=device)
    for group in micro_batches([len(r["input_ids"]) for r in rows], examples, token_budget):
        packed = pack_examples([rows[i] for i in group], pad_token_id)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.items()}
        if not batch["num_targets"]:
            continue
        log_probs, is_top1 = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=attention_mask_for(unwrap(model), batch), use_cache=False,
                                   packed_head=True, target_index=batch["target_index"],
                                   target_ids=batch["target_ids"])
        total += torch.stack([-log_probs.double().sum(), is_top1.double().sum(),
                              torch.tensor(float(batch["num_targets"]), dtype=torch.float64, device=device)])
    return total


def _scores_padded(model, rows: list[dict], collator, batch_size: int, device) -> torch.Tensor:
    """[nll sum, top-1 hits, scored tokens] of `rows` through the model's logits (TRL's padded batches)."""
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for start in range(0, len(rows), batch_size):
        batch = collator(rows[start:start + batch_size])
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device), use_cache=False).logits
        for row_logits, row_labels in zip(logits[:, :-1], labels[:, 1:], strict=True):  # fp32 a row at a time
            scored = row_labels != -100
            picked, targets = row_logits[scored].float(), row_labels[scored]
            nll = torch.nn.functional.cross_entropy(picked, targets, reduction="sum")
            hits = (picked.argmax(-1) == targets).sum()
            total += torch.stack([nll.double(), hits.double(), scored.sum().double()])
    return total


def _eager():
    """Compiled decoder blocks run eagerly here: a no-grad call would compile them a second time."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


def base_model(model):
    """A context in which `model` is the base model: its LoRA adapters switched off (none: as it is)."""
    inner = getattr(model, "module", model)
    return inner.disable_adapter() if hasattr(inner, "disable_adapter") else contextlib.nullcontext()


@torch.no_grad()
def evaluate(trainer, dataset=None) -> dict | None:
    """{"loss", "token_accuracy", "tokens", "rows"} of the held-out rows (`dataset`: the trainer's prepared
    eval_dataset by default), every rank scoring its share (all of them when sharded); a collective: every rank
    calls it."""
    import torch.distributed as dist

    from training.fastpath.batches import PackedCollator

    dataset = trainer.eval_dataset if dataset is None else dataset
    if dataset is None or not len(dataset):
        return None
    model = trainer.model
    model = getattr(model, "module", model)
    args, device = trainer.args, trainer.args.device
    # Sharded (training/sharding.py), a forward is a collective: every rank scores every row, the same forwards.
    sharded = bool(getattr(trainer, "sharded", False))
    world = 1 if sharded else max(1, args.world_size)
    rows = [dataset[i] for i in range(0 if sharded else args.process_index, len(dataset), world)]
    was_training = model.training
    model.eval()
    try:
        with _eager(), trainer.compute_loss_context_manager():
            collator = trainer.data_collator
            if isinstance(collator, PackedCollator):
                total = _scores_packed(model, rows, collator.pad_token_id, collator.token_budget,
                                       args.per_device_train_batch_size, device)
            else:
                total = _scores_padded(model, rows, collator, args.per_device_train_batch_size, device)
    finally:
        model.train(was_training)
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    nll, hits, tokens = total.tolist()
    return {"loss": nll / tokens if tokens else math.nan, "token_accuracy": hits / tokens if tokens else math.nan,
            "tokens": int(tokens), "rows": len(dataset)}


def log_eval(trainer, result: dict, prefix: str = "eval") -> None:
    """`result` into the run's log history and every on_log callback (the step line, TensorBoard's
    eval/loss), through transformers.Trainer.log itself: the SFT trainers' own log would fold the
    training metrics they are accumulating into this line and clear them."""
    Trainer.log(trainer, {f"{prefix}_loss": result["loss"], f"{prefix}_token_accuracy": result["token_accuracy"]})


class EvalEveryCallback(TrainerCallback):
    """Evaluate every `every` optimizer steps (not at the last: the run's final evaluation follows it).
    `trainer` is set once the trainer is built (it takes its callbacks when it is made)."""

    def __init__(self, every: int):
        self.every, self.trainer = every, None

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.trainer is None or not self.every or step % self.every or step >= state.max_steps:
            return
        with watchdog.paused(self.trainer, state):  # the hang watchdog: evaluating is moving, not a slow step
            result = evaluate(self.trainer)
        if result is not None:
            # A deferred log (training/fastpath/deferred_logs.py) of an earlier step goes first: a step
            # logged after a later one makes TensorBoard's reader drop the later steps as orphaned.
            should_log = control.should_log  # this step's own log, due next: on_log clears the flag
            getattr(self.trainer, "_write_pending_log", lambda: None)()
            log_eval(self.trainer, result)
            control.should_log = should_log
