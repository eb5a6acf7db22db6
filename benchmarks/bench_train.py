"""Training-speed benchmark: the baseline recipe against the project's, with the project's training code.

Both recipes are built by `training.train.build_trainer` (TRL SFTTrainer + PEFT LoRA r16/alpha 32/
dropout 0.05 on q/k/v/o, AdamW, lr 2e-4 linear decay, 16 examples per optimizer step, bf16):

- seed:    batch 2 x accumulation 8, gradient checkpointing, padded batches, SDPA attention
           (measured over `--baseline-steps` optimizer steps, not the whole epoch, to save GPU time);
- project: training/fastpath/ (the default of train.py on a GPU): one packed row per optimizer step,
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
RECIPES = ("baseline", "project", "project-compiled", "project-eager", "project-compiled-nographs",
           "project-eager-graphs")
RECIPES += tuple(f"{r}-flex" for r in RECIPES if r.startswith("project"))  # flex attention instead of varlen
# Results recorded until 2026-12-06 call the baseline recipe "seed" (and its speed `seed_recipe_tokens_per_s`).
OLD_NAMES = {"seed": "baseline"}
EFFECTIVE_BATCH = (2, 8)  # the baseline's per-device batch x accumulation = 16 examples per step
BASELINE_LOGGING_STEPS = 10  # the baseline's SFTConfig(logging_steps=10)
PROJECT_CONFIG = REPO / "training" / "configs" / "qwen3-4b-lora.yaml"


def recipe_logging_steps(name: str, override: int | None = None) -> int:
    """How often a recipe logs, as its users run it: the baseline's script every 10 steps, the project's config
    (what fab train launches) every step; `--logging-steps` overrides both."""
    if override is not None:
        return override
    if name == "baseline":
        return BASELINE_LOGGING_STEPS
    import yaml

    return int(yaml.safe_load(PROJECT_CONFIG.read_text())["logging_steps"])

QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=40960, rope_theta=1_000_000, rms_norm_eps=1e-6)
KNOB_PREFIXES = ("TORCHINDUCTOR_", "TORCH_BLAS_", "PYTORCH_CUDA_ALLOC_CONF")
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


# Alpaca under the baseline's template (see make_alpaca_lengths): published per-row token statistics.
ALPACA = dict(instruction_mean=14.0, input_mean_nonempty=25.0, input_share=0.4, output_mean=65.0,
              template_tokens=9, template_input_tokens=5)


def make_alpaca_lengths(n: int, seed: int = 0, max_length: int = 1024) -> list[tuple[int, int]]:
    """(prompt, response) token counts distributed like Alpaca under the baseline's template.

    Alpaca (52k rows) has about 14 tokens of instruction, 10 of input (40% of rows have one, about 25
    tokens each) and 65 of output per row; its outputs are right-skewed (many one-liners, a tail of
    long answers). Lognormals with those means: instruction sigma 0.4, input sigma 0.6, output sigma
    0.9 (median 43, 99th percentile about 350). The baseline's template adds about 9 tokens
    ("### Instruction:\n" ... "\n\n### Response:\n") and 5 more with an input ("\n\n### Input:\n");
    the response ends with EOS (+1). Rows are about 102 tokens on average, median about 85.
    """
    rng = np.random.default_rng(seed)

    def lognormal(mean: float, sigma: float, size: int) -> np.ndarray:
        return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, size)

    a = ALPACA
    instruction = np.maximum(3, np.round(lognormal(a["instruction_mean"], 0.4, n)))
    has_input = rng.random(n) < a["input_share"]
    inputs = np.where(has_input, np.maximum(1, np.round(lognormal(a["input_mean_nonempty"], 0.6, n))), 0)
    output = np.maximum(1, np.round(lognormal(a["output_mean"], 0.9, n))) + 1  # + EOS
    prompt = instruction + inputs + a["template_tokens"] + np.where(has_input, a["template_input_tokens"], 0)
    out = []
    for p, r in zip(prompt.astype(int), output.astype(int), strict=True):
        p = min(int(p), max_length - 4)
        out.append((p, min(int(r), max_length - p)))
    return out


def make_alpaca_workload(n: int, vocab: int, seed: int = 0, max_length: int = 1024) -> list[dict]:
    """Seeded synthetic rows with Alpaca's length distribution (make_alpaca_lengths), as token ids."""
    rng = np.random.default_rng(seed + 1)
    rows = []
    for p, r in make_alpaca_lengths(n, seed, max_length):
        rows.append({"input_ids": rng.integers(2, vocab, p + r).tolist(), "completion_mask": [0] * p + [1] * r})
    return rows


