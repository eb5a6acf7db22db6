"""Compile the decoder blocks or not (`compile_layers: auto`): only when it pays for this run's tokens.

The rates below are of one GPU with Qwen3-4B shapes (BENCHMARKS.md); the decision needs only their ratios
to be about right on other GPUs: the eager step is launch-bound, the compiled step is not. A marker in the
compile cache records that a run compiled these blocks, so the next run knows its compile is warm.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from training.fastpath.model import unwrap

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



def decide_compile(setting: bool | None, tokens: float, model) -> tuple[bool, str]:
    """(compile or not, who decided and why) for the config's `compile_layers` (None = auto)."""
    if setting is not None:
        return setting, "config"
    if not torch.cuda.is_available():
        return False, "auto: no GPU"
    use, reason = choose_compile(tokens, compile_cache_warm(model))
    return use, f"auto: {reason}"
