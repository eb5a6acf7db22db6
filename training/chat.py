"""Checked rows (training/data.py) as the trainer's data set, with the loss on the answer only, and rows
longer than `max_length` counted and truncated or dropped (the `long_rows` setting).

Alpaca and prompt/completion rows stay text: TRL prompt/completion rows, which TRL tokenizes itself with the
loss on the completion (trl/trainer/sft_trainer.py, `completion_mask`). Chat rows (`messages`) go through the
tokenizer's own chat template here, already tokenized: `input_ids` and `assistant_masks` (1 on the tokens the
assistant wrote). TRL's `_prepare_dataset` takes a data set with `input_ids` as processed and builds the
labels from `assistant_masks` (-100 elsewhere), on both training paths.

The assistant mask comes from, in this order (`template_plan`):
1. the template's own `{% generation %}` markers: transformers' `apply_chat_template(...,
   return_assistant_tokens_mask=True)` (tokenization_utils_base.py), which is what TRL's
   `assistant_only_loss` relies on (sft_trainer.py: "only implemented for chat templates that support
   returning the assistant tokens mask via the `{% generation %}` keyword");
2. TRL's training version of a template it knows (trl/chat_template_utils.py `get_training_chat_template`:
   Qwen3, Llama 3, Gemma, ...: the same text with the markers added);
3. any other template: the assistant's spans found by rendering the conversation's prefixes (the text up to
   an assistant turn with the generation prompt, then up to the end of that turn) and marking the tokens
   whose first character lies in a span (the fast tokenizer's offsets). This needs a template that renders a
   prefix of a conversation as a prefix of the whole; one that does not is refused naming the fix.
The template used (which of the three, and its SHA-256) is recorded in the run's choices.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from training.data import DataError, Rows, text_rows

LONG_ROWS = ("truncate", "drop")
TOO_LONG = "longer than max_length"


@dataclass
class TemplatePlan:
    template: str
    markers: bool  # the template has {% generation %} markers
    how: str  # for the run's record

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.template.encode()).hexdigest()


@dataclass
class Report:
    """What became of the rows: their format, the template, and how many of each bad kind were left out."""

    format: str
    rows: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    long_rows: str = "truncate"
    template: dict | None = None

    def as_dict(self) -> dict:
        return {"format": self.format, "rows": self.rows, "dropped": dict(sorted(self.dropped.items())),
                "truncated": self.truncated, "long_rows": self.long_rows,
                **({"chat_template": self.template} if self.template else {})}

    def line(self) -> str:
        text = f"data: {self.rows} rows, format {self.format}"
        if self.template:
            text += f", chat template: {self.template['how']} (sha256 {self.template['sha256'][:12]})"
        if self.dropped:
            text += "; left out: " + ", ".join(f"{n} {k}" for k, n in sorted(self.dropped.items()))
        if self.truncated:
            text += f"; {self.truncated} truncated to max_length"
        return text


def template_plan(tokenizer) -> TemplatePlan:
    """Which template renders chat rows and how the assistant mask is found (see the module docstring)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    own = tokenizer.chat_template
    if isinstance(own, dict):  # named variants: the default one (as TRL does)
        own = own.get("default")
    if not own:
        raise DataError(f"chat rows (messages) need a chat template, and the tokenizer of "
                        f"{tokenizer.name_or_path} has none; use a model whose tokenizer has one, or give the "
                        "rows as prompt/completion")
    if has_generation_markers(own):
        return TemplatePlan(own, True, "the tokenizer's own, with {% generation %} markers")
    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError:  # a template TRL does not know
        patched = None
    if patched and has_generation_markers(patched):
        return TemplatePlan(patched, True, "TRL's training version of the tokenizer's template "
                                           "({% generation %} markers added)")
    return TemplatePlan(own, False, "the tokenizer's own, no generation markers: assistant spans found by "
                                    "rendering the conversation's prefixes")


def _render(tokenizer, template: str, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def encode_chat(tokenizer, plan: TemplatePlan, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, assistant mask) of one conversation rendered by plan's template."""
    if plan.markers:
        out = tokenizer.apply_chat_template(messages, chat_template=plan.template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text = _render(tokenizer, plan.template, messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = _render(tokenizer, plan.template, messages[:i], generation_prompt=True)
            end = _render(tokenizer, plan.template, messages[:i + 1])
            if not (end.startswith(start) and text.startswith(end)):
                raise DataError(f"the chat template of {tokenizer.name_or_path} does not render a conversation's "
                                "beginning as the beginning of the whole, so the assistant's tokens cannot be found; "
                                "use a template with {% generation %} markers (chat_template in the tokenizer)")
            spans.append((len(start), len(end)))
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    if 1 not in mask:
        raise DataError(f"the chat template of {tokenizer.name_or_path} marks no assistant token "
                        f"({plan.how}); check its {{% generation %}} markers")
    return ids, mask


def prompt_of(tokenizer, plan: TemplatePlan, messages: list[dict]) -> tuple[str, str]:
    """(the conversation up to its last assistant turn, with the generation prompt; that turn's text): what
    the sample answers give the model and compare with."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return _render(tokenizer, plan.template, messages[:last], generation_prompt=True), messages[last]["content"]


def prepare_dataset(rows: Rows, tokenizer=None, max_length: int | None = None, long_rows: str = "truncate"):
    """(`datasets.Dataset`, Report). Without a tokenizer (text formats only) no length is checked."""
    from datasets import Dataset

    if long_rows not in LONG_ROWS:
        raise DataError(f"long_rows={long_rows!r} is not allowed: set long_rows to one of {', '.join(LONG_ROWS)}")
    report = Report(rows.format, dropped=dict(rows.dropped), long_rows=long_rows)
    out = []
    if rows.format != "chat":
        for row in text_rows(rows):
            if tokenizer is not None and max_length:
                n = len(tokenizer(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"]) + 1
                if n > max_length:  # + 1: the EOS TRL appends
                    if long_rows == "drop":
                        report.dropped[TOO_LONG] = report.dropped.get(TOO_LONG, 0) + 1
                        continue
                    report.truncated += 1  # TRL truncates it (keep_start)
            out.append(row)
    else:
        if tokenizer is None:
            raise DataError("chat rows need the model's tokenizer (its chat template)")
        plan = template_plan(tokenizer)
        report.template = {"how": plan.how, "sha256": plan.sha256}
        for row in rows:
            ids, mask = encode_chat(tokenizer, plan, row["messages"])
            if max_length and len(ids) > max_length:
                ids, mask = ids[:max_length], mask[:max_length]
                if long_rows == "drop" or 1 not in mask:  # nothing of the answer left: nothing to train on
                    report.dropped[TOO_LONG] = report.dropped.get(TOO_LONG, 0) + 1
                    continue
                report.truncated += 1
            prompt, completion = prompt_of(tokenizer, plan, row["messages"])
            out.append({"input_ids": ids, "assistant_masks": mask, "prompt": prompt, "completion": completion})
    report.rows = len(out)
    if not out:
        raise DataError(f"no row is left to train on ({report.line()}); shorten the rows or raise max_length")
    return Dataset.from_list(out), report
