"""The packed row's attention: each example attends only to itself, causally.

On CPU: `packed_sdpa` (each example gathered into a padded batch for causal SDPA; flex attention has no
backward on CPU). On a GPU: `packed_varlen`, flash attention over the row's documents given by their
offsets (cu_seqlens), no mask at all; where this torch lacks varlen_attn, flex attention with a document
BlockMask (compiled blocks) or SDPA with a dense document mask (eager). Which is faster where:
BENCHMARKS.md. The config's `attention` (auto, varlen, flex) picks the GPU's.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from training.fastpath.model import unwrap

PACKED_SDPA = "packed_sdpa"
PACKED_VARLEN = "packed_varlen"


def varlen_installed() -> bool:
    """Whether this torch has flash attention's variable-length entry point (torch.nn.attention.varlen)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_available() -> bool:
    return torch.cuda.is_available() and varlen_installed()


def attention_implementation(setting: str = "auto") -> str:
    """The attention of the packed path on this machine for the config's `attention` (auto, varlen, flex)."""
    choice = (setting or "auto").strip().lower()
    if choice not in ("auto", "varlen", "flex"):
        raise ValueError(f"attention={setting!r} is not allowed: set attention to one of auto, varlen, flex")
    if not torch.cuda.is_available():
        return PACKED_SDPA
    if choice == "flex" or not varlen_available():
        if choice == "varlen":
            raise ValueError(f"attention=varlen: this torch ({torch.__version__}) has no "
                             "torch.nn.attention.varlen; set attention to auto or flex")
        return "flex_attention"
    return PACKED_VARLEN


# This machine's default.
ATTN_IMPLEMENTATION = attention_implementation()


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

