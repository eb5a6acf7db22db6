"""The packed trainer's logs in one process (training/fastpath/deferred_logs.py, DeferredLogs._maybe_log_save_evaluate;
under DDP: tests/unit/test_training_run.py):
a logging step's values are copied to the host behind its kernels and written one step later, so that logging
every step (the recipe's default) never leaves the GPU idle. Checked on CPU against the Trainer's own logs:
the same log history, train_loss and checkpointed history, each log written after the next step unless a
checkpoint, an epoch's end or the run's end comes first."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.unit.test_packing_parity import synthetic_rows, tiny_model  # noqa: E402
from training.fastpath import attention, batches, layout  # noqa: E402
from training.fastpath.trainer import PackedSFTTrainer  # noqa: E402

TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def run(tmp_path, name: str, defer: bool, logging_steps: int, max_grad_norm: float = 1.0, norm_as=None):
    attention.register_packed_attention()
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<eos>": 0, "<pad>": 1}, "<pad>")),
                                  eos_token="<eos>", pad_token="<pad>")
    args = layout.prepare_args(SFTConfig(
        output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=5e-2, max_steps=7, logging_steps=logging_steps, save_strategy="steps", save_steps=3,
        report_to="none", seed=7, data_seed=7, max_length=256, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, max_grad_norm=max_grad_norm))
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    events = []

    class Order(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            events.append(("step", state.global_step))

        def on_log(self, args, state, control, logs=None, **kw):
            if "loss" in logs:
                events.append(("log", state.global_step))

    trainer = PackedSFTTrainer(
        model=tiny_model(attention.ATTN_IMPLEMENTATION, seed=3), args=args, train_dataset=Dataset.from_list(
            synthetic_rows(16, seed=2)), processing_class=tok, peft_config=lora,
        data_collator=batches.make_collator(tok, args), callbacks=[Order()])
    assert trainer.defer_logs  # the default (defer_logs: true)
    trainer.defer_logs = defer
    if norm_as is not None:  # the gradient norm handed to the log as a host number or None
        snapshot = trainer._snapshot_log
        trainer._snapshot_log = lambda tr_loss, norm, *a: snapshot(tr_loss, norm_as(norm), *a)
    output = trainer.train()
    history = [{k: v for k, v in h.items() if k not in TIMING} for h in trainer.state.log_history]
    saved = json.loads((tmp_path / name / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    return history, output.training_loss, saved, events


@pytest.mark.parametrize(("logging_steps", "max_grad_norm"), [(1, 1.0), (2, 1.0), (1, 0.0)])
def test_deferred_logs_are_the_trainers_one_step_later(tmp_path, logging_steps, max_grad_norm):
    """Also without clipping (max_grad_norm 0), where the gradient norm may reach the log another way."""
    history, train_loss, saved, events = run(tmp_path, "deferred", True, logging_steps, max_grad_norm)
    ref_history, ref_loss, ref_saved, ref_events = run(tmp_path, "reference", False, logging_steps, max_grad_norm)
    assert history == ref_history and train_loss == ref_loss and saved == ref_saved
    logged = [h["step"] for h in history if "loss" in h]
    assert logged == list(range(logging_steps, 8, logging_steps))  # the Trainer logs no partial interval
    assert all("mean_token_accuracy" in h and "grad_norm" in h for h in history if "loss" in h)
    assert [h["step"] for h in saved if "loss" in h] == [s for s in logged if s <= 3]
    # The Trainer writes each log at its step; deferred, after the next step, except at a checkpoint (steps 3
    # and 6), an epoch's end (16 rows, 4 a step: step 4) and the run's end (step 7), which write it at once.
    assert ref_events == [e for s in range(1, 8) for e in [("step", s)] + ([("log", s)] if s in logged else [])]
    at_once = (3, 4, 6, 7)
    expected = []
    for s in range(1, 8):
        expected.append(("step", s))
        if s - 1 in logged and s - 1 not in at_once:
            expected.append(("log", s - 1))
        if s in logged and s in at_once:
            expected.append(("log", s))
    assert events == expected


def test_deferred_log_of_a_host_gradient_norm_or_none(tmp_path):
    """A gradient norm that is a host number is logged as it is; None logs none (no GPU copy made for it)."""
    ref_history = run(tmp_path, "reference", False, 1)[0]
    as_float = run(tmp_path, "float", True, 1, norm_as=lambda n: float(n))[0]
    as_none = run(tmp_path, "none", True, 1, norm_as=lambda n: None)[0]
    assert as_float == ref_history
    assert as_none == [{k: v for k, v in h.items() if k != "grad_norm"} for h in ref_history]
    assert any("grad_norm" in h for h in ref_history)
