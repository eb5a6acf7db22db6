"""The fast training path: padding-free batches with per-example attention (flex attention).

The seed's recipe pads every micro-batch of 2 examples to its longer one, recomputes activations
(gradient checkpointing) and runs 8 small micro-batches per optimizer step; on a GPU that leaves
the card mostly idle. This path keeps the optimizer semantics (the same examples in the same order,
the same examples per optimizer step, the same learning rate and schedule) and changes only how a
step's examples reach the GPU:

- all examples of one optimizer step are concatenated into one row (no padding between them);
  `position_ids` restart at 0 for each example, and the attention sees each example alone: on a GPU
  flash attention's variable-length kernels over the examples' offsets (`packed_varlen`) or a
  flex-attention BlockMask (same document AND causal), on CPU `packed_sdpa`;
- the row is split into micro-batches only when it exceeds `token_budget` tokens (a memory guard);
- the loss is the completion-only mean over the step's tokens, through TRL's fused LM head
  (log-probabilities of the valid positions in vocabulary tiles; no full fp32 logits), with no
  per-step metric that needs another pass over the vocabulary;
- no gradient checkpointing, and the decoder layers are compiled (torch.compile) on a GPU;
- in one process, a compiled run of short steps replays each step as one CUDA graph
  (training/step_graphs.py): such steps are launch-bound.

`training/train.py` uses it by default when a GPU is present (`flex_packing` unset): it calls
`prepare_args` and builds `packed_trainer_class()` (PackedSFTTrainer) with `make_collator`'s collator.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


# The packed row's attention keeps each example to itself. On CPU: packed_sdpa_attention below (each
# example gathered into a padded batch for causal SDPA; flex attention has no backward on CPU).
# On a GPU: packed_varlen_attention, flash attention over the row's documents given by their offsets
# (cu_seqlens), compiled or eager, replayed as step graphs or not, no mask at all; where this torch lacks
# varlen_attn, flex attention with a document BlockMask (compiled blocks) or SDPA with a dense document
# mask (eager). Measured on an H200 (benchmarks/NOTES.md): varlen over flex 1.46x at 2 Alpaca rows a
# step, equal at 16 (less GPU time), 1.06x on long rows (25,317 against 23,961 tokens/s, same run);
# packed_sdpa compiled measured 4.8k tokens/s against flex's 11.7k.
PACKED_SDPA = "packed_sdpa"
PACKED_VARLEN = "packed_varlen"
# TRAINING_ATTENTION=varlen|flex picks the GPU attention (default: varlen where torch has it).
ATTENTION_ENV = "TRAINING_ATTENTION"


def varlen_installed() -> bool:
    """Whether this torch has flash attention's variable-length entry point (torch.nn.attention.varlen)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_available() -> bool:
    return torch.cuda.is_available() and varlen_installed()


def attention_implementation(environ=os.environ) -> str:
    """The attention of the packed path on this machine (see above); TRAINING_ATTENTION picks one on a GPU."""
    choice = environ.get(ATTENTION_ENV, "").strip().lower()
    if choice not in ("", "varlen", "flex"):
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: use varlen or flex (or leave it unset)")
    if not torch.cuda.is_available():
        return PACKED_SDPA
    if choice == "flex" or not varlen_available():
        if choice == "varlen":
            raise ValueError(f"{ATTENTION_ENV}=varlen: this torch ({torch.__version__}) has no "
                             "torch.nn.attention.varlen; leave it unset (flex attention)")
        return "flex_attention"
    return PACKED_VARLEN


