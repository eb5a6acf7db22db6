"""CUDA graphs of whole packed training steps: forward, LM head, loss and backward replayed as one graph.

A packed step of Alpaca-length rows is launch-bound: thousands of kernels, and the Python and launch work of
the compiled blocks takes longer than the GPU needs for them; replaying a captured graph costs one launch
(what it gives: BENCHMARKS.md). A graph needs fixed shapes and addresses, so each step's packed row is padded
to a bucket and copied into that bucket's static buffers; the padding is a document of its own (it attends
only to itself) and its targets weigh 0, so the loss, the gradients and the token accuracy are those of the
unpadded row. Every bucket costs one capture (about an uncaptured compiled step's host time), so the buckets
are planned before the run's first step from the steps it will take (StepGraphs.plan: the sampler's order is
seeded, the rows are tokenized): no more buckets than fixed TOKEN_BUCKET-token ones would make of the same
steps, sized to pad them least, each scoring its steps' largest count of targets. A step the plan did not
foresee gets a fixed bucket (TOKEN_BUCKET tokens, as many scored positions).

The run's first step runs uncaptured (it compiles the blocks and creates the libraries' handles); from then
on each bucket is captured the first time it occurs and replayed ever after. A capture records while the GPU
runs the steps queued before it (_capture). A bucket whose capture fails runs uncaptured and is tried once
more at its next occurrence; a second failure turns step graphs off for the run. Graphs are used only while
a step's activations fit twice in the GPU's memory (the graphs keep their own memory pool). The gradients
come out of the graph (torch.autograd.grad) and are handed to the parameters as `.grad`, so the Trainer's
clipping, optimizer and zero_grad work as before. One process only: under DDP the gradient all-reduce hooks
cannot run inside a graph. `cuda_graphs` in the config: auto (decide_graphs), true, false.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from training.fastpath.attention import PACKED_VARLEN, dense_document_mask, document_block_mask

log = logging.getLogger(__name__)

TOKEN_BUCKET = 256
# auto: graphs for compiled runs whose steps average at most this many tokens; longer steps are GPU-bound
# already and graphs would only add bucket padding (BENCHMARKS.md).
AUTO_MAX_MEAN_STEP_TOKENS = 3072
# Document id of the bucket padding (larger than any example index of a step).
PAD_DOCUMENT = 2**30
# varlen attention: document slots in multiples of this, the longest document as a power of two (at least
# this): few buckets, and a kernel grid near the step's own.
DOCUMENT_BUCKET = 8
MIN_MAX_LEN = 128


# Planned buckets (StepGraphs.plan): token sizes in multiples of PLAN_QUANTUM (flex: of its 128-token
# blocks), at most MAX_PLANNED (and no more than the fixed buckets would make), scored positions in
# multiples of TARGET_QUANTUM.
PLAN_QUANTUM = 64
MAX_PLANNED = 12
TARGET_QUANTUM = 64


def bucket(n: int, quantum: int) -> int:
    return max(quantum, -(-n // quantum) * quantum)


def step_shape(micro: dict[str, Any]) -> tuple[int, int, int, int]:
    """Host numbers of a packed micro-batch that size its bucket: (row length, scored positions, entries of
    cu_seqlens, longest document); training.fastpath.batches.packed_shape computes them without packing."""
    return (int(micro["input_ids"].shape[1]), int(micro["num_targets"]), int(micro["cu_seqlens"].numel()),
            int(micro["max_document_length"]))


def plan_buckets(shapes: list[tuple[int, int, int, int]], quantum: int = PLAN_QUANTUM,
                 limit: int = MAX_PLANNED) -> list[tuple[int, int, int, int]]:
    """Bucket keys (tokens, targets, documents, longest document) for steps of these shapes (step_shape):
    at most `limit` token sizes, multiples of `quantum`, chosen to minimise the tokens of all steps padded
    to their bucket (exact, by dynamic programming over the distinct sizes); each bucket's other fields
    are the largest its steps need, so one capture serves them all."""
    if not shapes:
        return []
    sizes = sorted({bucket(s[0], quantum) for s in shapes})
    count = {size: 0 for size in sizes}
    for s in shapes:
        count[bucket(s[0], quantum)] += 1
    below = [0]  # steps needing at most sizes[i - 1]
    for size in sizes:
        below.append(below[-1] + count[size])
    n, inf = len(sizes), float("inf")
    # cost[k][j]: least padded tokens of the steps needing sizes[:j], served by k buckets, the last sizes[j-1]
    cost = [[inf] * (n + 1) for _ in range(min(limit, n) + 1)]
    cut: dict[tuple[int, int], int] = {}
    cost[0][0] = 0
    for k in range(1, len(cost)):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                c = cost[k - 1][i] + (below[j] - below[i]) * sizes[j - 1]
                if c < cost[k][j]:
                    cost[k][j], cut[k, j] = c, i
    k = min(range(1, len(cost)), key=lambda k: (cost[k][n], k))
    tops, j = [], n
    while j:
        tops.append(sizes[j - 1])
        j, k = cut[k, j], k - 1
    tops.sort()
    keys = []
    for lo, tokens in zip([0, *tops[:-1]], tops, strict=True):
        group = [s for s in shapes if lo < bucket(s[0], quantum) <= tokens]
        keys.append((tokens, min(tokens, bucket(max(s[1] for s in group), TARGET_QUANTUM)),
                     bucket(max(s[2] for s in group), DOCUMENT_BUCKET),
                     power_of_two(max(max(s[3], tokens - s[0]) for s in group), MIN_MAX_LEN)))
    return keys


def power_of_two(n: int, least: int) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


class _Bucket:
    """Static inputs, the captured graph and its outputs for one shape: (tokens, targets) and, for varlen
    attention, (documents, longest document) as the kernels' grid is sized from them."""

    def __init__(self, tokens: int, targets: int, documents: int, max_len: int, pad_token_id: int,
                 device: torch.device):
        self.tokens, self.targets, self.documents, self.max_len = tokens, targets, documents, max_len
        # varlen: the documents' offsets; the bucket's padding is one more document, unused slots are
        # empty documents at the end of the row
        self.cu_seqlens = torch.full((documents + 1,), tokens, dtype=torch.int32, device=device)
        self.input_ids = torch.full((1, tokens), pad_token_id, dtype=torch.long, device=device)
        self.position_ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
        self.document_ids = torch.full((1, tokens), PAD_DOCUMENT, dtype=torch.int32, device=device)
        self.target_index = torch.zeros(targets, dtype=torch.long, device=device)
        self.target_ids = torch.zeros(targets, dtype=torch.long, device=device)
        self.target_weight = torch.zeros(targets, dtype=torch.float32, device=device)
        self.scale = torch.zeros((), dtype=torch.float32, device=device)
        self.mask = None  # flex attention: a BlockMask over document_ids, refreshed in place each step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.failed = 0


