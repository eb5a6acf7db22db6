"""training/: prompt format, data validation, settings, the tiny model maker (fast; no training)."""

import json
from pathlib import Path

import pytest

from training import train
from training.args import parse_args
from training.data import DataError, format_prompt, load_instruction_dataset
from training.make_tiny import main as make_tiny_main
from training.make_tiny import make_examples, make_tiny

CONFIGS = Path(train.__file__).resolve().parent / "configs"



# ---------------------------------------------------------------- prompt

def test_prompt_without_input_has_no_input_block():
    assert format_prompt("Name a colour.", "") == "### Instruction:\nName a colour.\n\n### Response:\n"
    assert format_prompt("Name a colour.", "   ") == format_prompt("Name a colour.", "")
    assert format_prompt("Name a colour.", None) == format_prompt("Name a colour.", "")


def test_prompt_with_input_joins_it():
    assert format_prompt("Reverse these words.", "a b c") == (
        "### Instruction:\nReverse these words.\n\n### Input:\na b c\n\n### Response:\n"
    )


def test_rows_become_prompt_completion(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"instruction": "Add 1 and 2.", "output": "3"}) + "\n"
                 + json.dumps({"instruction": "Add these.", "input": "4 and 5", "output": "9"}) + "\n"
                 + json.dumps({"instruction": "Say hi.", "input": None, "output": "hi"}) + "\n")
    ds = load_instruction_dataset(str(f))
    assert ds.column_names == ["prompt", "completion"]
    assert ds[0] == {"prompt": "### Instruction:\nAdd 1 and 2.\n\n### Response:\n", "completion": "3"}
    assert "### Input:\n4 and 5\n\n" in ds[1]["prompt"] and ds[1]["completion"] == "9"
    assert "### Input" not in ds[2]["prompt"]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet", "dir"])
def test_local_formats_and_n_examples(tmp_path, fmt):
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)]
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = tmp_path / "dir"
        path.mkdir()
        (path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
        (path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[3:]))
        (path / "notes.txt").write_text("ignored")
    assert [r["completion"] for r in load_instruction_dataset(str(path))] == [f"a{i}" for i in range(5)]
    assert [r["completion"] for r in load_instruction_dataset(str(path), n_examples=2)] == ["a0", "a1"]


def test_hub_ids_load_the_first_n_rows_of_the_split(monkeypatch):
    # No network here: stand in for the hub with an in-memory data set; the check is what we ask for.
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"instruction": "Say hi.", "input": "", "output": "hi", "text": "x"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_instruction_dataset("tatsu-lab/alpaca", n_examples=2000)
    assert calls == [("tatsu-lab/alpaca", None, "train[:2000]")]
    assert ds[0] == {"prompt": format_prompt("Say hi."), "completion": "hi"}

    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: datasets.Dataset.from_list([{"instruction": "x", "response": "y"}]))
    with pytest.raises(DataError, match="some/set: missing column 'output'"):
        load_instruction_dataset("some/set")


# ---------------------------------------------------------------- bad data, before the model loads