# This machine's default (TRAINING_ATTENTION is read, and checked, when a model is loaded).
ATTN_IMPLEMENTATION = attention_implementation({})


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


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for a packed row [1, H, T, D]: gather each document into a padded batch (two of them:
    long and short documents), run causal SDPA (flash attention on a GPU, no mask tensor), scatter
    the outputs back to the row. `attention_mask` = (gather_long, gather_short, scatter). Exact: no
    token attends outside its document. Returns [1, T, H, D] like transformers' attention functions."""
    import torch.nn.functional as F

    if not isinstance(attention_mask, tuple):  # not a packed row (generation, a single sequence)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gather_long, gather_short, scatter = attention_mask
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    rows = [t[0].transpose(0, 1) for t in (query, key, value)]  # [T, H, D]
    outputs = []
    for gather in (gather_long, gather_short):
        b, width = gather.shape
        flat = gather.reshape(-1)
        q, k, v = (x.index_select(0, flat).view(b, width, h, dim).transpose(1, 2)
                   for x, h in zip(rows, (heads, kv_heads, kv_heads), strict=True))
        if kv_heads != heads:  # grouped-query attention: share each KV head among its query heads
            k = k[:, :, None].expand(b, kv_heads, heads // kv_heads, width, dim).reshape(b, heads, width, dim)
            v = v[:, :, None].expand(b, kv_heads, heads // kv_heads, width, dim).reshape(b, heads, width, dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             dropout_p=dropout if module.training else 0.0)
        outputs.append(out.transpose(1, 2).reshape(b * width, heads, dim))
    return torch.cat(outputs).index_select(0, scatter)[None], None


# torch's varlen_attn and the arguments that make it causal with grouped-query heads, across its
# signatures (the oldest: is_causal=; torch 2.11: window_size=(-1, 0) and GQA without asking; the GPU
# nodes' 2.13: window_size=(-1, 0), enable_gqa=): read from the signature, not the version. Set by
# register_packed_attention: module globals, so that a compiled block reads them without tracing an import.
_VARLEN_ATTN = None
_VARLEN_KWARGS: dict[str, Any] = {}


def _load_varlen() -> None:
    global _VARLEN_ATTN, _VARLEN_KWARGS
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    _VARLEN_ATTN, _VARLEN_KWARGS = varlen_attn, kwargs


def packed_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for a packed row [1, H, T, D] through flash attention's variable-length kernels:
    `attention_mask` = (cu_seqlens, max_len), the documents' offsets [N + 1] (int32, on the GPU) and an
    upper bound of their lengths. Causal within each document, nothing across documents, no mask
    tensor and no padding: the kernels skip what lies between documents. Returns [1, T, H, D]."""
    if not isinstance(attention_mask, tuple):  # not a packed row (generation, a single sequence)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("packed_varlen attention has no dropout: set the model's attention_dropout to 0")
    cu_seqlens, max_len = attention_mask
    if not query.is_cuda:  # the same function, one document at a time (CPU tests of this path)
        return varlen_reference(query, key, value, cu_seqlens, scaling), None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = _VARLEN_ATTN(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scaling, **_VARLEN_KWARGS)
    return out[None], None


def varlen_reference(query, key, value, cu_seqlens, scaling=None):
    """packed_varlen_attention's result computed per document with causal SDPA: [1, H, T, D] in,
    [1, T, H, D] out (empty documents allowed). The reference the kernel is checked against."""
    import torch.nn.functional as F

    heads, kv_heads = query.shape[1], key.shape[1]
    out = torch.zeros_like(query.transpose(1, 2))
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        if end <= start:
            continue
        q = query[:, :, start:end]
        k = key[:, :, start:end].repeat_interleave(heads // kv_heads, dim=1)
        v = value[:, :, start:end].repeat_interleave(heads // kv_heads, dim=1)
        out[:, start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling).transpose(1, 2)
    return out


def register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionInterface.register(PACKED_VARLEN, packed_varlen_attention)
    if _VARLEN_ATTN is None and varlen_installed():
        _load_varlen()


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


def attention_mask_for(model, batch: dict[str, Any] | torch.Tensor):
    """What the model's attention takes to keep a packed row's documents apart: the gather/scatter
    indices for packed_sdpa, the document offsets for packed_varlen (each as the per-layer-type mapping
    Qwen3 passes through), a BlockMask for flex attention, a dense boolean mask for any other
    implementation. `batch`: a pack_examples dict (or, for the last two, its document_ids)."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if implementation == PACKED_SDPA:
        indices = (batch["attn_gather_long"], batch["attn_gather_short"], batch["attn_scatter"])
        return {layer_type: indices for layer_type in layer_types}
    if implementation == PACKED_VARLEN:
        varlen = (batch["cu_seqlens"], int(batch["max_document_length"]))
        return {layer_type: varlen for layer_type in layer_types}
    document_ids = batch["document_ids"] if isinstance(batch, dict) else batch
    if implementation == "flex_attention":
        return document_block_mask(document_ids)
    return dense_document_mask(document_ids)


def set_packed_attention(model) -> None:
    """Switch a loaded model to packed_sdpa (the config's attention only selects a function per call)."""
    register_packed_attention()
    unwrap(model).config._attn_implementation = PACKED_SDPA


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
    train_args.dataloader_pin_memory = torch.cuda.is_available()
    config = getattr(train_args, "accelerator_config", None)
    if config is not None and hasattr(config, "non_blocking"):
        config.non_blocking = True
    return train_args


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a (PEFT-wrapped) causal LM."""
    return list(unwrap(model).model.layers)


def unwrap(model):
    """The transformers model under DDP and PEFT wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compile_layers(model) -> int:
    """torch.compile each decoder block: one graph, reused by every block, with the sequence length
    dynamic from the first call (dynamic=True), so a new packed length never recompiles. Returns the count."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 512)
    import torch.fx.experimental._config as fx_config

    # Sizes that happen to be equal in the first step (two groups' widths, say) must not become one
    # symbol: that would recompile the block when they differ.
    fx_config.use_duck_shape = False
    # Every block then gets an input that requires grad, the first one too (its input, the frozen
    # embedding's output, would not): one graph for all 36 blocks instead of a second compile for block 0.
    unwrap(model).enable_input_require_grads()
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


# ---------------------------------------------------------------- compile or not

# Measured on one H200 with Qwen3-4B shapes (benchmarks/NOTES.md); the decision needs only their
# ratios to be about right on other GPUs: the eager step is launch-bound, the compiled step is not.
EAGER_TOKENS_PER_S = 7_800.0     # Alpaca-length rows, 16 per step, dense-mask SDPA, eager blocks
COMPILED_TOKENS_PER_S = 11_700.0  # the same, compiled blocks
COMPILE_COLD_S = 60.0   # dynamo + inductor + triton for one block, forward and backward, empty caches
COMPILE_WARM_S = 15.0   # the same from a warm inductor/triton cache (dynamo still traces); an estimate
CACHE_MARKER = "slurm-gpu-compiled"


def compile_cache_dir() -> Path | None:
    directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(directory) if directory else None


def compile_cache_key(model) -> str:
    """What a compiled block depends on: torch, the GPU, the block's shapes and the adapters."""
    import hashlib

    config = unwrap(model).config
    dims = [getattr(config, k, None) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "model_type")]
    peft_config = getattr(getattr(model, "module", model), "peft_config", None)
    lora = sorted(str(v) for v in peft_config.values()) if isinstance(peft_config, dict) else []
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    text = json.dumps([torch.__version__, gpu, dims, lora])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_cache_warm(model) -> bool:
    directory = compile_cache_dir()
    return bool(directory) and (directory / CACHE_MARKER / compile_cache_key(model)).exists()


def mark_compile_cache(model) -> None:
    directory = compile_cache_dir()
    if directory:
        marker = directory / CACHE_MARKER / compile_cache_key(model)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def choose_compile(tokens: float, cache_warm: bool) -> tuple[bool, str]:
    """Compile the decoder blocks only when it pays for this run's tokens (this rank's share):
    eager time vs compile time + compiled time."""
    eager = tokens / EAGER_TOKENS_PER_S
    compiled = (COMPILE_WARM_S if cache_warm else COMPILE_COLD_S) + tokens / COMPILED_TOKENS_PER_S
    reason = (f"{tokens:,.0f} tokens on this rank: eager ~{eager:.0f} s, compiled ~{compiled:.0f} s "
              f"({'warm' if cache_warm else 'cold'} compile cache)")
    return compiled < eager, reason


def env_switch(var: str, setting: bool | None = None) -> bool | None:
    """The environment variable `var` set to 1/0 (true/false, on/off) forces a switch on/off;
    otherwise `setting` (None = the code decides per run)."""
    env = os.environ.get(var, "").strip().lower()
    if env in ("1", "true", "on"):
        return True
    if env in ("0", "false", "off"):
        return False
    return setting


def compile_setting(setting: bool | None = None) -> bool | None:
    """TRAINING_COMPILE=1/0 forces compiling on/off; otherwise `setting` (None = decide per run)."""
    return env_switch("TRAINING_COMPILE", setting)


# ---------------------------------------------------------------- memory

# Activation memory kept for the backward pass, per token, per (hidden unit x layer): measured ~4 MiB
# per token for Qwen3-4B (2560 x 36) on an H200: 4.8 MiB with 2.3k-token rows, 6.4 MiB with 4.1k-token
# rows (compiled blocks; the LM head buffers grow with it); eager blocks keep more (7.2 MiB).
ACTIVATION_BYTES_PER_UNIT = {"compiled": 80.0, "eager": 112.0, "checkpointed": 8.0}
# The LM head's tiles and fp32 gradient buffers, the allocator's fragmentation, the CUDA context.
MEMORY_RESERVE_BYTES = 2.5 * 2**30


def usable_gpu_bytes() -> float:
    """Memory the process may still take: free memory, within the per-process fraction if one is set."""
    free, total = torch.cuda.mem_get_info()
    cap = total * torch.cuda.get_per_process_memory_fraction()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    return min(free + reserved, cap) - allocated


def token_budget_for(model, mode: str, usable: float | None = None) -> int:
    """Largest packed micro-batch (tokens, a multiple of PAD_MULTIPLE) whose activations fit."""
    config = unwrap(model).config
    per_token = ACTIVATION_BYTES_PER_UNIT[mode] * config.hidden_size * config.num_hidden_layers
    usable = usable_gpu_bytes() if usable is None else usable
    budget = int((usable - MEMORY_RESERVE_BYTES) / per_token) // PAD_MULTIPLE * PAD_MULTIPLE
    return max(0, min(budget, DEFAULT_TOKEN_BUDGET))


# ---------------------------------------------------------------- every example once per epoch

class StepShardSampler:
    """Batches of one rank: each optimizer step takes the next `per_rank x world` examples of a seeded
    permutation and gives rank r its contiguous share; the last, short step is split as evenly as
    possible. Every example once per epoch over all ranks (no padding by repetition, nothing dropped),
    and ceil(N / (per_rank x world)) steps on every rank. Same permutation as accelerate's
    SeedableRandomSampler (randperm seeded with seed + epoch), so one rank sees the order of the
    seed's padded batches."""

    def __init__(self, n: int, per_rank: int, world: int, rank: int, seed: int, shuffle: bool = True):
        self.n, self.per_rank, self.world, self.rank, self.seed, self.shuffle = n, per_rank, world, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.n // (self.per_rank * self.world))

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=generator).tolist()

    def __iter__(self):
        order = self.order()
        # The next pass is the next epoch as soon as this one starts (set_epoch may still choose): the
        # Trainer reads exactly the epoch's steps and never exhausts this generator, so an increment after
        # the loop never ran and every epoch repeated the first one's order.
        self.epoch += 1
        step = self.per_rank * self.world
        for start in range(0, self.n, step):
            chunk = order[start:start + step]
            base, extra = divmod(len(chunk), self.world)
            lo = self.rank * base + min(self.rank, extra)
            yield chunk[lo:lo + base + (self.rank < extra)]