class StepGraphs:
    """Runs one packed micro-batch (a pack_examples dict on the GPU) as forward + backward, returning
    (loss, top-1 hits, gradients of `params`), replayed from a CUDA graph after the run's first step."""

    def __init__(self, model, params: list[torch.nn.Parameter], pad_token_id: int, max_tokens: int,
                 attention: str | None, context=None):
        self.model, self.params, self.pad_token_id, self.max_tokens = model, params, pad_token_id, max_tokens
        self.flex = attention == "flex_attention"
        self.varlen = attention == PACKED_VARLEN
        self.layer_types = sorted(set(getattr(getattr(model, "config", None), "layer_types", None)
                                      or ["full_attention"]))
        self.context = context
        self.warm = False  # set after the first (uncaptured) step
        self.buckets: dict[tuple[int, int, int, int], _Bucket] = {}
        self.planned: list[tuple[int, int, int, int]] = []  # plan(): keys chosen for the run's steps
        self.unplanned = 0  # steps that fitted no planned bucket (with a plan)
        self.pool = None
        self.stream = None  # the capture stream, made with the pool at the first step
        self.enabled = True
        self.captured = 0
        self.capture_s = 0.0  # host seconds spent capturing (what a bucket costs beyond its replays)
        self.replayed = 0
        self.steps = 0

    def fits(self, micro: dict[str, Any]) -> bool:
        return self.enabled and self.key(micro)[0] <= self.max_tokens

    def plan(self, shapes: list[tuple[int, int, int, int]]) -> None:
        """Buckets for the run's steps, given their shapes (step_shape) in advance: see plan_buckets.
        Steps that fit none (a shape the plan did not foresee) get the unplanned buckets below."""
        quantum = 128 if self.flex else PLAN_QUANTUM  # flex attention's BlockMask works on 128-token blocks
        shapes = [s for s in shapes if bucket(s[0], quantum) <= self.max_tokens]
        # No more captures than the fixed buckets would make of the same steps: on short steps the GPU time
        # hardly depends on the padding and each capture costs more than it saves.
        limit = min(MAX_PLANNED, len({self._unplanned_key(s) for s in shapes}))
        self.planned = [k if self.varlen else (*k[:2], 0, 0) for k in plan_buckets(shapes, quantum, limit)]

    # ---- one step
    def _fill(self, b: _Bucket, micro: dict[str, Any], scale: float) -> None:
        t, n = int(micro["input_ids"].shape[1]), int(micro["num_targets"])
        b.input_ids[:, :t].copy_(micro["input_ids"], non_blocking=True)
        b.input_ids[:, t:].fill_(self.pad_token_id)
        b.position_ids[:, :t].copy_(micro["position_ids"], non_blocking=True)
        b.position_ids[:, t:].fill_(0)
        b.document_ids[:, :t].copy_(micro["document_ids"], non_blocking=True)
        b.document_ids[:, t:].fill_(PAD_DOCUMENT)
        b.target_index[:n].copy_(micro["target_index"], non_blocking=True)
        b.target_index[n:].fill_(0)
        b.target_ids[:n].copy_(micro["target_ids"], non_blocking=True)
        b.target_ids[n:].fill_(0)
        b.target_weight[:n].fill_(1.0)
        b.target_weight[n:].fill_(0.0)
        b.scale.fill_(scale)
        if self.varlen:
            offsets = micro["cu_seqlens"]
            b.cu_seqlens[:offsets.numel()].copy_(offsets, non_blocking=True)
            b.cu_seqlens[offsets.numel():].fill_(b.tokens)  # the padding document, then empty ones
        if self.flex:
            fresh = document_block_mask(b.document_ids)
            if b.mask is None:
                b.mask = fresh  # its mask_mod reads b.document_ids, whatever the step
                return
            for name, value in vars(fresh).items():
                if torch.is_tensor(value):
                    target = getattr(b.mask, name)
                    if not torch.is_tensor(target) or target.shape != value.shape:
                        raise RuntimeError(f"BlockMask field {name} changed shape within a bucket")
                    target.copy_(value)

    def _run(self, b: _Bucket):
        if self.varlen:
            mask = {layer_type: (b.cu_seqlens, b.max_len) for layer_type in self.layer_types}
        else:
            mask = b.mask if self.flex else dense_document_mask(b.document_ids)
        with self.context() if self.context else torch.enable_grad():
            log_probs, is_top1 = self.model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=mask,
                                            use_cache=False, packed_head=True, target_index=b.target_index,
                                            target_ids=b.target_ids)
        loss = -(log_probs.float() * b.target_weight).sum() * b.scale
        grads = torch.autograd.grad(loss, self.params)
        hits = (is_top1.float() * b.target_weight).sum()
        return loss.detach(), hits.detach(), grads

    def _capture(self, b: _Bucket) -> None:
        """Record the bucket's step while the GPU goes on with the steps already queued: not through
        `torch.cuda.graph`, whose entry waits for the GPU to finish them (a synchronize, and an
        empty_cache whose cudaFree waits too), which left the GPU idle for the whole ~130 ms of a
        capture's host time. Recording runs nothing on the GPU; the replay is queued after those steps."""
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        # Work queued on the current stream before the capture is ordered before what the capture
        # stream does outside the graph (nothing, normally): the same ordering torch.cuda.graph gets.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                b.outputs = self._run(b)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        b.graph = graph
        self.captured += 1
        self.capture_s += time.perf_counter() - start

    def key(self, micro: dict[str, Any]) -> tuple[int, int, int, int]:
        shape = step_shape(micro)
        length, targets, offsets, longest = shape
        for planned in self.planned:  # sorted by tokens: the smallest that holds the step
            tokens, most_targets, documents, max_len = planned
            if length <= tokens and targets <= most_targets and (
                    not self.varlen or (offsets <= documents and max(longest, tokens - length) <= max_len)):
                return planned
        return self._unplanned_key(shape)

    def _unplanned_key(self, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        length, _, offsets, longest = shape
        tokens = bucket(length, TOKEN_BUCKET)
        documents = max_len = 0
        if self.varlen:  # host numbers: the micro-batch's documents + the bucket's padding document
            documents = bucket(offsets, DOCUMENT_BUCKET)
            max_len = power_of_two(max(longest, tokens - length), MIN_MAX_LEN)
        return tokens, tokens, documents, max_len  # scored positions: as many as the bucket's tokens

    def step(self, micro: dict[str, Any], scale: float):
        key = self.key(micro)
        if self.planned and key not in self.planned:
            self.unplanned += 1
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(*key, self.pad_token_id, micro["input_ids"].device)
        self._fill(b, micro, scale)
        self.steps += 1
        if self.stream is None and micro["input_ids"].is_cuda:
            # Made at the run's first step (uncaptured), not at its first capture: creating a stream waits
            # for the GPU to finish the work queued before it.
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        # Without a GPU (tests) the same bucketed steps run, never captured.
        if b.graph is None and self.warm and micro["input_ids"].is_cuda and b.failed < 2:
            try:
                self._capture(b)
            except Exception as e:  # noqa: BLE001 - a step that cannot be captured still trains, uncaptured
                b.failed += 1
                b.graph, b.outputs = None, None
                # The capture no longer empties the allocator's cache first (that waits for the GPU): a
                # capture that failed for memory gets that room back before its second attempt.
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                if b.failed >= 2:
                    self.enabled = False
                log.warning("CUDA graph capture of a %d-token step failed (%s: %s); %s", b.tokens,
                            type(e).__name__, e, "training goes on without step graphs" if not self.enabled
                            else "this step runs uncaptured")
        if b.graph is not None:
            b.graph.replay()
            self.replayed += 1
            return b.outputs
        self.warm = True
        return self._run(b)

    def set_grads(self, grads) -> None:
        """Hand the step's gradients to the parameters (accumulating onto gradients already there)."""
        for p, g in zip(self.params, grads, strict=True):
            if p.grad is None or p.grad.data_ptr() == g.data_ptr():
                p.grad = g
            else:
                p.grad.add_(g)


def decide_graphs(setting: bool | None, compiled: bool, world_size: int, accumulation: int,
                  mean_step_tokens: float) -> tuple[bool, str]:
    """(step graphs or not, who decided and why) for the config's `cuda_graphs` (None = auto). One process and
    one micro-batch a step only; forced without a GPU, the same bucketed steps run uncaptured (how tests
    check the path)."""
    if setting is not None:
        if setting and (world_size > 1 or accumulation > 1):
            raise ValueError("cuda_graphs=true needs one process and gradient_accumulation_steps 1 on the packed "
                             f"path (here {world_size} processes, {accumulation} micro-batches a step): set "
                             "cuda_graphs to auto or false, or step_layout to auto")
        return setting, "config"
    if world_size > 1:
        return False, "auto: several processes (DDP's all-reduce hooks cannot run inside a graph)"
    if accumulation > 1:
        return False, "auto: several micro-batches a step"
    if not torch.cuda.is_available():
        return False, "auto: no GPU"
    if not compiled:
        return False, "auto: eager blocks (a short run would spend its few steps capturing)"
    if mean_step_tokens > AUTO_MAX_MEAN_STEP_TOKENS:
        return False, f"auto: ~{mean_step_tokens:.0f} tokens a step (GPU-bound above {AUTO_MAX_MEAN_STEP_TOKENS})"
    return True, f"auto: compiled, ~{mean_step_tokens:.0f} tokens a step (launch-bound)"