WORKLOADS = {
    # ~258-token rows (the first long-row benchmark): longer than Alpaca.
    "long-258": lambda n, vocab, tiny: make_workload(n, vocab, seed=0, max_length=256 if tiny else 1024,
                                                     prompt_median=15 if tiny else 60,
                                                     response_median=30 if tiny else 150),
    # The users' workload: Alpaca-length rows under the baseline's template (~102 tokens).
    "alpaca-102": lambda n, vocab, tiny: make_alpaca_workload(n, vocab, seed=0, max_length=256 if tiny else 1024),
    # The memory worst case: every row at the maximum length (the 22 GiB cap run).
    "max-1024": lambda n, vocab, tiny: make_workload(n, vocab, seed=0, max_length=256 if tiny else 1024,
                                                     prompt_median=60, response_median=100_000),
}


def workload_stats(rows: list[dict]) -> dict:
    lengths = np.array([len(r["input_ids"]) for r in rows])
    completions = np.array([sum(r["completion_mask"]) for r in rows])
    return {"examples": len(rows), "tokens": int(lengths.sum()), "mean_length": float(lengths.mean()),
            "median_length": float(np.median(lengths)), "p90_length": float(np.percentile(lengths, 90)),
            "p99_length": float(np.percentile(lengths, 99)), "max_length": int(lengths.max()),
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

    from training.fastpath import attention

    if attn in (attention.PACKED_SDPA, attention.PACKED_VARLEN):
        attention.register_packed_attention()
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
        else:  # padded batch (the baseline recipe): one small device sync, fine at its speed
            lengths = inputs["attention_mask"].sum(1).tolist()
            per = (inputs["labels"][:, 1:] != -100).sum(1).tolist()
        self.tokens += sum(lengths)
        self.flops += sum(example_flops(n, None, self.counts) for n in lengths)
        self.flops_scored_head += sum(example_flops(n, s, self.counts) for n, s in zip(lengths, per, strict=False))


def kernel_summary(prof, steps: int, wall: float) -> dict:
    """GPU busy time (the union of kernel intervals, not a sum that double-counts overlaps), kernels
    per step, and GPU time by kind of kernel, from a finished torch.profiler run."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    # First match wins: attention before gemm (flash's kernels are CUTLASS ones), Inductor's kernels before
    # copy/fill (their names list the fused ops, "_to_copy" among them: ~10 ms a step counted as copies
    # until 2026-12-04's seventh session).
    kinds = {"flex_attention": ("flex",), "flash_attention (varlen)": ("flash",),
             "triton (Inductor fused)": ("triton",), "gemm": ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas"),
             "optimizer": ("adam", "multi_tensor", "foreach", "fused_adam"),
             "copy/fill": ("memcpy", "memset", "fill", "copy")}
    by_kind: dict[str, float] = {}
    for e in kernels:
        name = e.name.lower()
        kind = next((k for k, keys in kinds.items() if any(x in name for x in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + (e.time_range.end - e.time_range.start)
    cpu_ops = {}
    watched = ("Optimizer.step", "Optimizer.zero_grad", "aten::item", "aten::_local_scalar_dense",
               "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel",
               "cuLaunchKernel", "CompiledFunction", "CompiledFunctionBackward", "Torch-Compiled Region")
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(watched):
            key = e.name.split("#")[0]
            cpu_ops[key] = cpu_ops.get(key, 0.0) + (e.time_range.end - e.time_range.start)
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "gpu_busy_ms_per_step": busy / 1e3 / steps,
            "gpu_busy_share": busy / 1e6 / wall, "kernels_per_step": len(kernels) / steps,
            "gpu_ms_per_step_by_kind": {k: round(v / 1e3 / steps, 2) for k, v in sorted(by_kind.items(),
                                                                                   key=lambda kv: -kv[1])},
            "cpu_ms_per_step": {k: round(v / 1e3 / steps, 2) for k, v in cpu_ops.items()}}


def ProfileSteps(first: int, last: int, tag: str = "project"):
    """A callback that profiles optimizer steps first..last (GPU kernels and CPU ops), prints the
    GPU busy share, kernels per step, time by kind and the top kernels, and (under $OUT) saves the
    table and a gzipped Chrome trace."""
    from transformers import TrainerCallback

    class _Profile(TrainerCallback):
        prof = None
        summary = None

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
                steps = last - first + 1
                self.summary = kernel_summary(self.prof, steps, wall)
                events = self.prof.key_averages()
                table = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
                cpu_table = events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70)
                text = (f"profile {tag} steps {first}..{last}: {json.dumps(self.summary, indent=1)}\n{table}\n"
                        f"by CPU time:\n{cpu_table}")
                print(f"PROFILE {tag} {json.dumps(self.summary)}", flush=True)
                out = os.environ.get("OUT")
                if out:
                    Path(out, "r").mkdir(exist_ok=True)
                    Path(out, "r", f"profile-{tag}.txt").write_text(text)
                    if os.environ.get("BENCH_TRACE"):
                        import gzip
                        import shutil
                        trace = Path(out, "r", f"trace-{tag}.json")
                        self.prof.export_chrome_trace(str(trace))
                        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                            shutil.copyfileobj(f, g)
                        trace.unlink()
                self.prof = None

    return _Profile()


def baseline_layout(examples_per_step: int) -> tuple[int, int]:
    """The baseline's micro-batch x accumulation for a given number of examples per optimizer step."""
    micro = min(EFFECTIVE_BATCH[0], examples_per_step)
    if examples_per_step % micro:
        raise SystemExit(f"--examples-per-step {examples_per_step}: must be a multiple of {micro}")
    return micro, examples_per_step // micro


def run_recipe(name: str, rows: list[dict], cfg: dict, device: str, steps: int, warmup: int, out_dir: str,
               compile_model: bool | None, logging_steps: int, profile: tuple[int, int] | None = None,
               examples_per_step: int = 16, eval_rows: int = 0, samples: int = 0) -> dict:
    from datasets import Dataset

    from training.args import ModelArguments, TrainConfig
    from training.fastpath import attention, batches
    from training.train import build_trainer

    project = name.startswith("project")
    # "-flex": the same recipe with flex attention (the GPU attention before varlen) instead of varlen
    base = name.removesuffix("-flex")
    if project and compile_model is None:
        compile_model = {"project-compiled": True, "project-eager": False, "project-compiled-nographs": True,
                         "project-eager-graphs": False}.get(base)
    # Step CUDA graphs (training/fastpath/step_graphs.py): as the config's auto decides, or forced by the name.
    graphs = {"project-compiled-nographs": "false", "project-eager-graphs": "true"}.get(base, "auto")
    attention_setting = "flex" if name.endswith("-flex") else "auto"
    attn = attention.attention_implementation(attention_setting) if project else "sdpa"
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = make_model(cfg, device, attn)
    tokenizer = make_tokenizer()
    train_args = TrainConfig(
        output_dir=os.path.join(out_dir, name), per_device_train_batch_size=baseline_layout(examples_per_step)[0],
        gradient_accumulation_steps=baseline_layout(examples_per_step)[1], learning_rate=2e-4, num_train_epochs=1,
        max_steps=steps if steps > 0 else -1, logging_steps=logging_steps, save_strategy="no",
        report_to="none", max_length=1024, seed=42, completion_only_loss=True,
        use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        # The baseline's recomputation as its script states it; the project's config leaves it to the fast path.
        activation_checkpointing="auto" if project else "true", step_layout="auto", attention=attention_setting,
        compile_layers={None: "auto", True: "true", False: "false"}[compile_model] if project else "auto",
        cuda_graphs=graphs)
    model_args = ModelArguments(model_name_or_path="synthetic-qwen3")
    held = rows[len(rows) - eval_rows:] if eval_rows else []  # held out as eval_split holds rows out
    rows = rows[:len(rows) - eval_rows]
    trainer = build_trainer(model, tokenizer, Dataset.from_list(rows), model_args, train_args,
                            flex_packing=project, eval_dataset=Dataset.from_list(held) if held else None)
    if project:
        first = batches.pack_examples(
            [{"input_ids": r["input_ids"], "labels": r["input_ids"]}
             for r in rows[:examples_per_step]],
            pad_token_id=1)
        mask = attention.attention_mask_for(model, first["document_ids"].to(device)) \
            if model.config._attn_implementation == "flex_attention" else None
        if hasattr(mask, "sparsity"):
            print(f"block mask of a {examples_per_step}-example row: {first['input_ids'].shape[1]} tokens, "
                  f"sparsity {mask.sparsity():.1f}%", flush=True)
    counts = model_counts(cfg, lora_r=model_args.lora_r)
    clock = StepClock(trainer, counts, warmup)
    profiler = ProfileSteps(*profile, tag=f"{name}-{examples_per_step}-{len(rows)}") if profile else None
    if profiler:
        trainer.add_callback(profiler)
    output = trainer.train()
    train_peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    after = eval_and_sample_peaks(trainer, held, samples, device) if held else None
    end_t, end_tok, end_flops, end_step, end_sflops = clock.end
    runtime = end_t - clock.start
    row = {
        "recipe": name,
        "steps": end_step,
        "examples_per_step": trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps,
        "logging_steps": trainer.args.logging_steps,
        "micro_batch": trainer.args.per_device_train_batch_size,
        "gradient_accumulation": trainer.args.gradient_accumulation_steps,
        "activation_checkpointing": bool(getattr(trainer.args, "activation_checkpointing", False)
                                         or trainer.args.gradient_checkpointing),
        "attention": getattr(model.config, "_attn_implementation", attn),
        "compiled_layers": getattr(trainer, "compiled_layers", 0),
        "compile_reason": getattr(trainer, "compile_reason", None),
        "choices": getattr(trainer, "choices", None),
        "token_budget": getattr(trainer.data_collator, "token_budget", None),
        "mean_token_accuracy": next((h["mean_token_accuracy"] for h in reversed(trainer.state.log_history)
                                     if "mean_token_accuracy" in h), None),
        "tokens": int(end_tok),
        "train_runtime_s": round(runtime, 2),
        "trainer_train_runtime_s": output.metrics.get("train_runtime"),
        "tokens_per_s_incl_warmup": end_tok / runtime,
        "mfu_incl_warmup": end_flops / runtime / PEAK_FLOPS,
        "mfu_scored_head_incl_warmup": end_sflops / runtime / PEAK_FLOPS,
        "final_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
        "train_loss": output.training_loss,
        "peak_mem_gib": train_peak,
        "after_training": after,
        "profile": profiler.summary if profiler else None,
        "step_graphs": ({"captured": trainer.step_graphs.captured, "replayed": trainer.step_graphs.replayed,
                         "capture_s": round(trainer.step_graphs.capture_s, 2),
                         "enabled": trainer.step_graphs.enabled, "max_tokens": trainer.step_graphs.max_tokens,
                         "planned": len(trainer.step_graphs.planned), "unplanned": trainer.step_graphs.unplanned}
                        if getattr(trainer, "step_graphs", None) else None),
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


def eval_and_sample_peaks(trainer, held: list[dict], samples: int, device: str) -> dict:
    """What train.py does after the last step, each with its own peak memory: the held-out evaluation, then
    `samples` greedy answers (64 new tokens) to the held-out rows' prompts. The peaks start from the memory
    the run holds after training (weights, optimizer state), as the training peak includes it too."""
    from training.evaluate import evaluate
    from training.samples import generate_ids

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = evaluate(trainer)
    out = {"eval_rows": len(held), "eval": result, "eval_s": round(time.perf_counter() - started, 2),
           "eval_peak_mem_gib": peak()}
    if samples:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prompts = [[t for t, c in zip(r["input_ids"], r["completion_mask"], strict=True) if not c]
                   for r in held[:samples]]
        started = time.perf_counter()
        answers = generate_ids(trainer, prompts, 1, 64, 60.0)
        out.update({"samples": samples, "samples_s": round(time.perf_counter() - started, 2),
                    "samples_new_tokens": [len(a) if a is not None else None for a in answers],
                    "samples_peak_mem_gib": peak()})
    return out


# ---------------------------------------------------------------- time to adapters

def write_word_model(directory: Path, cfg: dict, device: str) -> None:
    """The model (random weights, bf16 on GPU) and a word-level tokenizer of the same vocabulary, saved
    like a hub snapshot, so `python -m training.train` loads it as it would Qwen3-4B. Every word `wN`
    is one token, so a text row's token count is known."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>", "###", "Instruction:", "Input:", "Response:"]
    vocab = {w: i for i, w in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), cfg["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, "<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    model = make_model(cfg, device, "sdpa")
    model.config.pad_token_id, model.config.eos_token_id = 1, 0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def write_alpaca_text(path: Path, n: int, vocab: int, seed: int = 0) -> None:
    """n Alpaca-format JSON rows whose token counts under `write_word_model`'s tokenizer and the baseline's
    template follow make_alpaca_lengths (the template is 4 words, 6 with an input, against about 9
    and 14 tokens under Qwen3's tokenizer: the instruction and input make up the difference)."""
    rng = np.random.default_rng(seed + 2)
    rows = []
    for p, r in make_alpaca_lengths(n, seed):
        has_input = rng.random() < ALPACA["input_share"]
        words = p - 4 - (2 if has_input else 0)
        n_input = max(1, words // 3) if has_input else 0
        n_instr = max(1, words - n_input)
        text = lambda k: " ".join(f"w{int(x)}" for x in rng.integers(6, vocab, k))  # noqa: E731
        rows.append({"instruction": text(n_instr), "input": text(n_input) if n_input else "",
                     "output": text(max(1, r - 1))})  # - 1: the trainer appends EOS
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def time_to_adapters(cfg: dict, work: Path, rows: int, runs: list[tuple[str, dict, list[str]]],
                     timeout: int = 300, profile: bool = False) -> list[dict]:
    """Run `python -m training.train` (the production entry point, the baseline's config) as a fresh process
    per entry of `runs` (label, extra environment, extra flags of training/args.py) and time process start ->
    adapters written.
    `profile`: each run under cProfile (WORKDIR/tta-LABEL.prof, its top functions in tta-LABEL-profile.txt)."""
    model_dir, data = work / "model", work / "data.jsonl"
    if not (model_dir / "config.json").exists():
        t = time.time()
        write_word_model(model_dir, cfg, "cuda" if torch.cuda.is_available() else "cpu")
        print(f"saved the model in {time.time() - t:.1f} s", flush=True)
    write_alpaca_text(data, rows, cfg["vocab_size"])
    results = []
    for label, env_extra, flags in runs:
        out = work / f"out-{label}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", label)  # file names $OUT gives back
        prof = work / f"tta-{name}.prof"
        cmd = [sys.executable, *(["-m", "cProfile", "-o", str(prof)] if profile else []),
               "-m", "training.train", "--config", str(REPO / "training/configs/qwen3-4b-lora.yaml"),
               "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--n_examples", "0",
               "--output_dir", str(out), *flags]
        import subprocess

        started = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        ended = time.time()
        log_text = proc.stdout + proc.stderr
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"tta-{name}.log").write_text(log_text)
        adapters = out / "adapter_model.safetensors"
        metrics = next((json.loads(line.split(" ", 1)[1]) for line in log_text.splitlines()
                        if line.startswith("SLURM_GPU_METRICS ")), {})
        timing = metrics.get("timing", {})
        row = {"label": label, "env": env_extra, "flags": flags, "rc": proc.returncode,
               "time_to_adapters_s": round(timing["adapters_written"] - started, 2) if "adapters_written" in timing
               else (round(adapters.stat().st_mtime - started, 2) if adapters.exists() else None),
               "process_wall_s": round(ended - started, 2),
               "phases_s": {k: round(v - started, 2) for k, v in timing.items()},
               **{k: metrics.get(k) for k in ("train_steps", "train_tokens", "train_runtime", "tokens_per_s",
                                              "train_loss", "mean_token_accuracy", "compiled_layers",
                                              "compile_reason", "checkpoints_saved", "checkpoint_s",
                                              "choices")}}
        if (out / "metrics.json").exists():  # each rank's phases: metrics.json only (not the summary line)
            row["phases"] = json.loads((out / "metrics.json").read_text()).get("phases")
        if profile and prof.exists():
            row["profile"] = write_profile_summary(prof, work / f"tta-{name}-profile.txt")
        if proc.returncode:
            print(log_text[-4000:], flush=True)
        print(f"TTA {json.dumps(row)}", flush=True)
        results.append(row)
    return results


def write_profile_summary(prof: Path, text: Path, lines: int = 60) -> str:
    """The profile's top functions by cumulative time, as text (also copied to $OUT when set)."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(lines)
    text.write_text(buf.getvalue())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], text.name).write_text(buf.getvalue())
    return str(text)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 and a short workload (CPU check)")
    parser.add_argument("--workloads", default="long-258", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--examples", type=int, default=None, help="workload size (default 2000; tiny: 64)")
    parser.add_argument("--examples-per-step", default="16", help="comma-separated examples per optimizer step")
    parser.add_argument("--recipes", default="baseline,project",
                        help="comma-separated: baseline (the blog post's recipe; its old name `seed` works too), "
                             "project (compiles and graphs steps or not as train.py "
                             "decides), project-compiled, project-eager (step graphs as decided), "
                             "project-compiled-nographs, project-eager-graphs (step graphs forced off / on); "
                             "each project recipe with -flex: flex attention instead of varlen")
    parser.add_argument("--baseline-steps", "--seed-steps", dest="baseline_steps", type=int, default=12,
                        help="optimizer steps of the baseline recipe (0 = epoch)")
    parser.add_argument("--project-steps", type=int, default=0, help="optimizer steps of the project (0 = epoch)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the steady rates")
    parser.add_argument("--logging-steps", type=int, default=None,
                        help="log every N steps (default: each recipe's own: baseline 10, project as its config, 1)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="cap this process's GPU memory (an L4 offers about 22 GiB)")
    parser.add_argument("--time-to-adapters", default=None, metavar="WORKDIR",
                        help="instead: run `python -m training.train` on 250 Alpaca-length rows twice, with a "
                             "fresh then a warm compile cache (in WORKDIR), and time process start -> adapters")
    parser.add_argument("--tta-rows", type=int, default=250, help="rows of the time-to-adapters run")
    parser.add_argument("--tta-runs", default="cold,warm", help="cold,warm and/or eager,compiled (forced)")
    parser.add_argument("--tta-bytecode", choices=["node", "as-is"], default="node",
                        help="node: byte-compile the packages a run imports first, as pip does on a node "
                             "(benchmarks/node_bytecode.py); as-is: time the interpreter as it is")
    parser.add_argument("--tta-profile", action="store_true", help="run each time-to-adapters process under cProfile")
    parser.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--results-name", default=None, help="results file name suffix (default: the GPU)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results file")
    parser.add_argument("--profile", default=None, help="FIRST:LAST optimizer steps to profile (GPU)")
    parser.add_argument("--eval-rows", type=int, default=0,
                        help="hold out this many rows and, after training, evaluate on them as train.py does "
                             "(the row's after_training: each step's peak memory beside the training's)")
    parser.add_argument("--samples", type=int, default=0,
                        help="with --eval-rows: also answer this many held-out prompts greedily (64 new tokens)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible (use --device cpu --tiny)")
    if args.logging_steps is not None and args.logging_steps < 1:
        parser.error(f"--logging-steps {args.logging_steps}: log every N >= 1 steps (omit it for each recipe's own)")

    cfg = TINY if args.tiny else QWEN3_4B
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"date": dt.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
               "model": "tiny-qwen3" if args.tiny else "Qwen3-4B architecture, random weights",
               "peak_flops": PEAK_FLOPS, "workloads": {}, "rows": []}
    # The knobs a run may be given from outside (Inductor, cuBLAS, the trainer's switches), so a result says
    # which settings made it.
    results["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(KNOB_PREFIXES)}
    import peft
    import transformers  # noqa: E401
    import trl
    results["versions"] = {"transformers": transformers.__version__, "trl": trl.__version__,
                           "peft": peft.__version__}
    if args.memory_gib and args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
        results["memory_cap_gib"] = args.memory_gib

    if args.time_to_adapters:
        work = Path(args.time_to_adapters)
        cache = work / "compile-cache"
        runs = []
        for full in [x.strip() for x in args.tta_runs.split(",") if x.strip()]:
            env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
            flags: list[str] = []  # settings of training/args.py, as a user would give them
            label, _, graphs = full.partition("+")  # "+graphs" / "+nographs": step graphs forced on / off
            if graphs:
                if graphs not in ("graphs", "nographs"):
                    parser.error(f"--tta-runs: {label}+{graphs}: use +graphs or +nographs")
                flags += ["--cuda_graphs", "true" if graphs == "graphs" else "false"]
            if label == "cold":
                import shutil
                shutil.rmtree(cache, ignore_errors=True)
                runs.append((full, env, flags))
            elif label == "warm":
                runs.append((full, env, flags))
            elif label in ("eager", "compiled-cold", "compiled-warm"):
                flags += ["--compile_layers", "false" if label == "eager" else "true"]
                if label == "compiled-cold":
                    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "compile-cache-forced")
                    env["TRITON_CACHE_DIR"] = str(work / "compile-cache-forced" / "triton")
                runs.append((full, env, flags))
            else:
                parser.error(f"--tta-runs: unknown run {label!r}")
        if args.tta_bytecode == "node":
            from benchmarks.node_bytecode import RUN_IMPORTS, ensure_bytecode

            results["bytecode"] = ensure_bytecode(RUN_IMPORTS, {**os.environ}, REPO)
            print(f"bytecode: {json.dumps(results['bytecode'])}", flush=True)
            if results["bytecode"]["missing_after"]:
                print(f"WARNING: {results['bytecode']['missing_after']} modules still have no bytecode (read-only "
                      "packages?): the imports below are slower than a node's", flush=True)
        else:
            results["bytecode"] = "as-is"
        # each run is its own process: a cold run must not see the previous run's cache
        tta = []
        for label, env, flags in runs:
            if label.partition("+")[0] == "cold":
                import shutil
                shutil.rmtree(cache, ignore_errors=True)
            tta += time_to_adapters(cfg, work, args.tta_rows, [(label, env, flags)], profile=args.tta_profile)
        results["time_to_adapters"] = tta
        by = {r["label"]: r for r in tta}
        for label in ("cold", "warm"):
            if label in by:
                results[f"time_to_adapters_{label}_s"] = by[label]["time_to_adapters_s"]
        results["workloads"]["alpaca-102"] = workload_stats(make_alpaca_workload(args.tta_rows, cfg["vocab_size"]))
        suffix = args.results_name or gpu_slug(gpu, args.tiny) + "-time-to-adapters"
        if not args.no_write:
            write_results(results, args.results_dir / f"{results['date']}-{suffix}.json")
        return results

    n = args.examples or (64 if args.tiny else 2000)
    profile = tuple(int(x) for x in args.profile.split(":")) if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            if workload not in WORKLOADS:
                parser.error(f"--workloads: unknown workload {workload!r}; use {', '.join(WORKLOADS)}")
            rows = WORKLOADS[workload](n, cfg["vocab_size"], args.tiny)
            results["workloads"][workload] = workload_stats(rows)
            print(f"workload {workload}: {json.dumps(results['workloads'][workload])}", flush=True)
            for per_step in [int(x) for x in args.examples_per_step.split(",") if x.strip()]:
                for name in [OLD_NAMES.get(r.strip(), r.strip()) for r in args.recipes.split(",") if r.strip()]:
                    if name not in RECIPES:
                        parser.error(f"--recipes: unknown recipe {name!r}; use {', '.join(RECIPES)}")
                    steps = args.baseline_steps if name == "baseline" else args.project_steps
                    warmup = args.warmup_steps if args.warmup_steps is not None else (2 if name == "baseline" else 5)
                    started = time.time()
                    try:
                        row = run_recipe(name, rows, cfg, args.device, steps, warmup, tmp, None,
                                         recipe_logging_steps(name, args.logging_steps),
                                         profile if name.startswith("project") else None,
                                         examples_per_step=per_step, eval_rows=args.eval_rows,
                                         samples=args.samples)
                    except Exception as e:  # noqa: BLE001 - one failed recipe must not lose the others' figures
                        import traceback

                        traceback.print_exc()
                        kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
                        row = {"recipe": name, "examples_per_step": per_step, "error": f"{kind}: {e}"[:400]}
                        gc.collect()
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
                    row = {"gpu": gpu, "workload": workload, **row, "wall_s": round(time.time() - started, 1)}
                    if args.memory_gib:
                        row["memory_cap_gib"] = args.memory_gib
                    results["rows"].append(row)
                    print(f"BENCH {json.dumps(row)}", flush=True)
                base = next((r for r in results["rows"] if r["recipe"] == "baseline" and r["workload"] == workload
                             and r["examples_per_step"] == per_step and "tokens_per_s" in r), None)
                project = next((r for r in results["rows"] if r["recipe"].startswith("project")
                                and r["workload"] == workload
                                and r["examples_per_step"] == per_step and "tokens_per_s" in r), None)
                if base and project:
                    project["baseline_recipe_tokens_per_s"] = base["tokens_per_s"]
                    project["speedup"] = project["tokens_per_s"] / base["tokens_per_s"]
                    project["speedup_incl_warmup"] = (project["tokens_per_s_incl_warmup"]
                                                      / base["tokens_per_s_incl_warmup"])
    print(f"{'workload':11} {'ex/st':>5} {'recipe':8} {'tok/s':>9} {'MFU':>6} {'tok/s(all)':>10} {'peak GiB':>8} "
          f"{'runtime s':>9} {'loss':>7}")
    for r in results["rows"]:
        if "tokens_per_s" not in r:
            print(f"{r['workload']:11} {r['examples_per_step']:5} {r['recipe']:8} {r.get('error', '')[:80]}")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['workload']:11} {r['examples_per_step']:5} {r['recipe']:8} {r['tokens_per_s']:9.0f} {r['mfu']:6.1%} "
              f"{r['tokens_per_s_incl_warmup']:10.0f} {mem:>8} {r['train_runtime_s']:9.1f} {r['final_loss']!s:>7}")
        if r.get("after_training"):
            after = r["after_training"]
            print(f"{'':11} {'':5} after training: eval peak {after['eval_peak_mem_gib']!s} GiB, samples peak "
                  f"{after.get('samples_peak_mem_gib')!s} GiB (training {mem} GiB)")
    if not args.no_write:
        suffix = args.results_name or gpu_slug(gpu, args.tiny)
        write_results(results, args.results_dir / f"{results['date']}-{suffix}.json")
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
