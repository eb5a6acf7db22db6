"""The settings with a fixed list of values, and their canonical spelling: plain data and string work.

Kept apart from training/args.py (which imports TRL, transformers and torch) so that `fab train`'s check of
a config (training/validate.py) reads them on the user's machine without those imports.
"""

from __future__ import annotations

# Switches of the GPU fast path that it may also decide itself: `auto` lets it choose (and say why, in the
# log's "run choices" block and metrics.json's `choices`); `true`/`false` are the user's word.
AUTO_SWITCH = ("auto", "true", "false")
_WORDS = {"auto": "auto", "true": "true", "on": "true", "yes": "true", "1": "true",
          "false": "false", "off": "false", "no": "false", "0": "false"}
# Settings with a fixed list of values (the switches above, and these), checked after parsing: a YAML
# value never meets argparse's own checks.
CHOICES: dict[str, tuple[str, ...]] = {
    "flex_packing": AUTO_SWITCH, "activation_checkpointing": AUTO_SWITCH, "compile_layers": AUTO_SWITCH,
    "cuda_graphs": AUTO_SWITCH, "attention": ("auto", "varlen", "flex"), "step_layout": ("auto", "as_configured"),
    "long_rows": ("truncate", "drop"),
    "sharding": ("auto", "none", "fsdp"),
}


def choice(name: str, value) -> str:
    """`value` of setting `name` in its canonical spelling; a clear error naming the allowed values."""
    allowed = CHOICES[name]
    word = value if value is None else ("true" if value is True else "false" if value is False else
                                        str(value).strip().lower())
    if allowed == AUTO_SWITCH:
        word = "auto" if word is None else _WORDS.get(word, word)
    if word not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: set {name} to one of {', '.join(allowed)}")
    return word


def switch(value: str) -> bool | None:
    """A canonical AUTO_SWITCH value as True / False / None (auto)."""
    return {"true": True, "false": False, "auto": None}[value]
