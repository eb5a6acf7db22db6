"""Training-speed benchmark: the seed's recipe against the project's, with the project's training code.

Both recipes are built by `training.train.build_trainer` (TRL SFTTrainer + PEFT LoRA r16/alpha 32/
dropout 0.05 on q/k/v/o, AdamW, lr 2e-4 linear decay, 16 examples per optimizer step, bf16):

- seed:    batch 2 x accumulation 8, gradient checkpointing, padded batches, SDPA attention
           (measured over `--seed-steps` optimizer steps, not the whole epoch, to save GPU time);
- project: training/packing.py (the default of train.py on a GPU): one packed row per optimizer step,
           flex attention with a per-example BlockMask, no checkpointing, compiled decoder layers,
           fused LM head; one whole epoch.

Model: the Qwen3-4B architecture with random weights (no hub access on the GPU machine). Data: a
seeded synthetic stand-in for Alpaca, token ids directly (no tokenizer): prompt length ~ lognormal
(median 60, sigma 0.5), response length ~ lognormal (median 150, sigma 0.7), each at least 4,
total clipped to 1024 by cutting the response; token ids uniform in [2, vocab).

    python -m benchmarks.bench_train                       # GPU: writes benchmarks/results/<date>-<gpu>.json
    python -m benchmarks.bench_train --tiny --device cpu   # a tiny Qwen3 on CPU, to check the code path

MFU = model FLOPs / (time x 989e12), model FLOPs per example of L tokens:
4 * N * L + 6 * N_lora * L + 12 * layers * heads * head_dim * L(L+1)/2, N = 4.02e9 matmul parameters
with the (tied) LM head (frozen base: forward 2N + input gradients 2N per token; LoRA adds its weight
gradients; causal attention: forward 4*h*d per (query, key) pair, backward twice that).
`mfu_scored_head` counts the LM head (0.39e9 of N) only on the C scored (completion) tokens,
the work actually done: 4 * N_body * L + 4 * N_head * C + ...
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM datasheet
EFFECTIVE_BATCH = (2, 8)  # the seed's per-device batch x accumulation = 16 examples per step

QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=40960, rope_theta=1_000_000, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048)


# ---------------------------------------------------------------- workload

def make_workload(n: int, vocab: int, seed: int = 0, max_length: int = 1024, prompt_median: float = 60,
                  response_median: float = 150) -> list[dict]:
    """Seeded synthetic prompt/completion rows, already tokenized (input_ids + completion_mask)."""
    rng = np.random.default_rng(seed)
    prompts = np.maximum(4, np.round(rng.lognormal(math.log(prompt_median), 0.5, n))).astype(int)
    responses = np.maximum(4, np.round(rng.lognormal(math.log(response_median), 0.7, n))).astype(int)
    rows = []
    for p, r in zip(prompts, responses, strict=False):
        p = min(int(p), max_length - 4)
        r = min(int(r), max_length - p)
        ids = rng.integers(2, vocab, p + r).tolist()
        rows.append({"input_ids": ids, "completion_mask": [0] * p + [1] * r})
    return rows


def workload_stats(rows: list[dict]) -> dict:
    lengths = np.array([len(r["input_ids"]) for r in rows])
    completions = np.array([sum(r["completion_mask"]) for r in rows])
    return {"examples": len(rows), "tokens": int(lengths.sum()), "mean_length": float(lengths.mean()),
            "median_length": float(np.median(lengths)), "max_length": int(lengths.max()),
            "mean_prompt": float((lengths - completions).mean()), "mean_response": float(completions.mean())}


# ---------------------------------------------------------------- FLOPs

def model_counts(cfg: dict, lora_r: int = 16) -> dict:
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg["intermediate_size"]
    lora = layers * lora_r * ((h + q) + 2 * (h + kv) + (q + h))
    return {"n_body": layers * per_layer, "n_head": cfg["vocab_size"] * h, "n_lora": lora,
            "attn_width": q, "layers": layers}


def example_flops(length: int, scored: int | None, counts: dict) -> float:
    """Model FLOPs of one example. scored=None: the LM head counted on every token (the usual MFU
    convention, REFERENCE's 4N per token); an int: on the scored (completion) tokens only, which is
    the work both recipes actually do (TRL's fused head skips the prompt positions)."""
    pairs = length * (length + 1) / 2
    head_tokens = length if scored is None else scored
    return (4 * counts["n_body"] * length + 4 * counts["n_head"] * head_tokens + 6 * counts["n_lora"] * length
            + 12 * counts["layers"] * counts["attn_width"] * pairs)


# ---------------------------------------------------------------- model, tokenizer, trainer

def make_tokenizer():
    """Two special tokens only: the data is token ids, the tokenizer supplies pad/eos ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<eos>": 0, "<pad>": 1}, "<pad>")),
                                   eos_token="<eos>", pad_token="<pad>")


def make_model(cfg: dict, device: str, attn: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen3Config(**cfg, pad_token_id=1, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype, attn_implementation=attn)
    return model


class StepClock:
    """Counts tokens/FLOPs per optimizer step (from the batches, without device syncs on the fast path)
    and times the run: a sync at the end of step `warmup` and at the end of training."""

    def __init__(self, trainer, counts: dict, warmup: int):
        from transformers import TrainerCallback

        self.counts, self.warmup = counts, warmup
        self.tokens = self.flops = self.flops_scored_head = 0.0
        self.mark = None  # (time, tokens, flops, step) at the end of the warmup step
        self.start = self.end = None
        clock = self
        original = trainer.training_step

        def counting_step(model, inputs, num_items_in_batch=None):
            clock.account(inputs)
            return original(model, inputs, num_items_in_batch)

        trainer.training_step = counting_step

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                clock.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if state.global_step == clock.warmup:
                    torch.cuda.synchronize() if torch.cuda.is_available() else None
                    clock.mark = (time.perf_counter(), clock.tokens, clock.flops, state.global_step,
                                  clock.flops_scored_head)

            def on_train_end(self, args, state, control, **kw):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                clock.end = (time.perf_counter(), clock.tokens, clock.flops, state.global_step,
                             clock.flops_scored_head)

        trainer.add_callback(Callback())

    def account(self, inputs):
        if "example_lengths" in inputs:  # packed: lengths are plain ints
            lengths = inputs["example_lengths"]
            scored = [int(n) for n in [(m["labels"] != -100).sum() for m in inputs["micro_batches"]]]
            # scored tokens per example are not kept apart in the packed row: spread by length
            total_scored, total = sum(scored), sum(lengths)
            per = [total_scored * n / total for n in lengths]
        else:  # padded batch (the seed's recipe): one small device sync, fine at its speed
            lengths = inputs["attention_mask"].sum(1).tolist()
            per = (inputs["labels"][:, 1:] != -100).sum(1).tolist()
        self.tokens += sum(lengths)
        self.flops += sum(example_flops(n, None, self.counts) for n in lengths)
        self.flops_scored_head += sum(example_flops(n, s, self.counts) for n, s in zip(lengths, per, strict=False))


def ProfileSteps(first: int, last: int):
    """A callback that profiles optimizer steps first..last (GPU kernels) and prints the top kernels."""
    from transformers import TrainerCallback

    class _Profile(TrainerCallback):
        prof = None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == first - 1:
                torch.cuda.synchronize()
                self.t0 = time.perf_counter()
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
                self.prof.__enter__()
            elif state.global_step == last and self.prof is not None:
                torch.cuda.synchronize()
                wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)
                events = self.prof.key_averages()
                table = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
                busy = sum(e.self_device_time_total for e in events) / 1e6
                text = (f"profile steps {first}..{last}: wall {wall:.3f} s, device busy {busy:.3f} s "
                        f"({busy / wall:.0%})\n{table}")
                print(text, flush=True)
                out = os.environ.get("OUT")
                if out:
                    Path(out, "profile.txt").write_text(text)
                    self.prof.export_chrome_trace(str(Path(out, "trace.json")))
                self.prof = None

    return _Profile()


def run_recipe(name: str, rows: list[dict], cfg: dict, device: str, steps: int, warmup: int, out_dir: str,
               compile_model: bool | None, logging_steps: int, profile: tuple[int, int] | None = None) -> dict:
    from datasets import Dataset

    from training import packing
    from training.args import ModelArguments, TrainConfig
    from training.train import build_trainer

    project = name == "project"
    attn = packing.ATTN_IMPLEMENTATION if project else "sdpa"
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = make_model(cfg, device, attn)
    tokenizer = make_tokenizer()
    train_args = TrainConfig(
        output_dir=os.path.join(out_dir, name), per_device_train_batch_size=EFFECTIVE_BATCH[0],
        gradient_accumulation_steps=EFFECTIVE_BATCH[1], learning_rate=2e-4, num_train_epochs=1,
        max_steps=steps if steps > 0 else -1, logging_steps=logging_steps, save_strategy="no",
        report_to="none", max_length=1024, seed=42, activation_checkpointing=True, completion_only_loss=True,
        use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0)
    model_args = ModelArguments(model_name_or_path="synthetic-qwen3")
    trainer = build_trainer(model, tokenizer, Dataset.from_list(rows), model_args, train_args,
                            flex_packing=project)
    if project and compile_model is not None and compile_model != bool(trainer.compiled_layers):
        raise SystemExit("set --compile before the trainer is built (PackedSFTTrainer compiles on GPU)")
    if project:
        first = packing.pack_examples(
            [{"input_ids": r["input_ids"], "labels": r["input_ids"]}
             for r in rows[:EFFECTIVE_BATCH[0] * EFFECTIVE_BATCH[1]]],
            pad_token_id=1)
        mask = packing.attention_mask_for(model, first["document_ids"].to(device))
        if hasattr(mask, "sparsity"):
            print(f"block mask of a 16-example row: {first['input_ids'].shape[1]} tokens, "
                  f"sparsity {mask.sparsity():.1f}%", flush=True)
    counts = model_counts(cfg, lora_r=model_args.lora_r)
    clock = StepClock(trainer, counts, warmup)
    if profile:
        trainer.add_callback(ProfileSteps(*profile))
    output = trainer.train()
    end_t, end_tok, end_flops, end_step, end_sflops = clock.end
    runtime = end_t - clock.start
    row = {
        "recipe": name,
        "steps": end_step,
        "examples_per_step": trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps,
        "micro_batch": trainer.args.per_device_train_batch_size,
        "gradient_accumulation": trainer.args.gradient_accumulation_steps,
        "activation_checkpointing": bool(getattr(trainer.args, "activation_checkpointing", False)
                                         or trainer.args.gradient_checkpointing),
        "attention": attn,
        "compiled_layers": getattr(trainer, "compiled_layers", 0),
        "tokens": int(end_tok),
        "train_runtime_s": round(runtime, 2),
        "trainer_train_runtime_s": output.metrics.get("train_runtime"),
        "tokens_per_s_incl_warmup": end_tok / runtime,
        "mfu_incl_warmup": end_flops / runtime / PEAK_FLOPS,
        "mfu_scored_head_incl_warmup": end_sflops / runtime / PEAK_FLOPS,
        "final_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
        "train_loss": output.training_loss,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }
    if clock.mark and end_step > clock.mark[3]:
        t0, tok0, fl0, s0, sfl0 = clock.mark
        row.update({"warmup_steps_excluded": s0, "tokens_per_s": (end_tok - tok0) / (end_t - t0),
                    "mfu": (end_flops - fl0) / (end_t - t0) / PEAK_FLOPS,
                    "mfu_scored_head": (end_sflops - sfl0) / (end_t - t0) / PEAK_FLOPS,
                    "steady_time_s": end_t - t0})
    else:
        row.update({"warmup_steps_excluded": 0, "tokens_per_s": row["tokens_per_s_incl_warmup"],
                    "mfu": row["mfu_incl_warmup"], "mfu_scored_head": row["mfu_scored_head_incl_warmup"]})
    del trainer, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 and a short workload (CPU check)")
    parser.add_argument("--examples", type=int, default=None, help="workload size (default 2000; tiny: 64)")
    parser.add_argument("--recipes", default="seed,project", help="comma-separated: seed, project")
    parser.add_argument("--seed-steps", type=int, default=12, help="optimizer steps of the seed recipe (0 = epoch)")
    parser.add_argument("--project-steps", type=int, default=0, help="optimizer steps of the project (0 = epoch)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the steady rates")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results file")
    parser.add_argument("--profile", default=None, help="FIRST:LAST optimizer steps to profile (GPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible (use --device cpu --tiny)")

    cfg = TINY if args.tiny else QWEN3_4B
    n = args.examples or (64 if args.tiny else 2000)
    rows = make_workload(n, cfg["vocab_size"], seed=0, max_length=256 if args.tiny else 1024,
                         prompt_median=15 if args.tiny else 60, response_median=30 if args.tiny else 150)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"date": dt.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
               "model": "tiny-qwen3" if args.tiny else "Qwen3-4B architecture, random weights",
               "workload": workload_stats(rows), "peak_flops": PEAK_FLOPS, "rows": []}
    import peft
    import transformers  # noqa: E401
    import trl
    results["versions"] = {"transformers": transformers.__version__, "trl": trl.__version__,
                           "peft": peft.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [r.strip() for r in args.recipes.split(",") if r.strip()]:
            if name not in ("seed", "project"):
                parser.error(f"--recipes: unknown recipe {name!r}; use seed and/or project")
            steps = args.seed_steps if name == "seed" else args.project_steps
            warmup = args.warmup_steps if args.warmup_steps is not None else (2 if name == "seed" else 5)
            started = time.time()
            profile = tuple(int(x) for x in args.profile.split(":")) if args.profile else None
            row = run_recipe(name, rows, cfg, args.device, steps, warmup, tmp, None, args.logging_steps, profile)
            row = {"gpu": gpu, **row, "wall_s": round(time.time() - started, 1)}
            results["rows"].append(row)
            print(f"BENCH {json.dumps(row)}", flush=True)
    by = {r["recipe"]: r for r in results["rows"]}
    if "seed" in by and "project" in by:
        by["project"]["seed_recipe_tokens_per_s"] = by["seed"]["tokens_per_s"]
        by["project"]["speedup"] = by["project"]["tokens_per_s"] / by["seed"]["tokens_per_s"]
        by["project"]["speedup_incl_warmup"] = (by["project"]["tokens_per_s_incl_warmup"]
                                                / by["seed"]["tokens_per_s_incl_warmup"])
    print(f"{'recipe':8} {'tok/s':>9} {'MFU':>6} {'MFU(C)':>6} {'tok/s(all)':>10} {'MFU(all)':>8} {'peak GiB':>8} "
          f"{'runtime s':>9} {'loss':>7}")
    for r in results["rows"]:
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['recipe']:8} {r['tokens_per_s']:9.0f} {r['mfu']:6.1%} {r['mfu_scored_head']:6.1%} "
              f"{r['tokens_per_s_incl_warmup']:10.0f} {r['mfu_incl_warmup']:8.1%} {mem:>8} "
              f"{r['train_runtime_s']:9.1f} {r['final_loss']!s:>7}")
    if "project" in by and "speedup" in by["project"]:
        print(f"speedup (steady) {by['project']['speedup']:.1f}x, incl. warmup "
              f"{by['project']['speedup_incl_warmup']:.1f}x on {gpu}")
    if not args.no_write:
        write_results(results, args.results_dir / f"{results['date']}-{gpu_slug(gpu, args.tiny)}.json")
    return results


def gpu_slug(gpu: str, tiny: bool) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ("-tiny" if tiny else "")


def write_results(results: dict, path: Path) -> None:
    """The results file, and a copy under $OUT when run through the GPU machine's tool."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {path}")
    out = os.environ.get("OUT")
    if out:
        Path(out, path.name).write_text(path.read_text())


if __name__ == "__main__":
    main()
