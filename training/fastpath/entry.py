"""What training/train.py takes from the fast path: the model's attention, the trainer class, the collator.

training/padded.py offers the same three for TRL's padded batches; train.training_path picks one of them.
"""

from __future__ import annotations

from training.fastpath.attention import attention_implementation as _attention_for_setting
from training.fastpath.attention import register_packed_attention
from training.fastpath.batches import make_collator as _make_collator

NAME = "packed"


def attention_implementation(model_args, train_args) -> str:
    """The packed row's attention for the config's `attention` (registered with transformers first)."""
    register_packed_attention()
    return _attention_for_setting(getattr(train_args, "attention", "auto"))


def trainer_class():
    from training.fastpath.trainer import PackedSFTTrainer  # TRL is imported here, not with the package

    return PackedSFTTrainer


def make_collator(tokenizer, train_args):
    return _make_collator(tokenizer, train_args)
