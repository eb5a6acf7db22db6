"""packed_varlen (the GPU attention of the packed path) on a real GPU: flash attention's variable-length
kernels against the per-document reference, forward and gradients, with the layouts the trainer makes
(bucket padding as one more document, empty trailing documents, a max length above the longest), and a
captured step graph replaying the uncaptured step. Needs CUDA: CI has no GPU, so this module skips there
with that reason; it runs on the benchmark's GPU machine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the benchmark device)", allow_module_level=True)

from tests.unit.test_packing_parity import PAD_ID, synthetic_rows, tiny_model  # noqa: E402
from training.fastpath import attention, batches, layout, step_graphs  # noqa: E402
from training.fastpath import model as fp_model  # noqa: E402
from training.fastpath.trainer import PackedSFTTrainer  # noqa: E402

pytestmark = pytest.mark.skipif(not attention.varlen_available(), reason="this torch has no varlen_attn")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("layout", ["packed", "bucket"])
def test_varlen_kernel_matches_reference(layout):
    """Random Qwen3-like heads (8 query, 2 KV heads of 128): output and q/k/v gradients within bf16 rounding
    of the float32 per-document reference."""
    attention.register_packed_attention()
    gen = torch.Generator().manual_seed(11)
    lengths = [int(x) for x in torch.randint(1, 300, (13,), generator=gen)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    max_len = max(lengths)
    if layout == "bucket":  # the step graphs' layout: a padding document, empty slots, a power-of-two bound
        offsets += [offsets[-1] + 77] * 4
        max_len = step_graphs.power_of_two(max(max_len, 77), step_graphs.MIN_MAX_LEN)
    total = offsets[-1]
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, h, total, 128, generator=gen).cuda().to(torch.bfloat16).requires_grad_()
               for h in (8, 2, 2))
    module = torch.nn.Module().train()
    out, _ = attention.packed_varlen_attention(module, q, k, v, (cu, max_len), scaling=128 ** -0.5)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = attention.varlen_reference(*ref_inputs, cu, 128 ** -0.5)
    assert out.shape == ref.shape == (1, total, 8, 128)
    assert rel_err(out, ref) < 1e-2
    grad = torch.randn(out.shape, generator=gen).cuda()
    grads = torch.autograd.grad(out.float(), (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all() and rel_err(g, r) < 2e-2


def test_step_graph_replay_matches_uncaptured_step():
    """A tiny Qwen3 on the GPU, attention weights trainable: the first step runs uncaptured, a bucket met
    later is captured at its first occurrence and replayed after; every replayed step's loss, hits and
    gradients equal an uncaptured run's of the same row."""
    attention.register_packed_attention()
    model = tiny_model(attention.PACKED_VARLEN).to("cuda", torch.bfloat16).train()  # flash: 16-bit only
    fp_model.add_packed_lm_head(model)
    params = [p for n, p in model.named_parameters() if "self_attn" in n]
    graphs = step_graphs.StepGraphs(model, params, PAD_ID, max_tokens=4096, attention=attention.PACKED_VARLEN)
    rows = [synthetic_rows(2, seed=1), synthetic_rows(2, seed=2), synthetic_rows(12, seed=3),
            synthetic_rows(12, seed=4)]
    micros = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in
               batches.pack_examples(r, pad_token_id=PAD_ID).items()} for r in rows]
    keys = [graphs.key(m) for m in micros]
    assert keys[0] == keys[1] != keys[2] == keys[3]
    capture = graphs._capture

    def capture_without_waiting(b):
        """A capture must not wait for the GPU: the work queued before it (here a kernel that spins ~2 s)
        is still running when the capture returns. CUDA's sync debug mode makes a sync the library
        reports (.item(), a blocking copy) an error; a failed capture runs the step uncaptured."""
        torch.cuda._sleep(4_000_000_000)  # GPU clock cycles: ~2 s at 2 GHz, far above a tiny model's capture
        queued = torch.cuda.Event()
        queued.record()
        torch.cuda.set_sync_debug_mode("error")
        try:
            capture(b)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not queued.query()  # torch.cuda.graph's entry would have waited for it (synchronize)
        torch.cuda.synchronize()

    graphs._capture = capture_without_waiting
    for i, m in enumerate(micros):
        loss, hits, grads = graphs.step(m, 1.0 / m["num_targets"])
        assert graphs.replayed == i  # the first step uncaptured, then every step a replay
        mask = attention.attention_mask_for(model, m)
        log_probs, is_top1 = model(input_ids=m["input_ids"], position_ids=m["position_ids"], attention_mask=mask,
                                   use_cache=False, packed_head=True, target_index=m["target_index"],
                                   target_ids=m["target_ids"])
        ref_loss = -log_probs.sum() / m["num_targets"]
        ref_grads = torch.autograd.grad(ref_loss, params)
        # the flash backward accumulates dq with atomics: equal up to float32 summation order
        assert rel_err(loss, ref_loss) < 1e-3
        assert hits.item() == is_top1.sum().item()
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.isfinite(g).all() and rel_err(g, r) < 1e-2
        # the reference's autograd graph must not outlive it: a live AccumulateGrad node from the default
        # stream invalidates the next capture (the trainer keeps none)
        del log_probs, is_top1, ref_loss, ref_grads
    assert (graphs.captured, graphs.replayed) == (2, 3)  # the second bucket captured at its first step


@pytest.mark.parametrize("logging_steps", [100, 1])
def test_replayed_training_steps_never_wait_for_the_gpu(tmp_path, monkeypatch, logging_steps):
    """The packed trainer's steady steps (graph replays) make no host<->device sync: CUDA's sync debug mode
    set to "error" over steps 4-6 (rows of one length, so step 1 runs uncaptured, step 2 captures, the rest
    replay). A sync there (a blocking batch copy, an .item()) would leave the GPU idle every step. Logging
    every step too: the log's values are read one step later, behind an event (not a stream sync)."""
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig

    attention.register_packed_attention()
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<eos>": 0, "<pad>": 1}, "<pad>")),
                                  eos_token="<eos>", pad_token="<pad>")
    rows = [{"input_ids": [2 + (i * 7 + j) % 90 for j in range(40)], "completion_mask": [0] * 20 + [1] * 20}
            for i in range(64)]
    args = SFTConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, max_steps=7, logging_steps=logging_steps, save_strategy="no", report_to="none", bf16=True,
        seed=7, max_length=256, dataloader_num_workers=0, disable_tqdm=True)
    args.cuda_graphs, args.compile_layers = "true", "false"  # the fast path's settings (training/args.py)
    args = layout.prepare_args(args)
    checked = []

    class SyncGuard(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if 3 <= state.global_step <= 5:
                torch.cuda.set_sync_debug_mode("error")

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.get_sync_debug_mode():
                checked.append(state.global_step)
            torch.cuda.set_sync_debug_mode("default")

    model = tiny_model(attention.PACKED_VARLEN).to("cuda", torch.bfloat16)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=tok, peft_config=lora,
                               data_collator=batches.make_collator(tok, args), callbacks=[SyncGuard()])
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert checked == [4, 5, 6]
    assert trainer.step_graphs is not None and trainer.step_graphs.replayed >= 5
    logged = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert logged == ([] if logging_steps > 7 else list(range(1, 8)))