def _bad_file(tmp_path, case):
    if case == "missing_output":
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n" + json.dumps({"instruction": "x"}) + "\n")
        return f, ["'output'", "row 2", str(f)]
    if case == "missing_instruction_parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        f = tmp_path / "bad.parquet"
        pq.write_table(pa.Table.from_pylist([{"prompt": "x", "output": "y"}]), f)
        return f, ["'instruction'", str(f)]
    if case == "empty":
        f = tmp_path / "empty.jsonl"
        f.write_text("")
        return f, ["empty", str(f)]
    if case == "empty_json_list":
        f = tmp_path / "empty.json"
        f.write_text("[]")
        return f, ["empty", str(f)]
    if case == "unsupported":
        f = tmp_path / "data.csv"
        f.write_text("instruction,output\nx,y\n")
        return f, ["unsupported", ".csv", ".jsonl", str(f)]
    if case == "malformed_line":
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n\n{not json\n")
        return f, ["line 3", "not valid JSON", str(f)]
    if case == "not_a_string":
        f = tmp_path / "bad.json"
        f.write_text(json.dumps([{"instruction": "x", "output": 7}]))
        return f, ["'output'", "row 1", "string"]
    if case == "missing_file":
        return tmp_path / "nope.jsonl", ["no such data file", "nope.jsonl"]
    raise AssertionError(case)


BAD_CASES = ["missing_output", "missing_instruction_parquet", "empty", "empty_json_list", "unsupported",
             "malformed_line", "not_a_string", "missing_file"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_data_fails_before_model_load(tmp_path, case):
    path, expected = _bad_file(tmp_path, case)
    # The model path does not exist: if the model were loaded first, the error would be an OSError about it.
    argv = ["--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", str(path),
            "--output_dir", str(tmp_path / "out")]
    with pytest.raises(DataError) as err:
        train.main(argv)
    for text in expected:
        assert text in str(err.value)
    assert not (tmp_path / "out").exists()


def test_bad_data_cli_exit_code_and_message(tmp_path, capsys):
    path, expected = _bad_file(tmp_path, "missing_output")
    with pytest.raises(SystemExit) as exit_:
        train.cli(["--config", str(CONFIGS / "local-tiny.yaml"), "--model_name_or_path", str(tmp_path / "no-model"),
                   "--dataset_name", str(path), "--output_dir", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "training data error" in err and "missing column 'output'" in err and "Traceback" not in err


# ---------------------------------------------------------------- settings

def test_defaults_are_the_baseline_recipe():
    data, model, cfg = parse_args([])
    assert (data.dataset_name, data.n_examples) == ("tatsu-lab/alpaca", 2000)
    assert model.model_name_or_path == "Qwen/Qwen3-4B" and model.use_peft
    assert (model.lora_r, model.lora_alpha, model.lora_dropout) == (16, 32, 0.05)
    assert model.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (cfg.learning_rate, cfg.num_train_epochs) == (2e-4, 1.0)
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.max_length) == (2, 8, 1024)
    # Logging: TensorBoard events beside the adapters (report_to), as Transformers/TRL scripts do.
    assert cfg.ddp_find_unused_parameters is False and cfg.report_to == ["tensorboard"]
    assert cfg.save_steps > 0 and cfg.logging_steps == 1


def test_gpu_config_matches_seed_and_flags_override():
    data, model, cfg = parse_args(["--config", str(CONFIGS / "qwen3-4b-lora.yaml"), "--learning_rate", "1e-4"])
    assert model.model_name_or_path == "Qwen/Qwen3-4B" and model.dtype == "bfloat16"
    assert data.dataset_name == "tatsu-lab/alpaca" and data.n_examples == 2000
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (2, 8)
    assert cfg.learning_rate == 1e-4  # the flag wins over the config
    # auto: the baseline's recomputation on padded batches; the packed path decides for itself (and says so).
    assert cfg.activation_checkpointing is True and cfg.activation_checkpointing_setting == "auto"
    # This machine has no GPU: the config's bf16 gives way to fp32 on CPU (gloo via use_cpu).
    assert cfg.bf16 is False and cfg.use_cpu is True


def test_unknown_setting_in_config_is_an_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learning_rat: 0.1\n")
    with pytest.raises(ValueError, match="learning_rat"):
        parse_args(["--config", str(cfg)])


def test_flex_packing_resolution():
    assert train.resolve_flex_packing(None, gpu=True) is True  # auto: the fast path with a GPU
    assert train.resolve_flex_packing(None, gpu=False) is False
    assert train.resolve_flex_packing(False, gpu=True) is False
    assert train.resolve_flex_packing(True, gpu=False) is True


@pytest.mark.parametrize("key, value, canonical", [
    ("flex_packing", True, "true"), ("compile_layers", "off", "false"), ("cuda_graphs", None, "auto"),
    ("activation_checkpointing", "AUTO", "auto"), ("attention", "Flex", "flex"), ("step_layout", "auto", "auto")])
def test_switches_take_auto_true_false(tmp_path, key, value, canonical):
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({key: value}))
    data, _, train_args = parse_args(["--config", str(cfg)])
    setting = getattr(data, key, None) if key == "flex_packing" else getattr(
        train_args, "activation_checkpointing_setting" if key == "activation_checkpointing" else key)
    assert setting == canonical


@pytest.mark.parametrize("argv, message", [
    (["--compile_layers", "maybe"], "compile_layers='maybe' is not allowed: set compile_layers to one of auto, true, "
                                    "false"),
    (["--attention", "fast"], "attention='fast' is not allowed: set attention to one of auto, varlen, flex"),
    (["--step_layout", "16x1"], "step_layout='16x1' is not allowed: set step_layout to one of auto, as_configured"),
    (["--flex_packing", "sometimes"], "flex_packing='sometimes' is not allowed")])
def test_bad_switch_values_name_the_setting(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_args(argv)


def test_bad_switch_in_a_config_is_caught_before_launch():
    from training.validate import ConfigProblem, check_config

    with pytest.raises(ConfigProblem, match="cuda_graphs='sometimes' is not allowed: set cuda_graphs to one of auto"):
        check_config({"cuda_graphs": "sometimes", "compile_layers": True, "attention": "varlen"}, "c.yaml")
    check_config({"cuda_graphs": "auto", "compile_layers": False, "defer_logs": True, "step_layout": "auto"}, "c.yaml")


def test_project_configs_say_auto_for_the_gpu_choices():
    """qwen3-4b-lora.yaml leaves the GPU's choices to the fast path in words, not by omission."""
    import yaml

    config = yaml.safe_load((CONFIGS / "qwen3-4b-lora.yaml").read_text())
    for key in ("flex_packing", "step_layout", "activation_checkpointing", "attention", "compile_layers", "cuda_graphs"):
        assert config[key] == "auto", key
    assert (config["per_device_train_batch_size"], config["gradient_accumulation_steps"]) == (2, 8)


def test_resume_checkpoint_skips_incomplete(tmp_path):
    assert train.find_resume_checkpoint(str(tmp_path / "fresh")) is None
    assert train.find_resume_checkpoint(str(tmp_path)) is None
    for step, complete in [(5, True), (10, True), (15, False)]:
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            (d / "trainer_state.json").write_text("{}")
    assert train.find_resume_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


# ---------------------------------------------------------------- tiny model and data

def test_synthetic_data_is_deterministic_and_alpaca_shaped():
    a, b, c = make_examples(60, seed=1), make_examples(60, seed=1), make_examples(60, seed=2)
    assert a == b and a != c
    assert all(set(r) == {"instruction", "input", "output"} and r["output"] for r in a)
    with_input = sum(1 for r in a if r["input"])
    assert 0 < with_input < len(a)
    reverse = next(r for r in a if r["instruction"].startswith("Reverse"))
    assert reverse["output"].split() == reverse["input"].split()[::-1]


def test_make_tiny_writes_a_loadable_qwen3(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_main(["--out", str(tmp_path / "t"), "--examples", "30", "--seed", "3"])
    lines = (tmp_path / "t/data/train.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == make_examples(30, seed=3)

    tok = AutoTokenizer.from_pretrained(tmp_path / "t/model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t/model")
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.vocab_size == len(tok) and tok.eos_token and tok.pad_token and tok.pad_token != tok.eos_token
    text = format_prompt("Reverse the order of these words.", "zebra quokka") + "quokka zebra"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: even unseen words round-trip


def test_make_tiny_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    make_tiny(tmp_path / "a", 20, seed=5)
    make_tiny(tmp_path / "b", 20, seed=5)
    wa, wb = load_file(tmp_path / "a/model/model.safetensors"), load_file(tmp_path / "b/model/model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_data_py_runs_alone_as_the_node_side_check(tmp_path):
    """fab copies training/data.py by itself to a GPU node and runs it (ops.finetune.inputs.check_data_on)."""
    import shutil
    import subprocess
    import sys

    alone = tmp_path / "check.py"
    shutil.copy(Path(train.__file__).resolve().parent / "data.py", alone)
    good = tmp_path / "good.jsonl"
    good.write_text('{"instruction": "Say hi", "input": "", "output": "hi"}\n' * 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "Say hi"}\n')
    ok = subprocess.run([sys.executable, str(alone), str(good)], capture_output=True, text=True, cwd=tmp_path)
    assert (ok.returncode, ok.stdout.strip()) == (0, "3"), ok.stderr
    no = subprocess.run([sys.executable, str(alone), str(bad)], capture_output=True, text=True, cwd=tmp_path)
    assert no.returncode == 3 and "output" in no.stderr and no.stdout == ""
