"""Held-out evaluation on a real GPU (bf16): the packed path's numbers equal the padded path's on the same rows,
and evaluation plus sample answers after training do not raise the training's own memory peak. Needs CUDA: CI
has no GPU, so this module skips there with that reason; it runs on the benchmark's GPU machine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the benchmark device)", allow_module_level=True)

from tests.unit.test_training_run import argv_for  # noqa: E402
from training import samples, train  # noqa: E402
from training.args import parse_args  # noqa: E402
from training.evaluate import evaluate  # noqa: E402
from training.make_tiny import make_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"), examples=216, seed=0)


def _trainer(tiny, out, flex: bool, *extra):
    data_args, model_args, train_args = parse_args(argv_for(
        tiny, out, "--eval_split", "24", "--flex_packing", str(flex).lower(), "--dtype", "bfloat16",
        "--compile_layers", "false", "--cuda_graphs", "false", *extra))
    dataset, eval_rows = train.prepare_datasets(data_args, train_args.seed)
    tokenizer = train.load_tokenizer(model_args, train_args)
    model = train.load_model(model_args, train_args, flex_packing=flex)
    trainer = train.build_trainer(model, tokenizer, dataset, model_args, train_args, flex, eval_dataset=eval_rows)
    return trainer, tokenizer, eval_rows


def test_packed_eval_equals_padded_eval_in_bf16(tiny, tmp_path):
    results = {flex: evaluate(_trainer(tiny, tmp_path / str(flex), flex)[0]) for flex in (True, False)}
    packed, padded = results[True], results[False]
    print(f"\nbf16 eval on {torch.cuda.get_device_name()}: packed {packed}, padded {padded}")
    assert packed["tokens"] == padded["tokens"] > 0
    assert packed["loss"] == pytest.approx(padded["loss"], rel=2e-2)  # bf16: 8 bits of mantissa
    assert packed["token_accuracy"] == pytest.approx(padded["token_accuracy"], abs=0.05)


def test_eval_and_samples_stay_under_the_training_peak(tiny, tmp_path):
    """What train.py does after the last step (the held-out evaluation, then the sample answers) peaks below the
    training's own peak. Evaluating one packed row of all the held-out rows (up to the token budget the GPU's
    free memory allows) peaked above it (74.1 against 70.4 MiB on an H100); a training micro-batch at a time
    does not."""
    trainer, tokenizer, eval_rows = _trainer(tiny, tmp_path / "peak", True, "--max_steps", "20")
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    train_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    evaluate(trainer)
    eval_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prompts = samples.sample_prompts(3, None, eval_rows)
    samples.answer(trainer, tokenizer, prompts, 64, 30.0)
    samples_peak = torch.cuda.max_memory_allocated()
    print(f"\npeak memory on {torch.cuda.get_device_name()}: training {train_peak / 2**20:.1f} MiB, "
          f"eval {eval_peak / 2**20:.1f} MiB, samples {samples_peak / 2**20:.1f} MiB")
    assert eval_peak <= train_peak
    assert samples_peak <= train_peak
