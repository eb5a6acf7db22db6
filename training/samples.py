"""Sample answers: a few prompts answered greedily by the base model and by the tuned one, in samples.md.

The prompts are `samples_file`'s rows or, by default, the first held-out rows (with their reference answer).
Rank 0 answers them (the base before the first step, the tuned after the last), each answer bounded by
`sample_max_new_tokens` and all of them together by `sample_max_time_s` (generate's max_time), so they cost
seconds; they are what a user reads first to see what the fine-tune changed.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from training.data import DataError, load_local_rows, text_rows
from training.evaluate import _eager, base_model

SAMPLES_FILE = "samples.md"


def sample_prompts(k: int, samples_file: str | None, eval_rows) -> list[dict]:
    """[{"prompt", "reference"}] : the first `k` rows of samples_file, else of the held-out rows."""
    if not k:
        return []
    if samples_file:
        rows = load_local_rows(samples_file)
        if rows.format == "chat":
            raise DataError(f"samples_file {samples_file}: give instruction/input/output or prompt/completion rows "
                            "(chat rows are answered from the held-out rows: leave samples_file unset)")
        return [{"prompt": r["prompt"], "reference": r["completion"]} for r in text_rows(rows)[:k]]
    if eval_rows is None:
        return []
    return [{"prompt": eval_rows[i]["prompt"], "reference": eval_rows[i]["completion"]}
            for i in range(min(k, len(eval_rows)))]


def answer(trainer, tokenizer, prompts: list[dict], max_new_tokens: int, max_time_s: float) -> list[str]:
    """Greedy answers of the trainer's model as it stands, one prompt at a time (no padding)."""
    ids = [tokenizer(item["prompt"], return_tensors="pt")["input_ids"] for item in prompts]
    outs = generate_ids(trainer, ids, tokenizer.pad_token_id, max_new_tokens, max_time_s)
    return [tokenizer.decode(out, skip_special_tokens=True) if out is not None
            else "(no time left: sample_max_time_s)" for out in outs]


def generate_ids(trainer, prompt_ids: list, pad_token_id: int, max_new_tokens: int, max_time_s: float) -> list:
    """The new tokens (a 1-D tensor, None once max_time_s is spent) the trainer's model generates greedily
    after each prompt's token ids ([1, n] each), one prompt at a time."""
    from training.fastpath.model import unwrap

    model = getattr(trainer.model, "module", trainer.model)
    config = unwrap(model).config
    attention, use_cache = config._attn_implementation, config.use_cache
    # The packed path's attention takes a packed row's document layout; one plain prompt needs none.
    config._attn_implementation, config.use_cache = "sdpa", True
    was_training = model.training
    model.eval()
    outs = []
    deadline = time.monotonic() + max_time_s
    try:
        with torch.no_grad(), _eager(), trainer.compute_loss_context_manager():
            for ids in prompt_ids:
                left = deadline - time.monotonic()
                if left <= 0:
                    outs.append(None)
                    continue
                ids = torch.as_tensor(ids).reshape(1, -1).to(trainer.args.device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, max_time=left, pad_token_id=pad_token_id,
                                     use_cache=True)
                outs.append(out[0, ids.shape[1]:].cpu())
    finally:
        config._attn_implementation, config.use_cache = attention, use_cache
        model.train(was_training)
    return outs


def answer_base(trainer, tokenizer, prompts, max_new_tokens, max_time_s) -> list[str]:
    with base_model(trainer.model):
        return answer(trainer, tokenizer, prompts, max_new_tokens, max_time_s)


def _block(text: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}\n{text.rstrip()}\n{fence}"


def render(samples: list[dict]) -> str:
    out = ["# Sample answers", "",
           "Greedy answers of the base model and of the tuned adapters to the same prompts.", ""]
    for i, s in enumerate(samples, start=1):
        out += [f"## Sample {i}", "", "**Prompt**", "", _block(s["prompt"]), "", "**Base**", "", _block(s["base"]),
                "", "**Tuned**", "", _block(s["tuned"]), ""]
        if s.get("reference"):
            out += ["**Reference**", "", _block(s["reference"]), ""]
    return "\n".join(out)


def write(output_dir: str, samples: list[dict]) -> Path:
    path = Path(output_dir) / SAMPLES_FILE
    path.write_text(render(samples), encoding="utf-8")
    return path
