"""TRL's own padded batches (the baseline recipe): what training/train.py takes from this path.

The same three functions as training/fastpath/entry.py; train.training_path picks one of the two modules.
"""

from __future__ import annotations

NAME = "padded"


def attention_implementation(model_args, train_args) -> str | None:
    return model_args.attn_implementation


def trainer_class():
    from trl import SFTTrainer

    return SFTTrainer


def make_collator(tokenizer, train_args):
    """None: TRL's own collator (padded batches, labels -100 on prompt and padding)."""
    return None
