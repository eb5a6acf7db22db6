"""Held-out evaluation, sample answers and TensorBoard events of a real CPU run of the tiny Qwen3 on its toy
tasks (capitals, word reversal, sums: learnt in one short epoch)."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_training_run import argv_for
from training import train
from training.evaluate import eval_row_count
from training.make_tiny import make_tiny

ROWS = 216  # 192 training rows at 4 per step = 48 steps, 24 held out
HELD_OUT = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"), examples=ROWS, seed=0)


@pytest.fixture(scope="module")
def evaluated_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-run")
    metrics = train.main(argv_for(tiny, out, "--eval_split", str(HELD_OUT), "--eval_every_steps", "20",
                                  "--report_to", "tensorboard"))
    return out, metrics


def test_eval_split_counts():
    assert eval_row_count("auto", 400) == 20 and eval_row_count("auto", 2000) == 64
    assert eval_row_count("auto", 10) == 0  # too few rows to hold any out
    assert eval_row_count("0", 400) == 0 and eval_row_count("off", 400) == 0
    assert eval_row_count("32", 400) == 32 and eval_row_count("0.1", 400) == 40
    for bad in ("-1", "1.5", "lots", "400"):
        with pytest.raises(ValueError, match="eval_split"):
            eval_row_count(bad, 400)


def test_a_bad_eval_split_fails_before_the_model_loads(tiny, tmp_path):
    with pytest.raises(ValueError, match="set eval_split"):
        train.main(argv_for(tiny, tmp_path / "out", "--eval_split", "many"))
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_tuned_adapters_beat_the_base_on_held_out_rows(evaluated_run):
    out, metrics = evaluated_run
    evaluation = json.loads((out / "metrics.json").read_text())["eval"]
    assert metrics["train_steps"] == (ROWS - HELD_OUT) // 4  # the held-out rows are not trained on
    base, tuned = evaluation["base"], evaluation["tuned"]
    assert base["rows"] == tuned["rows"] == evaluation["rows"] == HELD_OUT
    assert base["tokens"] == tuned["tokens"] > 0
    assert tuned["loss"] < 0.8 * base["loss"], evaluation
    assert tuned["token_accuracy"] > base["token_accuracy"]
    # every 20 steps, then the final evaluation at the last step
    assert [h["step"] for h in evaluation["history"]] == [20, 40, metrics["train_steps"]]
    assert evaluation["history"][-1]["eval_loss"] == pytest.approx(tuned["loss"])
    names = [p["name"] for p in metrics["phases"][0]["phases"]]
    assert names.index("eval_base") < names.index("first_step") < names.index("eval")


def test_samples_md_holds_base_tuned_and_reference(evaluated_run):
    out, metrics = evaluated_run
    text = (out / "samples.md").read_text()
    samples = metrics["samples"]
    assert len(samples) == 3 and text.count("**Base**") == text.count("**Tuned**") == 3
    for s in samples:
        assert s["prompt"] in text and s["reference"] in text and s["prompt"].endswith("### Response:\n")
        assert s["base"] != s["tuned"]  # the adapters changed what the model says
    assert "samples" not in json.loads((out / "COMPLETED").read_text())  # the one-line summary stays short


def test_tensorboard_events_read_by_tensorboards_own_reader(evaluated_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics = evaluated_run
    tags = set()
    scalars = {}
    for events in sorted((out / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags.add(tag)
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    want = {"train/loss", "train/learning_rate", "train/grad_norm", "train/mean_token_accuracy", "eval/loss",
            "eval/base_loss", "eval/tuned_loss", "eval/base_token_accuracy", "throughput/tokens_per_s",
            "phases/steps_s", "phases/eval_base_s", "phases/model_load_s"}
    assert want <= tags, sorted(tags)
    assert len(scalars["train/loss"]) == metrics["train_steps"]
    assert scalars["eval/tuned_loss"] == [pytest.approx(metrics["eval"]["tuned"]["loss"])]


def test_packed_and_padded_paths_score_the_same_rows_alike(tiny, tmp_path):
    """The same model on the same held-out rows: the packed LM head and the padded logits agree (fp32)."""
    from training.args import parse_args
    from training.evaluate import evaluate

    results = {}
    for path, flex in (("packed", True), ("padded", False)):
        data_args, model_args, train_args = parse_args(argv_for(tiny, tmp_path / path, "--eval_split", "24",
                                                                "--flex_packing", str(flex).lower()))
        dataset, eval_rows = train.prepare_datasets(data_args, train_args.seed)
        tokenizer = train.load_tokenizer(model_args, train_args)
        model = train.load_model(model_args, train_args, flex_packing=flex)
        trainer = train.build_trainer(model, tokenizer, dataset, model_args, train_args, flex, eval_dataset=eval_rows)
        results[path] = evaluate(trainer)
    packed, padded = results["packed"], results["padded"]
    assert packed["tokens"] == padded["tokens"] > 0
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5)
    assert packed["token_accuracy"] == pytest.approx(padded["token_accuracy"], abs=1e-9)


def test_packed_eval_runs_no_forward_larger_than_a_training_micro_batch(tiny, tmp_path):
    """Evaluation after training must not raise the run's memory peak: on the packed path it packs the held-out
    rows a training micro-batch at a time (per_device_train_batch_size rows), not one row of all of them up to
    the token budget (what the GPU's free memory allows). Seen: the forwards' own inputs, counted by a hook."""
    from training.args import parse_args
    from training.evaluate import evaluate
    from training.fastpath.model import unwrap

    data_args, model_args, train_args = parse_args(argv_for(tiny, tmp_path, "--eval_split", str(HELD_OUT),
                                                            "--flex_packing", "true"))
    dataset, eval_rows = train.prepare_datasets(data_args, train_args.seed)
    tokenizer = train.load_tokenizer(model_args, train_args)
    model = train.load_model(model_args, train_args, flex_packing=True)
    trainer = train.build_trainer(model, tokenizer, dataset, model_args, train_args, True, eval_dataset=eval_rows)
    micro = trainer.args.per_device_train_batch_size
    assert micro < HELD_OUT
    documents = []  # examples in each forward: position 0 starts one

    def count(_module, args, kwargs):
        documents.append(int((kwargs["position_ids"] == 0).sum()))

    hook = unwrap(trainer.model).model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        result = evaluate(trainer)
    finally:
        hook.remove()
    assert result["rows"] == HELD_OUT and sum(documents) >= HELD_OUT
    assert max(documents) <= micro + 1, documents  # + 1: the padding at a row's end restarts at 0


def test_no_eval_no_samples(tiny, tmp_path):
    metrics = train.main(argv_for(tiny, tmp_path, "--eval_split", "0", "--max_steps", "2", "--report_to", "none"))
    assert "eval" not in metrics and "samples" not in metrics
    assert not (tmp_path / "samples.md").exists() and not (tmp_path / "tensorboard").exists()


@pytest.mark.slow
def test_two_ranks_evaluate_the_same_rows_as_one(tiny, tmp_path, evaluated_run):
    """Each rank scores its share of the held-out rows; the sums over gloo give one process's numbers."""
    from tests.unit.test_training_run import torchrun

    out = tmp_path / "two"
    res = torchrun(tiny, out, "--eval_split", str(HELD_OUT), "--eval_every_steps", "20")
    assert res.returncode == 0, res.stderr[-3000:]
    two = json.loads((out / "metrics.json").read_text())["eval"]
    one = evaluated_run[1]["eval"]
    assert two["base"]["tokens"] == one["base"]["tokens"]
    assert two["base"]["loss"] == pytest.approx(one["base"]["loss"], rel=1e-5)  # the same untrained model
    assert two["tuned"]["loss"] < two["base"]["loss"]
    assert (out / "samples.md").is_file()
