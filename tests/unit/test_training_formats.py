"""Data formats (training/data.py, training/chat.py): detection from the columns, the chat template's assistant
mask on real template styles, bad rows counted, and a real CPU training run on chat rows with the tiny Qwen3."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trl

from training import train
from training.chat import TOO_LONG, encode_chat, prepare_dataset, template_plan
from training.data import DataError, load_rows
from training.make_tiny import CHAT_TEMPLATE, build_tokenizer, make_tiny

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "training" / "configs" / "local-tiny.yaml"
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"  # the real templates of Qwen3, Llama 3, ...

CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
    {"role": "assistant", "content": "Tokyo."},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(n: int) -> list[dict]:
    countries = [("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"), ("Kenya", "Nairobi")]
    rows = []
    for i in range(n):
        a, b = countries[i % 4], countries[(i + 1) % 4]
        turns = [{"role": "user", "content": f"Capital of {a[0]}?"}, {"role": "assistant", "content": a[1]},
                 {"role": "user", "content": f"And {b[0]}?"}, {"role": "assistant", "content": b[1]}]
        rows.append({"messages": ([{"role": "system", "content": "Be brief."}] if i % 2 else []) + turns})
    return rows


@pytest.fixture(scope="module")
def tokenizer():
    texts = [json.dumps(CONVERSATION), "<|im_start|> <|im_end|> system user assistant"]
    return build_tokenizer(texts, vocab_size=320)


def assistant_text(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of masked-in tokens."""
    runs, cur = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            cur.append(token)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs + ([tokenizer.decode(cur)] if cur else [])


# ---------------------------------------------------------------- detection

@pytest.mark.parametrize("row, fmt", [
    ({"instruction": "Say hi", "input": "", "output": "hi"}, "alpaca"),
    ({"prompt": "Say hi:", "completion": " hi"}, "prompt_completion"),
    ({"messages": CONVERSATION}, "chat"),
])
def test_format_is_detected_from_the_columns(tmp_path, row, fmt):
    rows = load_rows(str(write_jsonl(tmp_path / "d.jsonl", [row] * 3)))
    assert (rows.format, len(rows)) == (fmt, 3)
    assert rows.summary().startswith(f"3 valid rows, format {fmt}")


def test_unknown_columns_fail_before_the_model_loads(tmp_path):
    path = write_jsonl(tmp_path / "other.jsonl", [{"question": "q", "answer": "a"}])
    argv = ["--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", str(path),
            "--output_dir", str(tmp_path / "out")]
    with pytest.raises(DataError) as err:
        train.main(argv)
    message = str(err.value)
    for text in ("columns found: answer, question", "instruction, output", "prompt, completion", "messages"):
        assert text in message
    assert not (tmp_path / "out").exists()


def test_node_side_check_prints_the_format_and_refuses_unknown_columns(tmp_path):
    """fab runs training/data.py alone on a node (ops.finetune.inputs.check_data_on) and prints its stderr line."""
    good = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4) + [{"messages": CONVERSATION[:2]}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    script = REPO / "training" / "data.py"
    ok = subprocess.run([sys.executable, str(script), str(good)], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == "4"
    assert "format chat" in ok.stderr and "left out: 1 no assistant turn" in ok.stderr
    no = subprocess.run([sys.executable, str(script), str(bad)], capture_output=True, text=True, cwd=tmp_path)
    assert no.returncode == 3 and "columns found: text" in no.stderr and "messages" in no.stderr


def test_bad_rows_are_counted_and_left_out(tmp_path):
    good = {"messages": CONVERSATION}
    rows = [good,
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},  # empty
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},  # no assistant
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]},  # order
            {"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "a"}]},  # order
            good]
    loaded = load_rows(str(write_jsonl(tmp_path / "c.jsonl", rows)))
    assert len(loaded) == 2
    assert loaded.dropped == {"empty answer": 1, "no assistant turn": 1, "wrong role order": 2}
    alpaca = load_rows(str(write_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "output": ""},
                                                               {"instruction": "x", "output": "y"}])))
    assert (len(alpaca), alpaca.dropped) == (1, {"empty answer": 1})
    with pytest.raises(DataError, match="no row can be trained on"):
        load_rows(str(write_jsonl(tmp_path / "none.jsonl", rows[1:5])))


# ---------------------------------------------------------------- the assistant mask

@pytest.mark.parametrize("template, how, turn_end", [
    (CHAT_TEMPLATE, "no generation markers", "<|im_end|>"),  # ChatML without markers: prefix rendering
    ((TRL_TEMPLATES / "qwen3.jinja").read_text(), "TRL's training version", "<|im_end|>"),  # Qwen3's real one
    ((TRL_TEMPLATES / "llama3.jinja").read_text(), "TRL's training version", "<|eot_id|>"),  # Llama 3's
    ((TRL_TEMPLATES / "qwen3_training.jinja").read_text(), "with {% generation %} markers", "<|im_end|>"),
])
def test_mask_covers_exactly_the_assistant_turns(tokenizer, template, how, turn_end):
    tokenizer.chat_template = template
    plan = template_plan(tokenizer)
    assert how in plan.how
    ids, mask = encode_chat(tokenizer, plan, CONVERSATION)
    runs = assistant_text(tokenizer, ids, mask)
    assert len(runs) == 2  # both assistant turns of the multi-turn conversation, nothing else
    for run, answer in zip(runs, ("Paris.", "Tokyo."), strict=True):
        assert answer in run and turn_end in run  # the answer and the token that ends the turn
        for other in ("Answer in one word", "Capital of France", "And of Japan", "system", "user"):
            assert other not in run  # system and user tokens are masked
    masked_out = tokenizer.decode([t for t, b in zip(ids, mask, strict=True) if not b])
    assert "Answer in one word" in masked_out and "Capital of France" in masked_out and "And of Japan" in masked_out


