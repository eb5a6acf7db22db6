"""The fast training path: padding-free batches with per-example attention (flex attention).

The seed's recipe pads every micro-batch of 2 examples to its longer one, recomputes activations
(gradient checkpointing) and runs 8 small micro-batches per optimizer step; on a GPU that leaves
the card mostly idle. This path keeps the optimizer semantics (the same examples in the same order,
the same examples per optimizer step, the same learning rate and schedule) and changes only how a
step's examples reach the GPU:

- all examples of one optimizer step are concatenated into one row (no padding between them);
  `position_ids` restart at 0 for each example and a per-token document id feeds a flex-attention
  BlockMask (same document AND causal), so no token ever attends to another example;
- the row is split into micro-batches only when it exceeds `token_budget` tokens (a memory guard);
- the loss is the completion-only mean over the step's tokens, through TRL's fused LM head
  (log-probabilities of the valid positions in vocabulary tiles; no full fp32 logits), with no
  per-step metric that needs another pass over the vocabulary;
- no gradient checkpointing, and the decoder layers are compiled (torch.compile) on a GPU.

`training/train.py` uses it by default when a GPU is present (`flex_packing` unset): it calls
`prepare_args` and builds `PackedSFTTrainer` with `make_collator`'s collator.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


def _default_attention() -> str:
    # flex attention has no backward on CPU (torch 2.13): there the packed row uses SDPA with the same
    # document mask as a dense boolean tensor (exact, fine for small models).
    return "flex_attention" if torch.cuda.is_available() else "sdpa"


ATTN_IMPLEMENTATION = _default_attention()
# flex attention works on 128-token blocks: the packed row is padded up to a multiple of this.
PAD_MULTIPLE = 128
# Largest packed micro-batch in tokens; a step with more tokens runs as several micro-batches.
DEFAULT_TOKEN_BUDGET = 16384


# ---------------------------------------------------------------- batches

def pack_examples(examples: list[dict[str, Any]], pad_token_id: int, pad_to_multiple_of: int = PAD_MULTIPLE
                  ) -> dict[str, torch.Tensor | int]:
    """Concatenate tokenized examples (`input_ids`, optional `labels` with -100 on ignored tokens) into
    one row of shape [1, T]: input_ids, labels, position_ids (restarting per example) and document_ids
    (the example's index; padding at the end is a document of its own and has label -100).

    The first token of each example gets label -100: it is never a target (the model shifts labels by
    one), and it keeps the last token of one example from predicting the first of the next.
    """
    ids, labels, positions, docs = [], [], [], []
    for i, ex in enumerate(examples):
        x = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        y = torch.as_tensor(ex.get("labels", ex["input_ids"]), dtype=torch.long).clone()
        if x.numel() == 0:
            continue
        y[0] = -100
        ids.append(x)
        labels.append(y)
        positions.append(torch.arange(x.numel(), dtype=torch.long))
        docs.append(torch.full((x.numel(),), i, dtype=torch.int32))
    n_real = sum(x.numel() for x in ids)
    total = -(-max(n_real, 1) // pad_to_multiple_of) * pad_to_multiple_of
    pad = total - n_real
    if pad:
        ids.append(torch.full((pad,), pad_token_id, dtype=torch.long))
        labels.append(torch.full((pad,), -100, dtype=torch.long))
        positions.append(torch.arange(pad, dtype=torch.long))
        docs.append(torch.full((pad,), len(examples), dtype=torch.int32))
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None],
        "document_ids": torch.cat(docs)[None],
        "num_real_tokens": n_real,
    }


def split_by_token_budget(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group example indices, in order, into runs of at most `token_budget` tokens (an example longer
    than the budget gets a group of its own)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


@dataclass
class PackedCollator:
    """Collate one optimizer step's examples into packed micro-batches of at most `token_budget` tokens.

    Output: `labels` (the whole step's packed labels, which the Trainer counts to normalise the loss
    over the step), `micro_batches` (a list of `pack_examples` dicts), `num_real_tokens` and
    `example_lengths` (plain ints, for throughput accounting without a device sync).
    """

    pad_token_id: int
    token_budget: int = DEFAULT_TOKEN_BUDGET
    pad_to_multiple_of: int = PAD_MULTIPLE

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(ex["input_ids"]) for ex in examples]
        groups = split_by_token_budget(lengths, self.token_budget)
        micro = [pack_examples([examples[i] for i in g], self.pad_token_id, self.pad_to_multiple_of)
                 for g in groups]
        labels = torch.cat([m["labels"] for m in micro], dim=1)
        return {"labels": labels, "micro_batches": micro, "num_real_tokens": sum(lengths),
                "example_lengths": lengths}


def make_collator(tokenizer, train_args) -> PackedCollator:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PackedCollator(pad_token_id=pad, token_budget=getattr(train_args, "token_budget", None)
                          or DEFAULT_TOKEN_BUDGET)


# ---------------------------------------------------------------- attention mask

def document_block_mask(document_ids: torch.Tensor):
    """A flex-attention BlockMask for a packed row [1, T]: token q sees token k iff both belong to the
    same document and k <= q. Blocks between documents are skipped entirely by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids[0]
    length = doc.shape[0]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(same_document_causal, 1, None, length, length, device=doc.device,
                             _compile=doc.device.type == "cuda")


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The same mask as `document_block_mask`, as a [1, 1, T, T] boolean tensor (True = may attend),
    for attention kernels without BlockMask support (SDPA, eager)."""
    doc = document_ids[0]
    pos = torch.arange(doc.shape[0], device=doc.device)
    return ((doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :]))[None, None]


def attention_mask_for(model, document_ids: torch.Tensor):
    """BlockMask for flex attention, a dense boolean mask for any other attention implementation."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "flex_attention":
        return document_block_mask(document_ids)
    return dense_document_mask(document_ids)


# ---------------------------------------------------------------- arguments and model

def prepare_args(train_args):
    """Turn the seed's step layout (per_device_batch x accumulation) into one packed step per optimizer
    step: the same examples per optimizer step, no gradient checkpointing. Mutates and returns."""
    per_step = train_args.per_device_train_batch_size * train_args.gradient_accumulation_steps
    train_args.per_device_train_batch_size = per_step
    train_args.gradient_accumulation_steps = 1
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(train_args, name, None):
            setattr(train_args, name, False)
    # The packed row is not a padded batch: TRL's own padding-free handling must stay out of the way.
    if getattr(train_args, "padding_free", False):
        train_args.padding_free = False
    # Keep the prepared columns (input_ids, labels) for the collator.
    train_args.remove_unused_columns = False
    # No host<->device sync inside a step, so the CPU queues the next step while the GPU works:
    # the Trainer's NaN filter of the logged loss reads the loss every step (a sync), and a blocking
    # copy of the batch waits for the previous step's kernels.
    train_args.logging_nan_inf_filter = False
    train_args.dataloader_pin_memory = True
    config = getattr(train_args, "accelerator_config", None)
    if config is not None and hasattr(config, "non_blocking"):
        config.non_blocking = True
    return train_args


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a (PEFT-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.model.layers)


def compile_layers(model) -> int:
    """torch.compile each decoder block (one graph, reused by every block; shapes become dynamic after
    the first length change, so the varying packed length does not recompile). Returns the count."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 512)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


# ---------------------------------------------------------------- trainer

def _packed_trainer_class():
    from trl import SFTTrainer
    from trl.trainer.utils import add_fused_lm_head

    class PackedSFTTrainer(SFTTrainer):
        """SFTTrainer whose steps are packed rows with a document BlockMask (see the module docstring).

        `compile_model`: None = compile the decoder layers when on a GPU.
        """

        def __init__(self, *args, compile_model: bool | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.config.use_cache = False
            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            # Re-patch the fused LM head to compute the log-probabilities only: SFTTrainer also asks for
            # entropy and top-1 hits, which feed per-step metrics (and a host sync) every step.
            add_fused_lm_head(base, outputs=("log_probs",))
            if compile_model is None:  # TRAINING_COMPILE=0 turns it off (debugging, quick runs)
                compile_model = torch.cuda.is_available() and os.environ.get("TRAINING_COMPILE", "1") != "0"
            self.compiled_layers = compile_layers(self.model) if compile_model else 0
            self.real_tokens_seen = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            block_mask = attention_mask_for(self.model, inputs.pop("document_ids"))
            inputs.pop("num_real_tokens", None)
            outputs = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                            attention_mask=block_mask, labels=inputs["labels"], use_cache=False,
                            fused_lm_head=True)
            valid = (inputs["labels"][:, 1:] != -100).sum()
            denominator = num_items_in_batch if num_items_in_batch is not None else valid
            loss = -outputs.log_probs.sum() / torch.as_tensor(denominator).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                # num_items_in_batch counts every rank's tokens and DDP averages the gradients.
                loss = loss * self.accelerator.num_processes
            return (loss, outputs) if return_outputs else loss

        def training_step(self, model, inputs, num_items_in_batch=None):
            """One optimizer step's examples: forward + backward over each packed micro-batch."""
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            self.real_tokens_seen += int(inputs.get("num_real_tokens", 0))
            micro_batches = self._prepare_inputs(inputs)["micro_batches"]
            total = None
            for i, micro in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                # Under DDP every rank all-reduces once per step, whatever its number of micro-batches.
                sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
                with sync:
                    with self.compute_loss_context_manager():
                        loss = self.compute_loss(model, micro, num_items_in_batch=num_items_in_batch)
                    self.accelerator.backward(loss)
                total = loss.detach() if total is None else total + loss.detach()
            return total

        def log(self, logs, start_time=None):
            self._metrics["train" if self.model.training else "eval"].pop("num_tokens", None)
            super().log(logs, start_time)

    return PackedSFTTrainer


def __getattr__(name: str):
    # Imported lazily so that `import training.packing` stays cheap (train.py checks for the module).
    if name == "PackedSFTTrainer":
        cls = _packed_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
