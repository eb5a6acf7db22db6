"""The training settings' schema (training/settings_schema.py): `fab train`'s config check gives the same
verdicts from its cache as from the dataclasses, imports no TRL/transformers/torch once the cache is warm,
and never trusts a cache made for other code, other libraries or one that is damaged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training import settings_schema, validate

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("trl", "transformers", "torch", "peft", "accelerate")

# Bad configs and their messages: an unknown key with and without a near miss, the wrong type for each kind
# of setting, values outside a list or a range, and the text settings that take numbers.
BAD = {
    "near_miss": ({"learnig_rate": 2e-4}, "unknown setting 'learnig_rate': did you mean 'learning_rate'? remove "
                  "it or fix its name (the settings are the fields of training/args.py and TRL's SFTConfig)"),
    "unknown_far": ({"zzzz_qqq": 1}, "unknown setting 'zzzz_qqq': remove it or fix its name (the settings are the "
                    "fields of training/args.py and TRL's SFTConfig)"),
    "bool": ({"use_peft": "maybe"}, "use_peft: 'maybe' is the wrong type; set use_peft to true or false"),
    "int": ({"per_device_train_batch_size": 2.5}, "per_device_train_batch_size: 2.5 is the wrong type; set "
            "per_device_train_batch_size to a whole number"),
    "int_text": ({"gradient_accumulation_steps": "eight"}, "gradient_accumulation_steps: 'eight' is the wrong "
                 "type; set gradient_accumulation_steps to a whole number"),
    "float": ({"learning_rate": "fast"}, "learning_rate: 'fast' is the wrong type; set learning_rate to a number"),
    "bool_for_number": ({"learning_rate": True}, "learning_rate: True is the wrong type; set learning_rate to a "
                        "number"),
    "enum": ({"save_strategy": "sometimes"}, "save_strategy: 'sometimes' is the wrong type; set save_strategy to "
             "one of: no, steps, epoch, best"),
    # Today's code crashed here (TypeError: unhashable type: 'list'); the schema gives the message.
    "enum_given_a_list": ({"eval_strategy": ["steps"]}, "eval_strategy: ['steps'] is the wrong type; set "
                          "eval_strategy to one of: no, steps, epoch"),
    "list": ({"lora_target_modules": [1, 2]}, "lora_target_modules: [1, 2] is the wrong type; set "
             "lora_target_modules to a list"),
    "optional": ({"max_length": "long"}, "max_length: 'long' is the wrong type; set max_length to a whole number"),
    "mapping": ({"model_init_kwargs": 5}, "model_init_kwargs: 5 is the wrong type; set model_init_kwargs to a "
                "mapping or a string"),
    "literal_in_union": ({"trackio_static_space_id": 5}, "trackio_static_space_id: 5 is the wrong type; set "
                         "trackio_static_space_id to a string or Literal"),  # (sic: today's wording)
    "dataclass_choices": ({"dtype": "float64"}, "dtype: 'float64' is not allowed; set dtype to one of: auto, "
                          "bfloat16, float16, float32"),
    "trl_choices": ({"truncation_mode": "middle"}, "truncation_mode: 'middle' is not allowed; set truncation_mode "
                    "to one of: keep_end, keep_start"),
    "switch": ({"cuda_graphs": "sometimes"}, "cuda_graphs='sometimes' is not allowed: set cuda_graphs to one of "
               "auto, true, false"),
    "range": ({"learning_rate": 0, "max_steps": 0}, "learning_rate: 0 is out of range; it must be greater than 0 "
              "(e.g. 2e-4); max_steps: 0 is out of range; it must be -1 (use num_train_epochs) or at least 1"),
    "range_text": ({"learning_rate": "-2e-4"}, "learning_rate: '-2e-4' is out of range; it must be greater than 0 "
                   "(e.g. 2e-4)"),
    "str_given_a_number": ({"model_name_or_path": 12}, "model_name_or_path: 12 is the wrong type; set "
                           "model_name_or_path to a string"),
    "numbers_as_text_bool": ({"eval_split": True}, "eval_split: True is the wrong type; set eval_split to a string"),
    "several": ({"lora_rr": 8, "bf16": "sure", "save_total_limit": 0}, "unknown setting 'lora_rr': did you mean "
                "'lora_r'? remove it or fix its name (the settings are the fields of training/args.py and TRL's "
                "SFTConfig); bf16: 'sure' is the wrong type; set bf16 to true or false; save_total_limit: 0 is out "
                "of range; it must be at least 1 (checkpoints are what a requeued job resumes from)"),
}
GOOD = [{"eval_split": 32}, {"eval_split": 0.05}, {"eval_split": 0}, {"save_strategy": "epoch"},
        {"lora_target_modules": "all-linear"}, {"use_peft": "yes"}, {"learning_rate": "2e-4"}, {"report_to": "none"}]
# Every setting is also given each of these (a wrong type, a word, a list, a mapping, a number out of range).
PROBES = [True, "yes", "off", 0, -1, 2, 0.5, 1.5, "2e-4", "12", "abc", "", None, [], ["a"], [1], {"a": 1},
          "steps", "epoch", "linear", "adamw_torch", "auto", "bfloat16", "nf4", "keep_end", "STEPS", 2**40]


def verdict(data: dict) -> str | None:
    try:
        validate.check_config(data, "c.yaml")
    except validate.ConfigProblem as exc:
        return str(exc)
    return None


def battery() -> dict[str, str | None]:
    cases = {f"config {p.name}": yaml.safe_load(p.read_text()) for p in sorted((REPO / "training/configs").glob("*"))}
    cases |= {name: data for name, (data, _) in BAD.items()} | {f"good {i}": d for i, d in enumerate(GOOD)}
    cases |= {f"{key}={value!r}": {key: value} for key in validate.settings() for value in PROBES}
    return {name: verdict(data) for name, data in cases.items()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of its own; the in-process schema forgotten before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    settings_schema.schema.cache_clear()
    yield tmp_path / "xdg" / "slurm-gpu"
    settings_schema.schema.cache_clear()


@pytest.fixture
def generations(monkeypatch):
    """How many times the schema was read from the dataclasses."""
    calls = []
    real = settings_schema.generate

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(settings_schema, "generate", counted)
    return calls


def cache_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("training-settings-*"))


def test_cold_and_warm_give_the_same_verdicts_and_messages(cache, generations, monkeypatch):
    cold = battery()
    assert len(generations) == 1 and len(cache_files(cache)) == 1
    for name, (_, message) in BAD.items():
        assert cold[name] == f"--config c.yaml: {message}", name
    assert [cold[f"good {i}"] for i in range(len(GOOD))] == [None] * len(GOOD)
    assert cold["config qwen3-4b-lora.yaml"] is None and cold["config local-tiny.yaml"] is None
    assert len(cold) > 1000 and sum(v is not None for v in cold.values()) > 500  # the probes found mistakes

    settings_schema.schema.cache_clear()  # a new `fab train`: the schema comes from the file alone
    monkeypatch.setattr(settings_schema, "generate", lambda: pytest.fail("a warm cache was not used"))
    assert battery() == cold
    assert validate.default("model_name_or_path") == "Qwen/Qwen3-4B"
    assert validate.default("dataset_name") == "tatsu-lab/alpaca"
    # a default_factory's value (args.py's LoRA targets), kept in the file like any plain default
    assert validate.default("lora_target_modules") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert validate.default("no_such_setting") is None


def test_a_warm_check_imports_no_trl_transformers_or_torch(cache, tmp_path):
    settings_schema.schema()  # warm
    bad = tmp_path / "bad.yaml"
    bad.write_text("learnig_rate: 0.001\nuse_peft: maybe\n")
    script = f"""
