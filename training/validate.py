"""A training config's contents checked on the user's machine, before any host is touched.

TrlParser would refuse an unknown key or a wrong type only inside the job, minutes later and
buried in a log. `check_config` applies the same rules to the YAML mapping (the settings are
the dataclasses of training/args.py) plus ranges, and names the key and the fix. The settings' types
and defaults come from training/settings_schema.py (cached: no TRL, transformers or torch import once
warm); importable wherever training/ is (the GPU nodes too).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from training import settings_schema
from training.choices import CHOICES, choice

_BOOL_WORDS = {"true", "false", "yes", "no", "t", "f", "y", "n", "1", "0"}

# key -> (is the value allowed, what it must be). Values are already of the right type.
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "learning_rate": (lambda v: v > 0, "greater than 0 (e.g. 2e-4)"),
    "num_train_epochs": (lambda v: v > 0, "greater than 0 (e.g. 1)"),
    "per_device_train_batch_size": (lambda v: v >= 1, "at least 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "at least 1"),
    "max_length": (lambda v: v >= 1, "at least 1 token (e.g. 1024)"),
    "max_steps": (lambda v: v == -1 or v >= 1, "-1 (use num_train_epochs) or at least 1"),
    "logging_steps": (lambda v: v > 0, "greater than 0"),
    "save_steps": (lambda v: v > 0, "greater than 0"),
    "save_total_limit": (lambda v: v >= 1, "at least 1 (checkpoints are what a requeued job resumes from)"),
    "warmup_steps": (lambda v: v >= 0, "0 or more"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "weight_decay": (lambda v: v >= 0, "0 or more"),
    "n_examples": (lambda v: v >= 0, "0 (all rows) or more"),
    "lora_r": (lambda v: v >= 1, "at least 1 (e.g. 16)"),
    "lora_alpha": (lambda v: v > 0, "greater than 0 (e.g. 32)"),
    "lora_dropout": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "seed": (lambda v: v >= 0, "0 or more"),
    "dataloader_num_workers": (lambda v: v >= 0, "0 or more"),
    "hang_timeout_factor": (lambda v: v == 0 or v >= 2, "0 (no hang watchdog) or at least 2 (e.g. 10)"),
    "hang_timeout_floor_s": (lambda v: v >= 5, "at least 5 seconds (e.g. 600)"),
    "hang_first_step_s": (lambda v: v >= 5, "at least 5 seconds (e.g. 1800)"),
}


class ConfigProblem(ValueError):
    pass


def settings() -> dict[str, dict]:
    """Every setting training.train accepts: name -> {"type": form, "describe": text, "choices": [...]}
    (training/settings_schema.py; cached, so the check imports no TRL once the cache is warm)."""
    return settings_schema.schema()["settings"]


def default(key: str):
    """The default of setting `key` in training/args.py (None when it has none)."""
    schema = settings_schema.schema()
    if key in schema["opaque_defaults"]:
        return settings_schema.live_default(key)
    return schema["defaults"].get(key)


# Text settings whose documented values include plain numbers (training/args.py: eval_split is a count, a
# fraction, 0 or auto): YAML's 32, 0.05 and 0 are meant, unlike a number where a name belongs.
NUMBERS_AS_TEXT = frozenset({"eval_split"})


def _fits(value, form: dict) -> bool:
    """Whether TrlParser would accept `value` (from YAML) for a field whose type has shape `form`
    (training/settings_schema.py's `form`, which follows these branches)."""
    kind = form["kind"]
    if kind == "union":
        enums = [a for a in form["of"] if a["kind"] == "enum"]
        if enums and isinstance(value, str):  # `SaveStrategy | str`: the string must name a member
            return any(_fits(value, e) for e in enums)
        return any(_fits(value, a) for a in form["of"])
    if kind == "none":
        return value is None
    if kind == "literal":
        return value in form["values"]
    if kind == "bool":
        return isinstance(value, bool) or (isinstance(value, (str, int)) and str(value).lower() in _BOOL_WORDS)
    if kind in ("int", "float"):
        if isinstance(value, bool):
            return False
        if isinstance(value, int) or (kind == "float" and isinstance(value, float)):
            return True
        if isinstance(value, str):  # argparse converts string defaults ("2e-4")
            try:
                (int if kind == "int" else float)(value)
                return True
            except ValueError:
                return False
        return False
    if kind == "str":  # `model_name_or_path: 12` is a mistake, not the Hub ID "12": YAML must give a string
        return isinstance(value, str)
    if kind == "enum":
        return value in form["values"] or value in form["names"]
    if kind == "list":  # a string is accepted too (e.g. lora_target_modules: all-linear)
        if isinstance(value, str):
            return True
        return isinstance(value, list) and (form["item"] is None or all(_fits(v, form["item"]) for v in value))
    if kind == "mapping":
        return isinstance(value, (dict, str))
    return True  # anything else: left to the parser


_INT, _FLOAT = {"kind": "int"}, {"kind": "float"}


def _number(value):
    for t, shape in ((int, _INT), (float, _FLOAT)):
        if _fits(value, shape) and (t is float or not isinstance(value, float)):
            try:
                return t(value)
            except (TypeError, ValueError):
                continue
    return None


def check_config(data: dict, source: str) -> None:
    """Raise ConfigProblem naming every bad key of the training config `data` (read from `source`)."""
    known = settings()
    problems = []
    for key, value in data.items():
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            problems.append(f"unknown setting '{key}': {hint}remove it or fix its name "
                            "(the settings are the fields of training/args.py and TRL's SFTConfig)")
            continue
        shape, choices = known[key]["type"], known[key]["choices"]
        if key in CHOICES:  # auto/true/false switches and other fixed lists: the parser's own check
            try:
                choice(key, value)
            except ValueError as e:
                problems.append(str(e))
            continue
        numeric_text = key in NUMBERS_AS_TEXT and isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric_text and not _fits(value, shape):
            problems.append(f"{key}: {value!r} is the wrong type; set {key} to {known[key]['describe']}")
            continue
        if choices and value not in choices:
            problems.append(f"{key}: {value!r} is not allowed; set {key} to one of: {', '.join(choices)}")
            continue
        if key in RANGES and value is not None:
            ok, what = RANGES[key]
            number = _number(value)
            if number is not None and not ok(number):
                problems.append(f"{key}: {value!r} is out of range; it must be {what}")
    if problems:
        raise ConfigProblem(f"--config {source}: " + "; ".join(problems))
