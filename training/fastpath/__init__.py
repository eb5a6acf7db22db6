"""The packed GPU fast path: padding-free batches with per-example attention, entered from training/train.py.

The baseline recipe pads every micro-batch of 2 examples to its longer one, recomputes activations and runs 8
small micro-batches per optimizer step; on a GPU that leaves the card mostly idle. This path keeps the
optimizer semantics (the same examples in the same order, the same examples per optimizer step, the same
learning rate and schedule) and changes only how a step's examples reach the GPU; each change is a config
setting (docs/CONFIG.md) whose `auto` lets this path choose:

- `step_layout`: all examples of one optimizer step concatenated into one row (no padding between them), or
  the config's micro-batches as they are; `position_ids` restart at 0 for each example and the attention
  sees each example alone (`attention`);
- `token_budget`: a row is split into micro-batches only beyond this many tokens (a memory guard);
- the loss is the completion-only mean over the step's tokens, through TRL's fused LM head (no full fp32
  logits), with the token accuracy folded into the same tiles;
- `activation_checkpointing`, `compile_layers`: no recomputation, and the decoder blocks compiled on runs
  long enough to pay for it;
- `cuda_graphs`: in one process, a compiled run of short steps replays each step as one CUDA graph;
- `defer_logs`: a logging step's values are read one step later, so the host never waits for the GPU.

One concern a module: entry (what train.py calls), layout (the step layout), batches (packing, collator),
sampler, attention, model (LM head, compiling), compile_choice, memory (token budget), step_graphs,
deferred_logs, accounting (flops, accuracy), trainer (PackedSFTTrainer and its private overrides).
"""
