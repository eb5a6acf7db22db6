"""Batches of the packed path: one optimizer step's examples concatenated into packed rows.

`pack_examples` makes one row [1, T] with no padding between examples (position_ids restart per example, the
attention keeps examples apart); `PackedCollator` splits a step's examples into such rows of at most
`token_budget` tokens (a memory guard). `packed_shape` computes a row's shape without packing it (the step
graphs plan their buckets from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# flex attention works on 128-token blocks: the packed row is padded up to a multiple of this.
PAD_MULTIPLE = 128
# Largest packed micro-batch in tokens; a step with more tokens runs as several micro-batches.
DEFAULT_TOKEN_BUDGET = 16384


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
        if "completion_mask" in ex and "labels" not in ex:  # TRL's prompt/completion rows
            y[torch.as_tensor(ex["completion_mask"], dtype=torch.bool).logical_not()] = -100
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
    row_labels = torch.cat(labels)
    doc_lengths = [x.numel() for x in ids]  # the padding tail is a document of its own
    offsets = [0]
    for n in doc_lengths:
        offsets.append(offsets[-1] + n)
    # The LM head scores position p against label p + 1 only where that label counts: the positions
    # and their targets are known here, on the host, so the GPU never has to be asked (no sync).
    target_index = (row_labels[1:] != -100).nonzero().flatten()
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": row_labels[None],
        "position_ids": torch.cat(positions)[None],
        "document_ids": torch.cat(docs)[None],
        "target_index": target_index,
        "target_ids": row_labels[1:][target_index],
        "num_real_tokens": n_real,
        "num_targets": int(target_index.numel()),
        # varlen attention: the documents' offsets in the row, and the longest (a host int: no sync)
        "cu_seqlens": torch.tensor(offsets, dtype=torch.int32),
        "max_document_length": max(doc_lengths),
        **attention_indices(doc_lengths),
    }


def example_targets(input_ids, labels=None, completion_mask=None) -> int:
    """Scored positions one example adds to a packed row (pack_examples: labels, else the input ids with
    the prompt masked by completion_mask; never the first token)."""
    if labels is not None:
        return sum(1 for y in labels[1:] if y != -100)
    if completion_mask is not None:
        return sum(1 for m in completion_mask[1:] if m)
    return max(len(input_ids) - 1, 0)


def packed_shape(lengths: list[int], targets: list[int], pad_to_multiple_of: int = PAD_MULTIPLE
                 ) -> tuple[int, int, int, int]:
    """What pack_examples makes of examples with these token and target counts, without packing them:
    (row length, scored positions, entries of cu_seqlens, longest document), as step_graphs.step_shape
    reads them from the packed row; the step graphs plan their buckets from these."""
    docs = [n for n in lengths if n]
    n_real = sum(docs)
    total = -(-max(n_real, 1) // pad_to_multiple_of) * pad_to_multiple_of
    if total > n_real:
        docs.append(total - n_real)  # the padding tail is a document of its own
    return total, sum(t for n, t in zip(lengths, targets, strict=True) if n), len(docs) + 1, max(docs)


def _split_by_length(lengths: list[int]) -> int:
    """Index k into `lengths` (sorted, longest first) that splits the documents into a long group
    [:k] and a short group [k:] with the least padded attention work, B x L^2 summed over groups."""
    best, best_cost = len(lengths), len(lengths) * lengths[0] ** 2
    for k in range(1, len(lengths)):
        cost = k * lengths[0] ** 2 + (len(lengths) - k) * lengths[k] ** 2
        if cost < best_cost:
            best, best_cost = k, cost
    return best


def attention_indices(doc_lengths: list[int], multiple: int = 8) -> dict[str, torch.Tensor]:
    """Indices that lay the packed row's documents out as two padded batches (long and short
    documents), one document per row, for causal SDPA (flash attention on a GPU); and back.

    `attn_gather_long` / `attn_gather_short` [B, L]: the row position of each padded slot (padding
    slots repeat the document's first token: they come after the real ones, so causal attention
    never lets a real token see them). `attn_scatter` [T]: the slot of each row position in the
    two batches, concatenated. Two groups always (one may hold a one-token dummy), so the compiled
    graph sees the same structure every step; their lengths vary (dynamic shapes).
    """
    starts = [0]
    for n in doc_lengths[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(doc_lengths)), key=lambda i: -doc_lengths[i])
    sorted_lengths = [doc_lengths[i] for i in order]
    k = _split_by_length(sorted_lengths)
    groups = [order[:k], order[k:]]
    scatter = torch.empty(sum(doc_lengths), dtype=torch.long)
    gathers, offset = [], 0
    for group in groups:
        width = -(-max([doc_lengths[i] for i in group] or [1]) // multiple) * multiple
        # At least two rows per group (dummy rows repeat token 0; their outputs are never read): a batch
        # of one would make the compiled graph specialise on size 1 and recompile when it changes.
        gather = torch.zeros((max(len(group), 2), width), dtype=torch.long)
        for row, i in enumerate(group):
            n, start = doc_lengths[i], starts[i]
            gather[row, :n] = torch.arange(start, start + n)
            gather[row, n:] = start
            scatter[start:start + n] = torch.arange(offset + row * width, offset + row * width + n)
        gathers.append(gather)
        offset += gather.shape[0] * width
    return {"attn_gather_long": gathers[0], "attn_gather_short": gathers[1], "attn_scatter": scatter}


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
        # A rank whose share of the epoch's last, short step is empty still steps (DDP needs every
        # rank): one padding row with nothing to score.
        groups = split_by_token_budget(lengths, self.token_budget) or [[]]
        micro = [pack_examples([examples[i] for i in g], self.pad_token_id, self.pad_to_multiple_of)
                 for g in groups]
        labels = torch.cat([m["labels"] for m in micro], dim=1)
        return {"labels": labels, "micro_batches": micro, "num_real_tokens": sum(lengths),
                "example_lengths": lengths}


def make_collator(tokenizer, train_args) -> PackedCollator:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PackedCollator(pad_token_id=pad, token_budget=getattr(train_args, "token_budget", None)
                          or DEFAULT_TOKEN_BUDGET)

