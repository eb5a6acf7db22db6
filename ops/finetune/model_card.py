"""The model card (README.md) of a merged run (`fab merge`): what it was made from and how it did.

Read only from what `fab train` brought home to runs/<run>/ (run.json, metrics.json, adapter_config.json)
and the run's config as it ran (the job folder's config.yaml, read on the cluster): the base model, the data
source and its content hash, the data format and chat template the run detected, the LoRA and training
settings, and the held-out evaluation. The front matter is the Hub's model card metadata
(https://huggingface.co/docs/hub/model-cards#model-card-metadata): base_model, library_name, tags.
"""

from __future__ import annotations

import json
from pathlib import Path

from ops.finetune import runs


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


# Markdown's own characters in a value a job wrote: a link or an image (a tracking pixel) in the card
# the user publishes, or a `|` that breaks its table, become text.
_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`[]()!|"})


def _text(value) -> str:
    """A recorded value as one plain Markdown line (a job wrote some of these: no line breaks, no HTML,
    no Markdown of its own)."""
    if value is None:
        return "-"
    return " ".join(str(value).split()).replace("<", "&lt;").replace(">", "&gt;").translate(_MARKDOWN)


def render(run: Path, config_text: str | None) -> str:
    """README.md for the merged model of runs/<run>/ (`config_text`: the run's training YAML, if known)."""
    rec = runs._read(run / "run.json")
    m = runs._read(run / "metrics.json")
    adapter = runs._read(run / "adapter_config.json")
    choices = m.get("choices") if isinstance(m.get("choices"), dict) else {}

    def choice(key: str) -> str:
        c = choices.get(key)
        if not isinstance(c, dict):
            return "-"
        return f"{_text(c.get('value'))} ({_text(c.get('by'))})"

    base = rec.get("model") or adapter.get("base_model_name_or_path")
    hub_base = isinstance(base, str) and not base.startswith("/")
    ev = m.get("eval") if isinstance(m.get("eval"), dict) else {}
    base_ev = ev.get("base") if isinstance(ev.get("base"), dict) else {}
    tuned_ev = ev.get("tuned") if isinstance(ev.get("tuned"), dict) else {}
    targets = adapter.get("target_modules")
    targets = _text(", ".join(sorted(map(str, targets)))) if isinstance(targets, list) else _text(targets)
    front = ["---"] + ([f"base_model: {json.dumps(base)}"] if hub_base else []) + \
        ["library_name: transformers", "tags:", "- lora", "- merged", "- slurm-gpu", "---"]
    lines = [
        *front, "",
        f"# {_text(base).rsplit('/', 1)[-1]} fine-tuned with LoRA (run {run.name}), adapters merged", "",
        "The LoRA adapters of this run merged into the base model's weights (W + scale * B @ A, peft's "
        "`merge_and_unload`), saved as bf16 safetensors with the tokenizer and its chat template: "
        "`AutoModelForCausalLM.from_pretrained` or vLLM load it as any model.", "",
        "## Made from", "",
        "| | |", "|---|---|",
        f"| base model | {_text(base)} |",
        f"| data | {_text(rec.get('data') or rec.get('data_on_cluster'))} |",
        f"| data read on the cluster | {_text(rec.get('data_on_cluster'))} |",
        f"| data SHA-256 | {_text(rec.get('data_sha256'))} |",
        f"| data format | {choice('data_format')} |",
        f"| chat template | {choice('chat_template')} |",
        f"| config | {_text(rec.get('config'))} |",
        f"| LoRA | rank {_text(adapter.get('r'))}, alpha {_text(adapter.get('lora_alpha'))}, "
        f"dropout {_text(adapter.get('lora_dropout'))}; modules {targets} |",
        f"| training rows | {_text(m.get('train_rows'))} |",
        f"| ranks | {_text(m.get('world_size'))} ({_text(rec.get('nodes'))} node(s) x "
        f"{_text(rec.get('gpus_per_node'))} GPU(s), {_text(rec.get('gpu_type'))}) |",
        "",
        "## Results", "",
        "| | |", "|---|---|",
        f"| final training loss | {_num(m.get('last_loss'), '.4f')} |",
        f"| held-out rows | {_text(ev.get('rows'))} |",
        f"| held-out loss, base -> tuned | {_num(base_ev.get('loss'), '.4f')} -> {_num(tuned_ev.get('loss'), '.4f')} |",
        f"| held-out token accuracy, base -> tuned | {_num(base_ev.get('token_accuracy'), '.4f')} -> "
        f"{_num(tuned_ev.get('token_accuracy'), '.4f')} |",
        f"| tokens/s | {_num(m.get('tokens_per_s'), ',.0f')} |",
        "",
    ]
    if config_text:
        fence = "````" if "```" in config_text else "```"
        lines += ["## Training config", "", f"{fence}yaml", config_text.rstrip("\n"), fence, ""]
    return "\n".join(lines)