def test_template_that_is_not_prefix_preserving_is_refused(tokenizer):
    """Qwen3's own template (not TRL's known copy: one character differs) drops earlier turns' think blocks."""
    tokenizer.chat_template = (TRL_TEMPLATES / "qwen3.jinja").read_text() + "\n"
    plan = template_plan(tokenizer)
    assert not plan.markers
    with pytest.raises(DataError, match="generation"):
        encode_chat(tokenizer, plan, CONVERSATION)


def test_tokenizer_without_template_is_a_clear_error(tokenizer, tmp_path):
    tokenizer.chat_template = None
    rows = load_rows(str(write_jsonl(tmp_path / "c.jsonl", chat_rows(2))))
    with pytest.raises(DataError, match="need a chat template"):
        prepare_dataset(rows, tokenizer)


@pytest.mark.parametrize("long_rows", ["truncate", "drop"])
def test_long_rows_are_counted_then_truncated_or_dropped(tokenizer, tmp_path, long_rows):
    tokenizer.chat_template = CHAT_TEMPLATE
    long = {"messages": [{"role": "user", "content": "Capital of France? " * 3},
                         {"role": "assistant", "content": "Paris. " * 30}]}
    rows = load_rows(str(write_jsonl(tmp_path / "c.jsonl", [long] + chat_rows(3))))
    short = max(len(encode_chat(tokenizer, template_plan(tokenizer), r["messages"])[0]) for r in rows[1:])
    dataset, report = prepare_dataset(rows, tokenizer, max_length=short, long_rows=long_rows)
    assert all(len(ids) <= short for ids in dataset["input_ids"])
    if long_rows == "drop":
        assert (report.rows, report.dropped, report.truncated) == (3, {TOO_LONG: 1}, 0)
    else:
        assert (report.rows, report.dropped, report.truncated) == (4, {}, 1)
        assert "Paris" in tokenizer.decode([t for t, b in zip(dataset[0]["input_ids"], dataset[0]["assistant_masks"],
                                                              strict=True) if b])
    text = load_rows(str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say: ", "completion": "hi " * 40},
                                                             {"prompt": "Say: ", "completion": "hi"}])))
    _, report = prepare_dataset(text, tokenizer, max_length=10, long_rows=long_rows)
    assert (report.dropped, report.truncated) == (({TOO_LONG: 1}, 0) if long_rows == "drop" else ({}, 1))


def test_bad_long_rows_setting_is_refused():
    from training.validate import ConfigProblem, check_config

    with pytest.raises(ConfigProblem, match="long_rows"):
        check_config({"long_rows": "cut"}, "x.yaml")


# ---------------------------------------------------------------- real training on CPU

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model_dir, _ = make_tiny(root, examples=24, seed=0)
    data = write_jsonl(root / "chat.jsonl", chat_rows(32) + [{"messages": CONVERSATION[:2]}])
    return model_dir, data


def test_trainer_labels_are_the_assistant_tokens(tiny, tmp_path):
    from training.args import parse_args

    model_dir, data = tiny
    data_args, model_args, train_args = parse_args([
        "--config", str(CONFIG), "--model_name_or_path", str(model_dir), "--dataset_name", str(data),
        "--output_dir", str(tmp_path / "out"), "--flex_packing", "false", "--eval_split", "0"])
    tokenizer = train.load_tokenizer(model_args, train_args)
    reports = {}
    dataset = train.prepare_dataset(data_args, tokenizer, train_args.max_length, reports)
    assert reports["train"].dropped == {"no assistant turn": 1}
    model = train.load_model(model_args, train_args, flex_packing=False)
    trainer = train.build_trainer(model, tokenizer, dataset, model_args, train_args)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    for labels in batch["labels"]:
        kept = tokenizer.decode([int(y) for y in labels if y != -100])
        assert kept.count("<|im_end|>") == 2 and "Capital" not in kept and "Be brief" not in kept
        assert any(city in kept for city in ("Paris", "Tokyo", "Lima", "Nairobi"))


def test_chat_rows_train_for_real_and_the_run_records_the_format(tiny, tmp_path, capsys):
    model_dir, data = tiny
    metrics = train.main(["--config", str(CONFIG), "--model_name_or_path", str(model_dir), "--dataset_name",
                          str(data), "--output_dir", str(tmp_path / "out"), "--eval_split", "4", "--samples", "1",
                          "--max_steps", "4", "--save_steps", "50"])
    printed = capsys.readouterr().out
    assert "format chat" in printed and "left out: 1 no assistant turn" in printed and "chat template" in printed
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    data_record = saved["data"]["train"]
    assert data_record["format"] == "chat" and data_record["dropped"] == {"no assistant turn": 1}
    assert "no generation markers" in data_record["chat_template"]["how"]
    assert len(data_record["chat_template"]["sha256"]) == 64
    assert saved["choices"]["data_format"]["value"] == "chat"
    assert metrics["train_rows"] == 28 and saved["eval"]["rows"] == 4
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()  # trained and saved adapters
