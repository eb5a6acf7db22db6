"""The memory model against a measured peak: training/memory_model.py's prediction for one GPU beside the
peak a real run of the project's training path reaches, per model and row length (issue 43's item 3).

Each case trains a Qwen3 architecture with random weights (no hub access on the GPU machine; the shapes
are the published config.json values, tests/data/qwen3_configs/) through `training.train.build_trainer`,
the packed path `fab train` takes on a GPU, one rank, unsharded, LoRA r16 on q/k/v/o (args.py's
defaults), one row of exactly `length` tokens a step (token_budget = max_length = length), eager blocks,
no activation checkpointing, four optimizer steps. Measured: torch's peak allocated and reserved bytes
and the process's whole footprint at that peak (reserved + what CUDA holds outside torch's allocator:
context, cuBLAS workspaces), which is what must fit the GPU. Predicted: `memory_model.predict` with the
same settings.

    python -m benchmarks.bench_memory      # GPU: writes a results file (--out; default under benchmarks/results/)
    python -m benchmarks.bench_memory --models Qwen3-0.6B --lengths 128 --device cpu   # the code path on CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIGS = REPO / "tests" / "data" / "qwen3_configs"
MODELS = ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B")
LENGTHS = (512, 2048)
STEPS = 4
# The config.json keys Qwen3Config takes for the architecture (the rest are the Hub's bookkeeping).
ARCH_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rope_theta",
             "rms_norm_eps", "attention_bias")
GIB = 2**30


def settings_for(length: int, blocks: str = "eager", checkpointing: bool = False) -> dict:
    """The run's settings: what TrainConfig gets and what the prediction reads, one dict for both."""
    return {"max_length": length, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
            "flex_packing": "true", "step_layout": "auto", "token_budget": length,
            "activation_checkpointing": "true" if checkpointing else "false",
            "compile_layers": "true" if blocks == "compiled" else "false", "cuda_graphs": "false",
            "lora_r": 16, "dtype": "bfloat16"}


def rows_of(length: int, vocab: int, n: int) -> list[dict]:
    """n rows of exactly `length` tokens, the second half scored."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "completion_mask": [0] * (length // 2) + [1] * (length - length // 2)})
    return rows


def measure(name: str, config: dict, length: int, device: str, out_dir: Path, blocks: str = "eager",
            checkpointing: bool = False) -> dict:
    from datasets import Dataset

    from benchmarks.bench_train import make_model, make_tokenizer
    from training import memory_model
    from training.args import ModelArguments, TrainConfig
    from training.fastpath import attention
    from training.train import build_trainer

    settings = settings_for(length, blocks, checkpointing)
    predicted = memory_model.predict(config, settings, ranks=1, gpu=device == "cuda")
    cfg = {k: config[k] for k in ARCH_KEYS if k in config}
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()  # CUDA's own: context, library handles
    model = make_model(cfg, device, attention.attention_implementation("auto"))
    train_args = TrainConfig(
        output_dir=str(out_dir / f"{name}-{length}-{blocks}-{checkpointing}"), learning_rate=2e-4,
        num_train_epochs=1, max_steps=STEPS, logging_steps=1, save_strategy="no", report_to="none", seed=42,
        completion_only_loss=True,
        use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        **{k: v for k, v in settings.items() if k not in ("flex_packing", "lora_r", "dtype")})
    trainer = build_trainer(model, make_tokenizer(), Dataset.from_list(rows_of(length, cfg["vocab_size"], STEPS)),
                            ModelArguments(model_name_or_path=f"synthetic-{name}"), train_args, flex_packing=True)
    if device == "cuda":  # the training's peak, not the random initialisation's (a real run loads bf16 weights)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row_built = round(torch.cuda.memory_allocated() / GIB, 3)
    trainer.train()
    row = {"model": name, "length": length, "blocks": blocks, "checkpointing": checkpointing, "settings": settings,
           "steps": trainer.state.global_step,
           "predicted_gib": {k: round(v / GIB, 3) for k, v in predicted.items()},
           "predicted_peak_gib": round(sum(predicted.values()) / GIB, 3),
           "choices": getattr(trainer, "choices", None)}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        outside_after = (total - free) - torch.cuda.memory_reserved()
        row.update({
            "allocated_before_training_gib": row_built,
            "allocated_peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
            "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
            "outside_allocator_gib": round(max(outside, outside_after) / GIB, 3),
        })
        row["footprint_peak_gib"] = round(row["reserved_peak_gib"] + row["outside_allocator_gib"], 3)
        row["error_vs_footprint"] = round(row["predicted_peak_gib"] / row["footprint_peak_gib"] - 1, 3)
    del trainer, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", default="eager", help="eager and/or compiled (comma-separated)")
    parser.add_argument("--checkpointing", default="false", help="false and/or true (comma-separated)")
    parser.add_argument("--out", default=None,
                        help="results file (default: memory-<gpu>-<date>.json under benchmarks' results folder)")
    parser.add_argument("--work", default="/tmp/bench-memory")
    args = parser.parse_args(argv)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"gpu": gpu, "date": dt.date.today().isoformat(), "torch": torch.__version__, "steps": STEPS,
               "cases": []}
    for name in args.models.split(","):
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        for length in map(int, args.lengths.split(",")):
            for blocks in args.blocks.split(","):
                for ckpt in args.checkpointing.split(","):
                    row = measure(name, config, length, args.device, Path(args.work), blocks, ckpt == "true")
                    results["cases"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k not in ("settings", "choices")}), flush=True)
    slug = "h200" if "H200" in gpu else "h100" if "H100" in gpu else gpu.split()[-1].lower()
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"memory-{slug}-{results['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
