"""The padding-free fast path (training/fastpath/) computes the same thing as padded batches.

On CPU, with a tiny random Qwen3 and LoRA: (1) a packed forward with the document BlockMask gives the
same logits as running each example alone (no attention across examples); (2) training several
optimizer steps with the packed trainer gives the same per-step losses and the same final LoRA
weights as TRL's padded batches (batch 2 x accumulation 2 vs one packed row of 4).

The training comparisons run in float64. The layouts sum a step's token losses in different orders
(one row of 4 vs two accumulated rows of 2, each with its own matmul shapes), and Adam divides each
gradient by its own running magnitude, so a coordinate whose gradient is near zero turns a rounding
difference into a weight difference of up to lr per step: in fp32 that measured 3.6e-5 on one x86-64
CPU and less on another. In float64 the same sums differ by about n*u (n ~ 1e3 terms, u = 1.1e-16),
measured at most 2e-14 after the 4 steps; WEIGHT_ATOL leaves four orders of margin above that, and a
wrong layout (other examples in a step) moves weights by more than 1e-3 (asserted below).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from training.fastpath import attention, batches, layout  # noqa: E402
from training.fastpath.trainer import PackedSFTTrainer  # noqa: E402

VOCAB = 96
PAD_ID = 1
WEIGHT_ATOL = 1e-10  # float64 training; see the module docstring


def tiny_model(attn: str, seed: int = 0, dtype=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=PAD_ID,
                         eos_token_id=0, bos_token_id=0, attn_implementation=attn)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    return model.to(dtype) if dtype is not None else model


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        p, c = rng.randint(3, 20), rng.randint(2, 30)
        ids = [rng.randrange(2, VOCAB) for _ in range(p + c)]
        rows.append({"input_ids": ids, "completion_mask": [0] * p + [1] * c})
    return rows


def test_pack_examples_layout():
    packed = batches.pack_examples(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}],
        pad_token_id=PAD_ID, pad_to_multiple_of=8)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 1, 1]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert packed["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    # first token of every example and all padding are never targets
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100]]
    assert packed["num_real_tokens"] == 5
    assert packed["cu_seqlens"].tolist() == [0, 3, 5, 8] and packed["cu_seqlens"].dtype == torch.int32
    assert packed["max_document_length"] == 3
    assert batches.split_by_token_budget([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]


@pytest.fixture
def eager_flex(monkeypatch):
    """flex attention's reference (not inductor-compiled) path: exact, and no minutes of CPU compilation."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    def uncompiled(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", uncompiled)


@pytest.mark.parametrize("attn", [attention.PACKED_SDPA, attention.PACKED_VARLEN, "flex_attention", "sdpa"])
def test_packed_logits_match_separate_runs(attn, eager_flex):
    """packed_sdpa (the path of training/train.py on CPU: each document gathered into a padded batch for
    causal SDPA), packed_varlen (on a GPU; here its per-document reference gets the same offsets), flex +
    BlockMask, and SDPA + the same mask as a dense tensor."""
    if attn in (attention.PACKED_SDPA, attention.PACKED_VARLEN):
        attention.register_packed_attention()
    model = tiny_model(attn)
    rows = synthetic_rows(4, seed=1)
    packed = batches.pack_examples(rows, pad_token_id=PAD_ID)
    mask = attention.attention_mask_for(model, packed)
    if attn == "flex_attention":
        assert type(mask).__name__ == "BlockMask"
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                       attention_mask=mask).logits[0]
        start = 0
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            alone = model(input_ids=ids).logits[0]
            got = logits[start:start + ids.shape[1]]
            assert torch.allclose(got, alone, atol=1e-5, rtol=1e-4), (got - alone).abs().max()
            start += ids.shape[1]
        # Control: without the document mask, examples after the first attend across -> different.
        causal = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
        second = slice(len(rows[0]["input_ids"]), len(rows[0]["input_ids"]) + len(rows[1]["input_ids"]))
        assert not torch.allclose(causal[second], logits[second], atol=1e-3)


def _train(tmp_path, name: str, packed: bool, rows: list[dict], steps: int, **settings):
    """`settings`: fast-path settings of training/args.py (cuda_graphs=..., ...) set on the SFTConfig."""
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<eos>": 0, "<pad>": 1}, "<pad>")),
                                  eos_token="<eos>", pad_token="<pad>")
    args = SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     learning_rate=5e-2, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
                     bf16=False, seed=7, data_seed=7, max_length=256, use_cpu=True, dataloader_num_workers=0,
                     gradient_checkpointing=not packed, disable_tqdm=True)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = tiny_model(attention.ATTN_IMPLEMENTATION if packed else "sdpa", seed=3, dtype=torch.float64)
    ds = Dataset.from_list(rows)
    for key, value in settings.items():
        setattr(args, key, value)
    if packed:
        args = layout.prepare_args(args)
        trainer = PackedSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                   peft_config=lora, data_collator=batches.make_collator(tok, args))
    else:
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lora_weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" in k}
    return losses, lora_weights, trainer


def test_packed_training_matches_padded(tmp_path):
    rows = synthetic_rows(16, seed=2)
    steps = 4
    padded_losses, padded_w, _ = _train(tmp_path, "padded", False, rows, steps)
    packed_losses, packed_w, trainer = _train(tmp_path, "packed", True, rows, steps)
    assert trainer.args.per_device_train_batch_size == 4 and trainer.args.gradient_accumulation_steps == 1
    assert len(padded_losses) == len(packed_losses) == steps
    for a, b in zip(padded_losses, packed_losses, strict=False):
        assert abs(a - b) <= 1e-3 * abs(a), (padded_losses, packed_losses)
    # The lr is large enough that the adapters move: identical weights mean identical gradients.
    assert padded_w.keys() == packed_w.keys() and padded_w
    moved = max((w.abs().max().item() for k, w in packed_w.items() if "lora_B" in k))
    assert moved > 1e-3
    for k in padded_w:
        torch.testing.assert_close(padded_w[k], packed_w[k], atol=WEIGHT_ATOL, rtol=0, msg=k)


def test_step_layout_as_configured_trains_the_same_examples_per_step(tmp_path):
    """step_layout as_configured keeps the config's 2 x 2 (two packed micro-batches a step, accumulated);
    auto packs the step's 4 examples into one row. Same examples per optimizer step, same loss over the
    step's tokens: the same training, and each run's choices say which layout it used and who chose it."""
    attention.register_packed_attention()
    rows = synthetic_rows(16, seed=4)
    auto_losses, auto_w, auto = _train(tmp_path, "auto", True, rows, 4)
    kept_losses, kept_w, kept = _train(tmp_path, "kept", True, rows, 4, step_layout="as_configured")
    assert (auto.args.per_device_train_batch_size, auto.args.gradient_accumulation_steps) == (4, 1)
    assert (kept.args.per_device_train_batch_size, kept.args.gradient_accumulation_steps) == (2, 2)
    assert auto.choices["examples_per_micro_batch"]["by"].startswith("auto (step_layout)")
    assert kept.choices["examples_per_micro_batch"] == {"value": 2, "by": "config (step_layout: as_configured)"}
    assert kept.choices["cuda_graphs"]["value"] is False
    assert kept_losses == pytest.approx(auto_losses, rel=1e-5)
    for k in auto_w:
        torch.testing.assert_close(kept_w[k], auto_w[k], atol=WEIGHT_ATOL, rtol=0, msg=k)
