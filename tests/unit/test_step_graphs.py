"""Step graphs (training/fastpath/step_graphs.py) pad each packed row to a bucket of fixed shape: the padding must
change nothing. On CPU (no capture; the same function the graph records): loss, token hits and the
gradients of a bucket-padded step equal those of the unpadded row, with a dense mask and with flex
attention's BlockMask refreshed in place for a second, different row of the same bucket."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.unit.test_packing_parity import PAD_ID, eager_flex, synthetic_rows, tiny_model  # noqa: E402,F401
from training.fastpath import attention, batches, step_graphs  # noqa: E402
from training.fastpath import model as fp_model  # noqa: E402
from training.fastpath.trainer import PackedSFTTrainer  # noqa: E402


def reference(model, micro, flex: bool):
    mask = attention.document_block_mask(micro["document_ids"]) if flex else attention.attention_mask_for(model, micro)
    log_probs, is_top1 = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], attention_mask=mask,
                               use_cache=False, packed_head=True, target_index=micro["target_index"],
                               target_ids=micro["target_ids"])
    loss = -log_probs.sum() / micro["num_targets"]
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), is_top1.sum().float(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("attn", ["sdpa", attention.PACKED_VARLEN])
def test_bucket_padded_step_matches_unpadded(attn):
    """sdpa: the dense document mask; packed_varlen: the documents' offsets, the bucket's padding one more
    document and the unused slots empty ones (on CPU its per-document reference computes it). flex
    attention has no backward on CPU: its BlockMask is checked below."""
    attention.register_packed_attention()
    model = tiny_model(attn).train()
    fp_model.add_packed_lm_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    graphs = step_graphs.StepGraphs(model, params, PAD_ID, max_tokens=4096, attention=attn)
    for seed in (1, 2):  # two different rows in the same 256-token bucket: the second reuses its buffers
        micro = batches.pack_examples(synthetic_rows(2, seed=seed), pad_token_id=PAD_ID)  # <= 100 tokens
        assert micro["input_ids"].shape[1] < step_graphs.TOKEN_BUCKET  # so the bucket adds padding
        ref_loss, ref_hits, ref_grads = reference(model, micro, flex=False)
        loss, hits, grads = graphs.step(micro, 1.0 / micro["num_targets"])
        assert len(graphs.buckets) == 1 and graphs.captured == 0  # CPU: the recorded function runs directly
        b = next(iter(graphs.buckets.values()))
        if attn == attention.PACKED_VARLEN:
            t, n = micro["input_ids"].shape[1], micro["cu_seqlens"].numel()
            assert (b.documents, b.max_len) == (step_graphs.DOCUMENT_BUCKET, step_graphs.MIN_MAX_LEN) and n < 8
            assert b.cu_seqlens.tolist() == micro["cu_seqlens"].tolist() + [b.tokens] * (b.documents + 1 - n)
            assert b.tokens > t  # so the bucket's padding is a document of its own
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert hits.item() == ref_hits.item()
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    # Gradients handed to the parameters: set when empty, added when the Trainer accumulates.
    graphs.set_grads(grads)
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    doubled = [g * 2 for g in grads]
    graphs.set_grads([g.clone() for g in grads])
    for p, d in zip(params, doubled, strict=True):
        torch.testing.assert_close(p.grad, d)


def test_steps_of_one_token_bucket_share_a_graph_whatever_their_scored_count():
    """Every bucket costs a capture: two packed rows of the same token bucket, one with 40 scored positions
    and one with 400 (either side of a 256 quantum), must map to one bucket whose target buffers hold both."""
    def row(prompt: int, completion: int) -> dict:
        return {"input_ids": list(range(2, 2 + prompt + completion)), "completion_mask": [0] * prompt + [1] * completion}

    graphs = step_graphs.StepGraphs(None, [], PAD_ID, max_tokens=4096, attention="sdpa")
    few = batches.pack_examples([row(400, 20), row(20, 20)], pad_token_id=PAD_ID)
    many = batches.pack_examples([row(20, 200), row(20, 200)], pad_token_id=PAD_ID)
    assert few["num_targets"] < step_graphs.TOKEN_BUCKET < many["num_targets"]
    assert graphs.key(few) == graphs.key(many)
    tokens, targets = graphs.key(many)[:2]
    assert targets >= max(few["num_targets"], many["num_targets"]) and tokens >= many["input_ids"].shape[1]


def test_block_mask_refreshed_in_place(eager_flex):  # noqa: F811
    """A bucket keeps one BlockMask (the graph holds its tensors): a later row of the same bucket must
    leave it equal to a mask built afresh for that row, padding a document of its own."""
    model = tiny_model("flex_attention")
    graphs = step_graphs.StepGraphs(model, [], PAD_ID, max_tokens=4096, attention="flex_attention")
    for seed in (1, 2):
        micro = batches.pack_examples(synthetic_rows(2, seed=seed), pad_token_id=PAD_ID)
        key = graphs.key(micro)
        assert key == (step_graphs.TOKEN_BUCKET, step_graphs.TOKEN_BUCKET, 0, 0)
        b = graphs.buckets.setdefault(key, step_graphs._Bucket(*key, PAD_ID, micro["input_ids"].device))
        kept = b.mask
        graphs._fill(b, micro, 1.0)
        if kept is not None:
            assert b.mask is kept
        t = micro["input_ids"].shape[1]
        docs = torch.cat([micro["document_ids"][0], torch.full((b.tokens - t,), step_graphs.PAD_DOCUMENT,
                                                               dtype=torch.int32)])[None]
        expected = attention.document_block_mask(docs)
        assert torch.equal(b.mask.to_dense(), expected.to_dense())
        # the element mask the kernel evaluates reads the bucket's current document ids
        q, k = torch.arange(b.tokens)[:, None], torch.arange(b.tokens)[None, :]
        dense = b.mask.mask_mod(0, 0, q, k)
        torch.testing.assert_close(dense[None, None], attention.dense_document_mask(docs))


def test_graphs_decision():
    """cuda_graphs: the config's true/false stands (true only where graphs can run: one process, one micro-batch
    a step, a clear error otherwise); auto decides from the run, and says why."""
    assert step_graphs.decide_graphs(False, True, 1, 1, 100) == (False, "config")
    assert step_graphs.decide_graphs(True, False, 1, 1, 10_000) == (True, "config")
    for world, accumulation in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match="cuda_graphs=true needs one process and gradient_accumulation_steps 1"):
            step_graphs.decide_graphs(True, True, world, accumulation, 100)
    use, why = step_graphs.decide_graphs(None, True, 2, 1, 100)
    assert not use and why.startswith("auto: several processes")
    if not torch.cuda.is_available():
        assert step_graphs.decide_graphs(None, True, 1, 1, 100) == (False, "auto: no GPU")
    assert step_graphs.bucket(1, 256) == 256 and step_graphs.bucket(257, 256) == 512 and step_graphs.bucket(0, 256) == 256


def test_trainer_step_graph_path_trains_the_same(tmp_path, monkeypatch):
    """PackedSFTTrainer through the step-graph path (forced on; on CPU nothing is captured, the recorded
    function runs each step) trains exactly as the ordinary packed path: same per-step losses, same
    token accuracy, same LoRA weights (LoRA dropout 0)."""
    from tests.unit.test_packing_parity import _train

    attention.register_packed_attention()
    rows = synthetic_rows(16, seed=2)
    plain_losses, plain_w, plain = _train(tmp_path, "plain", True, rows, 4, cuda_graphs="false")
    assert plain.step_graphs is None and plain.choices["cuda_graphs"] == {"value": False, "by": "config"}
    seen = []
    run_step = step_graphs.StepGraphs.step

    def recording_step(self, micro, scale):
        seen.append(step_graphs.step_shape(micro))
        return run_step(self, micro, scale)

    monkeypatch.setattr(step_graphs.StepGraphs, "step", recording_step)
    graph_losses, graph_w, graphed = _train(tmp_path, "graphs", True, rows, 4, cuda_graphs="true")
    graphs = graphed.step_graphs
    assert graphs is not None and graphs.steps == 4
    # The buckets were planned from the run's steps before the first: the plan foresaw each step's shape
    # exactly (the collator leaves the padding to the graphs), and every step used a planned bucket.
    assert graphed.data_collator.pad_to_multiple_of == 1
    assert graphed._planned_step_shapes() == seen and graphs.planned and graphs.unplanned == 0
    assert set(graphs.buckets) <= set(graphs.planned)
    # Over several epochs (16 rows, 4 a step: 10 steps are 2.5 epochs) the plan foresees each epoch's own
    # order, which the Trainer's steps follow.
    seen.clear()
    _, _, epochs = _train(tmp_path, "epochs", True, rows, 10, cuda_graphs="true")
    assert len(seen) == 10 and seen[4:8] != seen[:4]
    assert epochs._planned_step_shapes() == seen and epochs.step_graphs.unplanned == 0
    # A run resumed in its second epoch starts a fresh loader: the Trainer's set_epoch gives it that order.
    loader = epochs.get_train_dataloader()
    loader.set_epoch(1)
    assert [step_graphs.step_shape(b["micro_batches"][0]) for b in loader] == seen[4:8]
    assert len(plain_losses) == len(graph_losses) == 4
    for a, b in zip(plain_losses, graph_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (plain_losses, graph_losses)
    accuracy = [[h["mean_token_accuracy"] for h in t.state.log_history if "mean_token_accuracy" in h]
                for t in (plain, graphed)]
    assert accuracy[0] == accuracy[1] and len(accuracy[0]) == 4
    assert plain_w.keys() == graph_w.keys() and plain_w
    for k in plain_w:
        torch.testing.assert_close(plain_w[k], graph_w[k], atol=1e-6, rtol=1e-5)


def test_batches_go_to_the_device_without_blocking():
    """The packed trainer copies every tensor of a batch (nested micro-batches too) with non_blocking: a
    blocking copy waits for the previous step's kernels, a host sync per step."""
    from types import SimpleNamespace

    seen = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to:
                seen.append((kwargs or {}).get("non_blocking", False))
            return super().__torch_function__(func, types, args, kwargs)

    trainer_class = PackedSFTTrainer
    trainer = object.__new__(trainer_class)
    trainer.args, trainer.is_deepspeed_enabled = SimpleNamespace(device=torch.device("cpu")), False
    batch = {"labels": torch.zeros(3).as_subclass(Spy), "num_real_tokens": 3,
             "micro_batches": [{"input_ids": torch.zeros(3).as_subclass(Spy), "num_targets": 2}]}
    out = trainer._prepare_input(batch)
    assert seen == [True, True]
    assert out["num_real_tokens"] == 3 and out["micro_batches"][0]["num_targets"] == 2
    # The loss denominator (scored tokens of the step) stays on the host: the Trainer's own would copy it to
    # the device (here a GPU that does not exist: that copy would fail).
    trainer.args = SimpleNamespace(world_size=1, average_tokens_across_devices=True, n_gpu=1)
    trainer.model_accepts_loss_kwargs, trainer.compute_loss_func, trainer._loss_shifts_labels = True, None, True
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        setattr(trainer, name, lambda: 1)
    labels = torch.tensor([[-100, 5, 6, -100, 7, -100]])
    count = trainer._get_num_items_in_batch([{"labels": labels}], torch.device("cuda"))
    assert count == 3 and isinstance(count, int)


