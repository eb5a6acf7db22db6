"""The packed path's memory budget: how many tokens of one micro-batch the GPU can hold activations for."""

from __future__ import annotations

import torch

from training.fastpath.batches import DEFAULT_TOKEN_BUDGET, PAD_MULTIPLE
from training.fastpath.model import unwrap
from training.memory_model import ACTIVATION_BYTES_PER_UNIT, MEMORY_RESERVE_BYTES  # shared with the fit check


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