# ---------------------------------------------------------------- LM head

def add_packed_lm_head(model) -> None:
    """`model(..., packed_head=True, target_index=I, target_ids=Y)` returns (log_probs, is_top1) of the
    positions I (flattened row) against Y, through TRL's chunked LM-head kernel (vocabulary tiles, no
    [tokens, vocab] logits). The argmax test is folded into the same tiles, so the token accuracy
    costs no pass over the vocabulary; the positions come from the host, so no GPU sync."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    original_forward = model.forward

    def packed_forward(self, *args, packed_head: bool = False, target_index=None, target_ids=None, **kwargs):
        if not packed_head:
            return original_forward(*args, **kwargs)
        for key in ("labels", "output_attentions", "output_hidden_states", "return_dict"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        hidden = getattr(self, self.base_model_prefix)(*args, **kwargs).last_hidden_state
        lm_head = self.get_output_embeddings()
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
        log_probs, _, _, _, is_top1 = ChunkedLogProbFunction.apply(
            hidden, lm_head.weight, lm_head.bias, target_ids, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
            ("is_top1",))
        return log_probs, is_top1

    import types
    model.forward = types.MethodType(packed_forward, model)


# ---------------------------------------------------------------- trainer

@functools.cache
def packed_trainer_class():
    """PackedSFTTrainer, built on first use: importing TRL stays out of `import training.packing`."""
    from trl import SFTTrainer

    class PackedSFTTrainer(SFTTrainer):
        """SFTTrainer whose steps are packed rows with a document mask (see the module docstring).

        `compile_model`: None = decide per run (choose_compile; TRAINING_COMPILE=1/0 forces it).
        """

        def __init__(self, *args, compile_model: bool | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.config.use_cache = False
            add_packed_lm_head(unwrap(self.model))
            self._lengths: list[int] | None = None
            self.planned_tokens = self._planned_tokens()
            compile_model = compile_setting(compile_model)
            self.cache_warm = compile_cache_warm(self.model)
            if compile_model is None:
                compile_model, self.compile_reason = (False, "no GPU") if not torch.cuda.is_available() else \
                    choose_compile(self.planned_tokens, self.cache_warm)
            else:
                self.compile_reason = "forced by TRAINING_COMPILE or the caller"
            if getattr(unwrap(self.model).config, "_attn_implementation", None) == PACKED_SDPA:
                register_packed_attention()
            if getattr(unwrap(self.model).config, "_attn_implementation", None) in (PACKED_SDPA, "flex_attention"):
                if not compile_model and torch.cuda.is_available():
                    # Eager on a GPU without varlen attention: one SDPA call with a dense document mask
                    # launches far fewer kernels than packed_sdpa's gathers (eager steps are launch-bound)
                    # and flex attention needs compiling; fine for the short runs that skip compiling.
                    unwrap(self.model).config._attn_implementation = "sdpa"
            self.compiled_layers = compile_layers(self.model) if compile_model else 0
            self._set_token_budget()
            log.info("packed path: compile=%s (%s); token budget %d per micro-batch",
                     bool(self.compiled_layers), self.compile_reason, self.data_collator.token_budget)
            self.use_step_graphs = self._decide_step_graphs(compile_model)
            if self.use_step_graphs and isinstance(self.data_collator, PackedCollator) and \
                    getattr(unwrap(self.model).config, "_attn_implementation", None) != "flex_attention":
                self.data_collator.pad_to_multiple_of = 1  # the step graphs pad each row to its bucket
            self.step_graphs = None  # built at the first step, around the model the Trainer steps
            self.real_tokens_seen = 0
            self._correct = None  # device tensor: top-1 hits since the last log
            self._scored = 0  # targets since the last log (host int)
            # A logging step's values are read one step later (_maybe_log_save_evaluate);
            # TRAINING_DEFER_LOGS=0 keeps the Trainer's own log (read at once).
            self.defer_logs = bool(env_switch("TRAINING_DEFER_LOGS", True))
            self._pending_log = None
            self._log_accuracy = None  # set while a deferred log is written
            self._flos_parameters = None  # floating_point_ops

        # ---- data
        def _row_lengths(self) -> list[int]:
            """Each training row's tokens, read once (reading a column materialises all of it)."""
            if self._lengths is None:
                self._lengths = [len(x) for x in self.train_dataset["input_ids"]]
            return self._lengths

        def _planned_tokens(self) -> float:
            """Tokens this rank will train on in this run (after tokenization and truncation)."""
            lengths = self._row_lengths()
            world = max(1, self.args.world_size)
            if self.args.max_steps and self.args.max_steps > 0:
                per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
                return min(self.args.max_steps * per_step, len(lengths) / world) * (sum(lengths) / len(lengths))
            return sum(lengths) * self.args.num_train_epochs / world

        def _set_token_budget(self) -> None:
            collator = self.data_collator
            if not isinstance(collator, PackedCollator) or getattr(self.args, "token_budget", None):
                return
            if not torch.cuda.is_available():
                return
            mode = "compiled" if self.compiled_layers else "eager"
            budget = token_budget_for(self.model, mode)
            longest = self.args.max_length or 1024
            if budget < longest:
                # Not even one row of the maximum length fits: recompute activations in backward.
                unwrap(self.model).gradient_checkpointing_enable({"use_reentrant": False})
                budget = token_budget_for(self.model, "checkpointed")
                log.warning("GPU memory allows no %d-token row without recomputation: activation "
                            "checkpointing on", longest)
            collator.token_budget = max(budget, PAD_MULTIPLE)

        def _decide_step_graphs(self, compiled: bool) -> bool:
            """CUDA graphs of whole steps (training/step_graphs.py): on a GPU, one process, compiled blocks
            (the long runs; a short run would spend its few steps capturing) and short steps (launch-bound;
            AUTO_MAX_MEAN_STEP_TOKENS). TRAINING_CUDA_GRAPHS=1/0 forces it (one process still required)."""
            from training.step_graphs import AUTO_MAX_MEAN_STEP_TOKENS, graphs_setting

            setting = graphs_setting(None)
            # Forced without a GPU: the same bucketed steps, never captured (how tests check the path).
            possible = max(1, self.args.world_size) == 1 and (torch.cuda.is_available() or setting is True)
            lengths = self._row_lengths()
            step_tokens = sum(lengths) / max(len(lengths), 1) * self.args.per_device_train_batch_size
            auto = bool(compiled) and step_tokens <= AUTO_MAX_MEAN_STEP_TOKENS
            use = possible and (auto if setting is None else setting)
            log.info("step CUDA graphs: %s (~%.0f tokens a step)", "on" if use else "off", step_tokens)
            return use

        def _graphs_for(self, model):
            if not self.use_step_graphs:
                return None
            if self.step_graphs is None:
                from training.step_graphs import StepGraphs

                mode = "compiled" if self.compiled_layers else "eager"
                # The graphs keep their own memory pool: graph only steps whose activations fit twice.
                max_tokens = token_budget_for(self.model, mode, usable_gpu_bytes() / 2) \
                    if torch.cuda.is_available() else DEFAULT_TOKEN_BUDGET
                params = [p for p in model.parameters() if p.requires_grad]
                attention = getattr(unwrap(self.model).config, "_attn_implementation", None)
                self.step_graphs = StepGraphs(model, params, self.data_collator.pad_token_id, max_tokens,
                                              attention, self.compute_loss_context_manager)
                self.step_graphs.plan(self._planned_step_shapes())
                log.info("step CUDA graphs for packed rows of up to %d tokens; buckets planned for the run's "
                         "steps (tokens, targets, documents, longest): %s", max_tokens, self.step_graphs.planned)
            return self.step_graphs if self.step_graphs.enabled else None

        def _graph_step(self, graphs, micro, num_items_in_batch):
            """One step of a single micro-batch through the step graphs (one process: the loss is the
            mean over this row's scored tokens, the count the Trainer puts in num_items_in_batch, here
            taken from the host so that nothing waits for the GPU)."""
            scale = 1.0 / max(int(micro["num_targets"]), 1)
            loss, hits, grads = graphs.step(micro, scale)
            graphs.set_grads(grads)
            self._correct = hits.clone() if self._correct is None else self._correct + hits
            self._scored += int(micro["num_targets"])
            return loss.clone()

        def _step_sampler(self) -> StepShardSampler:
            return StepShardSampler(
                len(self.train_dataset), self.args.per_device_train_batch_size, max(1, self.args.world_size),
                self.args.process_index, self.args.data_seed if self.args.data_seed is not None else self.args.seed)

        def _planned_step_shapes(self) -> list[tuple[int, int, int, int]]:
            """The packed shape (packed_shape) of every single-micro-batch step this run will take: the
            sampler's order is seeded and the rows are tokenized, so the step graphs can size their
            buckets for the run before its first step."""
            dataset, collator = self.train_dataset, self.data_collator
            columns = dataset.column_names
            ids = list(dataset["input_ids"])
            labels = list(dataset["labels"]) if "labels" in columns else [None] * len(ids)
            masks = list(dataset["completion_mask"]) if "completion_mask" in columns else [None] * len(ids)
            lengths = self._row_lengths()
            targets = [example_targets(x, y, m) for x, y, m in zip(ids, labels, masks, strict=True)]
            sampler = self._step_sampler()
            steps = self.args.max_steps if self.args.max_steps and self.args.max_steps > 0 else \
                math.ceil(len(sampler) * self.args.num_train_epochs)
            shapes: list[tuple[int, int, int, int]] = []
            taken = epoch = 0
            while len(sampler) and taken < steps:
                sampler.set_epoch(epoch)
                for batch in sampler:
                    if taken == steps:
                        break
                    taken += 1
                    step_lengths = [lengths[i] for i in batch]
                    if len(split_by_token_budget(step_lengths, collator.token_budget)) == 1:  # else: not graphed
                        shapes.append(packed_shape(step_lengths, [targets[i] for i in batch],
                                                   collator.pad_to_multiple_of))
                epoch += 1
            return shapes

        def get_train_dataloader(self):
            """One rank's share of every optimizer step (StepShardSampler), without accelerate's
            even-batch padding, which would repeat examples."""
            from torch.utils.data import DataLoader

            class EpochDataLoader(DataLoader):
                """The Trainer calls set_epoch before each epoch (a resumed run too): the epoch's order."""

                def set_epoch(self, epoch: int) -> None:
                    self.batch_sampler.set_epoch(epoch)

            return EpochDataLoader(self.train_dataset, batch_sampler=self._step_sampler(),
                                   collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
                                   pin_memory=self.args.dataloader_pin_memory)

        def _prepare_input(self, data):
            """As the Trainer's, but tensors go to the GPU without blocking: the batch is in pinned memory,
            and a blocking copy waits for every kernel queued before it, so each step would wait for the
            last one to finish and the GPU would idle while the host prepares the next (profiled on an
            H200: ~30 ms of a ~100 ms replayed step, benchmarks/NOTES.md)."""
            if torch.is_tensor(data) and not self.is_deepspeed_enabled:
                return data.to(device=self.args.device, non_blocking=True)
            return super()._prepare_input(data)

        def _get_num_items_in_batch(self, batch_samples, device):
            """The step's scored-token count. One process: a host int, counted on the host (the Trainer's
            own copies the count to the GPU with a blocking copy, which waits for the previous step: a
            sync per step). Several processes: the Trainer's, which all-gathers the counts."""
            if max(1, self.args.world_size) > 1:
                return super()._get_num_items_in_batch(batch_samples, device)
            count = super()._get_num_items_in_batch(batch_samples, torch.device("cpu"))
            return int(count) if torch.is_tensor(count) else count

        # ---- step
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mask = attention_mask_for(unwrap(self.model), inputs)
            log_probs, is_top1 = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                                       attention_mask=mask, use_cache=False, packed_head=True,
                                       target_index=inputs["target_index"], target_ids=inputs["target_ids"])
            denominator = num_items_in_batch if num_items_in_batch is not None else inputs["num_targets"]
            if torch.is_tensor(denominator):
                denominator = denominator.clamp(min=1)
            else:
                denominator = max(int(denominator), 1)
            loss = -log_probs.sum() / denominator
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                # num_items_in_batch counts every rank's tokens and DDP averages the gradients.
                loss = loss * self.accelerator.num_processes
            hits = is_top1.sum()
            self._correct = hits if self._correct is None else self._correct + hits
            self._scored += int(inputs["num_targets"])
            return (loss, (log_probs, is_top1)) if return_outputs else loss

        def training_step(self, model, inputs, num_items_in_batch=None):
            """One optimizer step's examples: forward + backward over each packed micro-batch."""
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            self.real_tokens_seen += int(inputs.get("num_real_tokens", 0))
            micro_batches = self._prepare_inputs(inputs)["micro_batches"]
            graphs = self._graphs_for(model)
            if graphs is not None and len(micro_batches) == 1 and graphs.fits(micro_batches[0]):
                loss = self._graph_step(graphs, micro_batches[0], num_items_in_batch)
                self._after_first_step()
                return loss
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
            self._after_first_step()
            return total

        def floating_point_ops(self, inputs) -> int:
            """The Trainer's estimate (6 x tokens x non-embedding parameters) over a packed step's
            micro-batches; its own looks for input_ids at the top of the batch and counts 0 here."""
            micro_batches = inputs.get("micro_batches") if isinstance(inputs, dict) else None
            if micro_batches is None or not hasattr(self.model, "num_parameters"):
                return super().floating_point_ops(inputs)
            if self._flos_parameters is None:  # counted once: the host is ahead of the GPU, keep it there
                self._flos_parameters = self.model.num_parameters(exclude_embeddings=True)
            return 6 * sum(m["input_ids"].numel() for m in micro_batches) * self._flos_parameters

        def _after_first_step(self) -> None:
            if self.compiled_layers and self.state.global_step == 0 and torch.cuda.is_available():
                mark_compile_cache(self.model)  # the next run on this cache finds the blocks compiled

        def log(self, logs, start_time=None):
            self._metrics["train" if self.model.training else "eval"].pop("num_tokens", None)
            if "loss" in logs:  # every rank logs the same steps: the all-reduce below meets
                accuracy = self._log_accuracy if self._log_accuracy is not None else self._token_accuracy()
                if accuracy is not None and not math.isnan(accuracy):  # nan: a deferred log scored nothing
                    logs["mean_token_accuracy"] = accuracy
            super().log(logs, start_time)

        # ---- logs that do not stop the GPU
        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                     start_time, learning_rate=None):
            """A logging step's loss, gradient norm and token accuracy are copied to the host behind that
            step's kernels (under DDP after one all-reduce of every rank's loss, hits, scored tokens and
            flos, queued like the step's gradient all-reduce) and written at the next step, once the GPU
            has them. The Trainer's own log reads them at once (.item(); under DDP also its flos gather),
            which waits for every kernel queued and leaves the GPU idle while the host prepares the next
            step: at the recipe's logging_steps=1 every step (measured on an H200 in one process,
            benchmarks/NOTES.md). A checkpoint, an evaluation or the run's end writes the pending log at
            once (so does an epoch's end: one more call). Log history and train_loss are the Trainer's."""
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

    return PackedSFTTrainer