def test_attention_choice_on_a_gpu_and_bad_settings(monkeypatch):
    """varlen on every GPU run (compiled or eager, step graphs or not) where torch has it, flex where it
    has not or `attention: flex` asks; the CPU path whatever the setting; bad values named."""
    assert attention.attention_implementation("varlen") == attention.attention_implementation() == (
        attention.PACKED_VARLEN if attention.varlen_available() else attention.PACKED_SDPA
        if not torch.cuda.is_available() else "flex_attention")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the choice as a GPU node makes it
    monkeypatch.setattr(attention, "varlen_installed", lambda: True)
    assert attention.attention_implementation("auto") == attention.PACKED_VARLEN
    assert attention.attention_implementation(" Flex ") == "flex_attention"
    monkeypatch.setattr(attention, "varlen_installed", lambda: False)
    assert attention.attention_implementation("auto") == "flex_attention"
    with pytest.raises(ValueError, match="attention=varlen: this torch .* has no torch.nn.attention.varlen"):
        attention.attention_implementation("varlen")
    with pytest.raises(ValueError, match="attention='fast' is not allowed: set attention to one of auto, varlen, flex"):
        attention.attention_implementation("fast")


def mixed_examples(n: int, seed: int) -> list[dict]:
    """Rows as the trainer meets them: prompt/completion rows, rows with labels, plain rows, an empty one."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p, c = rng.randint(1, 40), rng.randint(1, 60)
        ids = [rng.randrange(2, 60) for _ in range(p + c)]
        kind = i % 3
        if kind == 0:
            rows.append({"input_ids": ids, "completion_mask": [0] * p + [1] * c})
        elif kind == 1:
            rows.append({"input_ids": ids, "labels": [-100 if rng.random() < 0.3 else t for t in ids]})
        else:
            rows.append({"input_ids": ids})
    rows.append({"input_ids": [], "completion_mask": []})
    return rows


@pytest.mark.parametrize("multiple", [1, 8, 128])
def test_packed_shape_is_what_pack_examples_makes(multiple):
    """The step graphs plan their buckets from packed_shape: it must give exactly the shape pack_examples
    gives the same rows (step_shape reads it), whatever the padding multiple and the kind of row."""
    for seed in range(6):
        rows = mixed_examples(5 + seed, seed)
        lengths = [len(r["input_ids"]) for r in rows]
        targets = [batches.example_targets(r["input_ids"], r.get("labels"), r.get("completion_mask")) for r in rows]
        micro = batches.pack_examples(rows, pad_token_id=PAD_ID, pad_to_multiple_of=multiple)
        assert batches.packed_shape(lengths, targets, multiple) == step_graphs.step_shape(micro)


def test_planned_buckets_pad_least_and_hold_every_step():
    """plan_buckets: at most `limit` sizes, every step fits a bucket (targets, documents and longest
    document included), and no choice of that many sizes pads the steps less (checked by brute force)."""
    import itertools
    import random

    rng = random.Random(3)
    shapes = []
    for _ in range(60):
        lengths = [rng.randint(20, 300) for _ in range(8)]
        targets = [rng.randint(1, n - 1) for n in lengths]
        shapes.append(batches.packed_shape(lengths, targets, 1))
    quantum = step_graphs.PLAN_QUANTUM
    for limit in (1, 3, 5):
        keys = step_graphs.plan_buckets(shapes, quantum, limit)
        assert len(keys) <= limit and keys == sorted(keys)
        padded = 0
        for length, targets, offsets, longest in shapes:
            tokens, most, documents, max_len = next(k for k in keys if k[0] >= length)
            assert tokens % quantum == 0 and targets <= most <= tokens and offsets <= documents
            assert max(longest, tokens - length) <= max_len
            padded += tokens
        sizes = sorted({step_graphs.bucket(s[0], quantum) for s in shapes})
        best = min(sum(min(c for c in choice if c >= s[0]) for s in shapes)
                   for k in range(1, limit + 1) for choice in itertools.combinations(sizes, k) if choice[-1] == sizes[-1])
        assert padded == best
    assert step_graphs.plan_buckets([]) == []


@pytest.mark.parametrize("attn", ["sdpa", attention.PACKED_VARLEN])
def test_planned_bucket_step_matches_unpadded(attn):
    """A planned bucket scores fewer positions than it has tokens (its steps' most targets): loss, hits and
    gradients still those of the unpadded row, for two rows of the same planned bucket."""
    attention.register_packed_attention()
    model = tiny_model(attn).train()
    fp_model.add_packed_lm_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    graphs = step_graphs.StepGraphs(model, params, PAD_ID, max_tokens=4096, attention=attn)
    def rows(seed: int) -> list[dict]:  # long prompts, short answers: few targets for the tokens
        return [{**r, "completion_mask": [0] * (len(r["input_ids"]) - 3) + [1] * 3}
                for r in synthetic_rows(6, seed=seed)]

    micros = [batches.pack_examples(rows(seed), pad_token_id=PAD_ID, pad_to_multiple_of=1) for seed in (4, 5, 6)]
    graphs.plan([step_graphs.step_shape(m) for m in micros])
    assert graphs.planned and all(targets < tokens for tokens, targets, *_ in graphs.planned)
    for micro in micros:
        ref_loss, ref_hits, ref_grads = reference(model, micro, flex=False)
        loss, hits, grads = graphs.step(micro, 1.0 / micro["num_targets"])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert hits.item() == ref_hits.item()
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert set(graphs.buckets) == set(graphs.planned) and graphs.unplanned == 0
    # A step the plan did not foresee (longer than its largest bucket) still runs, in an unplanned bucket.
    longer = batches.pack_examples(synthetic_rows(14, seed=7), pad_token_id=PAD_ID, pad_to_multiple_of=1)
    assert longer["input_ids"].shape[1] > graphs.planned[-1][0]
    graphs.step(longer, 1.0 / longer["num_targets"])
    assert graphs.unplanned == 1 and len(graphs.buckets) == len(graphs.planned) + 1


def test_plan_makes_no_more_buckets_than_the_fixed_ones():
    """Each bucket costs a capture: steps that the fixed 256-token buckets put in one bucket get one planned
    bucket (on short steps a capture costs more GPU time than the padding it saves), longer ones their
    least-padding sizes."""
    graphs = step_graphs.StepGraphs(None, [], PAD_ID, max_tokens=4096, attention="sdpa")
    short = [batches.packed_shape([n], [n - 1], 1) for n in (70, 130, 190, 250)]
    graphs.plan(short)
    assert graphs.planned == [(256, 256, 0, 0)]
    long = [batches.packed_shape([n], [n // 2], 1) for n in (1000, 1100, 1200, 1290)]
    graphs.plan(long)  # fixed buckets: 1024, 1280 and 1536 tokens
    assert [k[0] for k in graphs.planned] == [1024, 1216, 1344] and graphs.planned[0][1] == 512
