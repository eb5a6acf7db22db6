"""The chat server of `fab chat`: a run's tuned adapters on their base model, answering prompts from stdin with
streamed tokens on stdout (training/talk_protocol.py), the model loaded once for every prompt.

    python -m training.talk --base /scratch/.../model --adapters <job dir>/output --format alpaca

`fab chat` starts it as a one-task Slurm step on one GPU node (ops/finetune/chat_session.py); prompts arrive on stdin,
never on a command line. A prompt is put in the shape the run trained on (`--format`, the run's `data_format`
choice): Alpaca rows get the Alpaca prompt (training/data.py format_prompt), prompt/completion rows the prompt as
it is, chat rows one user turn through the tokenizer's own chat template with its generation prompt.

Each answer is greedy and streamed as the tokenizer decodes it (transformers' TextIteratorStreamer, fed by
`generate` in a thread); the time to the first token counts from the prompt's arrival to the first new token
(counted in the streamer's `put`, before the text decoder waits for a word's end), and tokens/s is the rate
of the tokens after it. A short warm-up answer runs before `ready`, so the first prompt pays no one-time costs.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from training.talk_protocol import ProtocolError, event, read_prompt

FORMATS = ("alpaca", "prompt_completion", "chat")


def prompt_text(tokenizer, fmt: str, prompt: str) -> str:
    """`prompt` in the shape the run trained on (see the module docstring)."""
    if fmt == "alpaca":
        from training.data import format_prompt

        return format_prompt(prompt)
    if fmt == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def load(base: str, adapters: str, device: str | None = None):
    """(model, tokenizer): the base model in bf16 on a GPU (float32 on a CPU) with the adapters on it, in eval
    mode. The tokenizer is the adapters' folder's when the run saved one there, else the base model's."""
    import os

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    has_tokenizer = os.path.exists(os.path.join(adapters, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(adapters if has_tokenizer else base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
    model = PeftModel.from_pretrained(model, adapters).eval()
    return model, tokenizer


class _Stream:
    """A TextIteratorStreamer that also notes when the first new token came and how many came."""

    def __new__(cls, tokenizer):
        from transformers import TextIteratorStreamer

        class Counting(TextIteratorStreamer):
            first_at: float | None = None
            tokens = 0

            def put(self, value):
                if not self.next_tokens_are_prompt:  # the first put is the prompt itself
                    if self.first_at is None:
                        self.first_at = time.perf_counter()
                    self.tokens += int(value.numel())
                super().put(value)

        return Counting(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)


def answer(model, tokenizer, text: str, max_new_tokens: int, on_text=None) -> dict:
    """Greedy answer to `text` (already in its prompt shape), each decoded piece handed to `on_text` as it
    comes; returns {"text", "ttft_s", "tokens", "tokens_per_s", "seconds"}."""
    import torch

    start = time.perf_counter()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    stream = _Stream(tokenizer)
    failed: list[BaseException] = []

    def generate():
        try:
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
                               if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                               streamer=stream)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            failed.append(exc)
            stream.end()

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    pieces = []
    for piece in stream:
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)
    worker.join()
    end = time.perf_counter()
    if failed:
        raise failed[0]
    first = stream.first_at
    ttft = (first - start) if first is not None else None
    rest = end - first if first is not None else 0.0
    rate = (stream.tokens - 1) / rest if stream.tokens > 1 and rest > 0 else None
    return {"text": "".join(pieces), "ttft_s": None if ttft is None else round(ttft, 4), "tokens": stream.tokens,
            "tokens_per_s": None if rate is None else round(rate, 2), "seconds": round(end - start, 4)}


def serve(model, tokenizer, fmt: str, max_new_tokens: int, lines, out=None) -> int:
    """Answer every prompt line of `lines` (the protocol's), writing events to `out`; returns how many."""
    out = out or sys.stdout

    def say(kind: str, value) -> None:
        out.write(event(kind, value) + "\n")
        out.flush()

    answered = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            prompt = read_prompt(line)
        except ProtocolError as exc:
            say("error", str(exc))
            continue
        try:
            stats = answer(model, tokenizer, prompt_text(tokenizer, fmt, prompt), max_new_tokens,
                           on_text=lambda piece: say("token", piece))
        except Exception as exc:  # noqa: BLE001 - one prompt failed; the next may not
            say("error", f"{type(exc).__name__}: {exc}")
            continue
        stats.pop("text")
        say("done", stats)
        answered += 1
    return answered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.talk", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the base model's folder")
    p.add_argument("--adapters", required=True, help="the run's output folder (adapter_config.json ...)")
    p.add_argument("--format", choices=FORMATS, default="alpaca", help="the run's data format")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model, tokenizer = load(args.base, args.adapters, args.device)
    load_s = time.perf_counter() - t0
    answer(model, tokenizer, prompt_text(tokenizer, args.format, "Hello"), 2)  # warm-up: one-time costs here
    print(event("ready", {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
                          "load_s": round(load_s, 3), "warmup_s": round(time.perf_counter() - t0 - load_s, 3),
                          "format": args.format}), flush=True)
    serve(model, tokenizer, args.format, args.max_new_tokens, sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
