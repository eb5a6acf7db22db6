"""`fab chat`'s answering speed: time to first token and tokens/s of the chat server's own generation
(training/talk.py `answer`: greedy, streamed through TextIteratorStreamer) with LoRA adapters beside the base
model, for a first prompt on a freshly loaded model and for the prompts after it (the model stays loaded).

Model: the Qwen3-4B architecture with random weights (benchmarks/bench_train.py QWEN3_4B, `_from_config`, bf16 on
a GPU: no Hub access needed), or `--tiny` (bench_train.TINY, float32) to check the code path on CPU. Adapters: LoRA
r16/alpha 32 on q/k/v/o (the training config's), weights random and non-zero, unmerged as `fab chat` loads them.
Tokenizer: training/make_tiny.py's byte-level BPE (its ids are valid for both vocabularies). Prompts: `--prompts`
distinct ones of about `--prompt-tokens` tokens each, answered in turn, `--max-new-tokens` each.

    python -m benchmarks.bench_chat                          # GPU: writes a JSON result under benchmarks/results/
    python -m benchmarks.bench_chat --tiny --device cpu      # CPU: the code path

The goal (issue 42): after the first prompt, the first token within 2 s (`later_ttft_max_s`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_LATER_TTFT_S = 2.0
WORDS = ("the model answers questions about capitals rivers mountains numbers and words in order to show how "
         "quickly a tuned adapter streams its first token after a prompt arrives").split()


def make_tokenizer():
    from training.make_tiny import build_tokenizer, make_examples

    texts = [" ".join(WORDS)] + [f"{r['instruction']} {r['input']} {r['output']}" for r in make_examples(200, 0)]
    return build_tokenizer(texts)


def make_prompts(tokenizer, n: int, tokens: int) -> list[str]:
    """`n` distinct prompts of about `tokens` tokens (a cache of an earlier answer cannot help a later one)."""
    out = []
    for i in range(n):
        words, text = [], ""
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
            words += [WORDS[(i * 7 + len(words)) % len(WORDS)], str(i)]
            text = " ".join(words)
        out.append(text)
    return out


def make_model(tiny: bool, device: str, lora_r: int):
    import torch
    from peft import LoraConfig, get_peft_model

    from benchmarks import bench_train

    cfg = bench_train.TINY if tiny else bench_train.QWEN3_4B
    base = bench_train.make_model(cfg, device, "sdpa")
    base.generation_config.eos_token_id = None  # random weights: every answer runs its full length
    torch.manual_seed(1)
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, lora).to(base.dtype).eval()
    return model, cfg


def run(args) -> dict:
    import torch

    from training import talk

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_chat: no CUDA device; pass --device cpu (with --tiny)")
    tokenizer = make_tokenizer()
    t0 = time.perf_counter()
    model, cfg = make_model(args.tiny, args.device, args.lora_r)
    build_s = time.perf_counter() - t0
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_tokens)
    answers = []
    for i, prompt in enumerate(prompts):
        text = talk.prompt_text(tokenizer, "alpaca", prompt)
        stats = talk.answer(model, tokenizer, text, args.max_new_tokens)
        stats.pop("text")
        stats["prompt_tokens"] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        answers.append(stats)
        print(f"prompt {i + 1}: {stats['prompt_tokens']} tokens in, first token {stats['ttft_s']:.3f} s, "
              f"{stats['tokens']} tokens, {stats['tokens_per_s']} tokens/s", flush=True)
    later = answers[1:]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {
        "benchmark": "bench_chat", "date": dt.date.today().isoformat(), "gpu": device_name,
        "model": "tiny Qwen3" if args.tiny else "Qwen3-4B architecture, random weights",
        "config": cfg, "dtype": str(model.dtype).removeprefix("torch."), "lora_r": args.lora_r,
        "torch": torch.__version__, "build_s": round(build_s, 2), "max_new_tokens": args.max_new_tokens,
        "answers": answers,
        "first_ttft_s": answers[0]["ttft_s"],
        "later_ttft_max_s": max(a["ttft_s"] for a in later) if later else None,
        "later_tokens_per_s_mean": round(sum(a["tokens_per_s"] for a in later) / len(later), 2) if later else None,
        "goal_later_ttft_s": GOAL_LATER_TTFT_S,
    }
    result["meets_goal"] = result["later_ttft_max_s"] is not None and result["later_ttft_max_s"] <= GOAL_LATER_TTFT_S
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_chat", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen3 (float32) instead of the 4B architecture")
    p.add_argument("--prompts", type=int, default=5, help="prompts answered in turn (default 5)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="tokens per prompt (default 200)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: a new file under benchmarks/results/)")
    args = p.parse_args(argv)
    if args.prompts < 2:
        p.error("--prompts must be at least 2: the first prompt and one after it")
    result = run(args)
    out = args.out or RESULTS / f"chat-{'tiny-' if args.tiny else ''}{result['device'].split()[-1].lower()}-" \
                                f"{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    verdict = "met" if result["meets_goal"] else "MISSED"
    print(f"first prompt: first token {result['first_ttft_s']:.3f} s; later prompts: first token within "
          f"{result['later_ttft_max_s']:.3f} s (goal {GOAL_LATER_TTFT_S} s: {verdict}), "
          f"{result['later_tokens_per_s_mean']} tokens/s; {out}")
    return result


if __name__ == "__main__":
    main()