import json, sys
from ops.actions import options
opts = options.parse(target="local")
try:
    options.parse(target="local", config={str(bad)!r})
    refused = None
except options.OptionError as exc:
    refused = str(exc)
print(json.dumps({{"model": opts.config_model, "refused": refused,
                  "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["heavy"] == []
    assert result["model"] == "/scratch/tiny/model"
    assert result["refused"] == (f"--config {bad}: unknown setting 'learnig_rate': did you mean 'learning_rate'? "
                                 "remove it or fix its name (the settings are the fields of training/args.py and "
                                 "TRL's SFTConfig); use_peft: 'maybe' is the wrong type; set use_peft to true or false")


def test_edited_args_py_makes_a_new_schema(cache, generations, tmp_path, monkeypatch):
    copies = []
    for source in settings_schema.SOURCES:
        copies.append(tmp_path / source.name)
        shutil.copy(source, copies[-1])
    monkeypatch.setattr(settings_schema, "SOURCES", tuple(copies))
    settings_schema.schema()
    settings_schema.schema.cache_clear()
    settings_schema.schema()
    assert len(generations) == 1  # the same code: the cache is used

    with copies[0].open("a") as f:  # args.py
        f.write("\n# a new setting would be here\n")
    settings_schema.schema.cache_clear()
    sources = settings_schema.schema()["key"]["sources"]
    assert len(generations) == 2
    assert len({json.loads(p.read_text())["key"]["sources"] for p in cache_files(cache)} | {sources}) == 2


@pytest.mark.parametrize("library", settings_schema.LIBRARIES)
def test_another_library_version_makes_a_new_schema(cache, generations, monkeypatch, library):
    settings_schema.schema()
    real = settings_schema._version
    monkeypatch.setattr(settings_schema, "_version", lambda name: "0.0.1-other" if name == library else real(name))
    settings_schema.schema.cache_clear()
    assert settings_schema.schema()["key"]["libraries"][library] == "0.0.1-other"
    assert len(generations) == 2


def _damaged(data: dict) -> list[str]:
    """Ways a cache file can be wrong: cut short, not JSON, the wrong shape, or another key's schema."""
    text = json.dumps(data)
    entry = next(iter(data["settings"]))

    def edited(change) -> str:
        copy = json.loads(text)
        change(copy)
        return json.dumps(copy)

    return [text[: len(text) // 2], "", "not json", "[]", "{}", json.dumps({**data, "settings": {}}),
            edited(lambda d: d["settings"][entry].pop("describe")),
            edited(lambda d: d["settings"][entry].update(type={"kind": "bogus"})),
            edited(lambda d: d["settings"][entry].update(type={"kind": "union", "of": [{"kind": "list"}]})),
            edited(lambda d: d["settings"][entry].update(choices=[1])),
            edited(lambda d: d["key"].update(sources="0" * 64)),
            edited(lambda d: d.pop("opaque_defaults"))]


def test_a_damaged_cache_is_made_again(cache, generations):
    expected = battery()
    path = cache_files(cache)[0]
    good = json.loads(path.read_text())
    for i, text in enumerate(_damaged(good)):
        path.write_text(text)
        settings_schema.schema.cache_clear()
        assert battery() == expected, i
        assert len(generations) == i + 2, i
        assert json.loads(path.read_text()) == good, i  # replaced by a whole one


def test_an_unwritable_cache_is_only_slower(tmp_path, monkeypatch, generations):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file where the folder would be
    settings_schema.schema.cache_clear()
    try:
        assert verdict(BAD["bool"][0]) == f"--config c.yaml: {BAD['bool'][1]}"
        assert len(generations) == 1
    finally:
        settings_schema.schema.cache_clear()


def test_the_cache_is_written_whole_by_a_rename(cache):
    settings_schema.schema()
    assert [p.name for p in cache.iterdir()] == [cache_files(cache)[0].name]  # no temporary file left behind
    assert settings_schema.valid(json.loads(cache_files(cache)[0].read_text()), settings_schema.cache_key())


def test_runs_at_once_never_read_half_a_file(cache):
    """Writers replace the file while a reader reads it: the reader sees a whole schema every time (a write
    in place would show it an empty or cut-short file)."""
    import threading

    data = settings_schema.schema()
    key, path = data["key"], cache_files(cache)[0]
    stop = threading.Event()

    def write():
        while not stop.is_set():
            settings_schema._write(path, data)

    writers = [threading.Thread(target=write) for _ in range(3)]
    for w in writers:
        w.start()
    try:
        reads = [settings_schema._read(path, key) for _ in range(300)]
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert all(r == data for r in reads)
    assert cache_files(cache) == [path] and [p.name for p in cache.iterdir()] == [path.name]
