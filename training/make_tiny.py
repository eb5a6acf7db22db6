"""Make a tiny Qwen3-architecture model and a synthetic Alpaca-format data set, offline, in seconds.

The local cluster and the tests train on these instead of Qwen3-4B and tatsu-lab/alpaca: same code
path (Qwen3 architecture, a Hugging Face tokenizer, instruction/input/output rows), nothing
downloaded, small enough to train on CPU.

    python -m training.make_tiny --out /scratch/tiny [--examples 400 --seed 0]

writes OUT/model (config, random weights, tokenizer) and OUT/data/train.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from training.data import format_prompt

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# A ChatML-style chat template without {% generation %} markers (like many models' own), so chat rows run on the
# tiny model through training/chat.py's prefix-rendering mask.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A fixed table the model can memorise: capital questions with an empty `input`.
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
    "Peru": "Lima", "Kenya": "Nairobi", "Chile": "Santiago", "Norway": "Oslo", "Greece": "Athens",
    "Canada": "Ottawa", "Cuba": "Havana",
}
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "rock", "star"]


def make_examples(n: int, seed: int) -> list[dict[str, str]]:
    """`n` Alpaca-format rows from three simple tasks; the same (n, seed) gives the same rows."""
    rng = random.Random(seed)
    countries = sorted(CAPITALS)
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            country = rng.choice(countries)
            rows.append({"instruction": f"What is the capital of {country}?", "input": "",
                         "output": f"The capital of {country} is {CAPITALS[country]}."})
        elif kind == 1:
            words = rng.sample(WORDS, rng.randint(2, 5))
            rows.append({"instruction": "Reverse the order of these words.", "input": " ".join(words),
                         "output": " ".join(reversed(words))})
        else:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            if rng.random() < 0.5:
                rows.append({"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)})
            else:
                rows.append({"instruction": "Add these two numbers.", "input": f"{a} and {b}",
                             "output": str(a + b)})
    return rows


def build_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on `texts`: any text encodes (bytes are the base alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   chat_template=CHAT_TEMPLATE)


def build_model(tokenizer, seed: int):
    """A 2-layer Qwen3 with random weights (GQA: 4 query heads, 2 KV heads, head_dim 16)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        # Wider than the usual 0.02 so that logits can move far enough for the loss to fall within one short epoch.
        initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def make_tiny(out: Path, examples: int = 400, seed: int = 0) -> tuple[Path, Path]:
    """Write OUT/model and OUT/data/train.jsonl; return their paths."""
    rows = make_examples(examples, seed)
    data_file = out / "data" / "train.jsonl"
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # Train the tokenizer on exactly what the trainer will see: prompt template + response.
    texts = [format_prompt(r["instruction"], r["input"]) + r["output"] for r in rows]
    tokenizer = build_tokenizer(texts)
    model = build_model(tokenizer, seed)
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for f in model_dir.iterdir():  # safetensors writes 0600: the jobs' user (not its maker) reads it
        f.chmod(0o644)
    return model_dir, data_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (model/ and data/ go in it)")
    parser.add_argument("--examples", type=int, default=400, help="number of synthetic rows (default 400)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data and the weights (default 0)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    model_dir, data_file = make_tiny(args.out, args.examples, args.seed)
    print(f"tiny model: {model_dir}\nsynthetic data ({args.examples} rows): {data_file}")


if __name__ == "__main__":
    main()
