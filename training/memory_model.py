"""Each GPU's peak memory for a LoRA fine-tune, predicted from the model's config.json and the run's settings.

Pure arithmetic (no torch): `fab estimate` and `fab train` call it on the user's machine before any node
starts (ops/cost/fit.py), a benchmark calls `breakdown(config, plan)` to set the prediction beside a measured
peak. docs/MEMORY.md gives the formula and its sources. The terms, in bytes per GPU:

- base_weights: every parameter of the frozen base (counted from config.json, `parameter_count`) at its dtype
  (2 bytes bf16), divided by the shards when the base is sharded N-way (FSDP);
- gathered_weights (sharded only): the units FSDP all-gathers for the forward and backward: the unit in use
  and the one prefetched, each as large as the largest of a decoder layer and the embedding;
- lora_state: the adapters in fp32 (PEFT keeps adapter weights in fp32 over a bf16 base: 4 bytes), their
  gradients (4) and AdamW's two moments (8), plus DDP's gradient buckets (4) when several ranks replicate;
  divided by the shards when sharded (training/sharding.py shards the adapters with their layer; the few
  buffers FSDP2 leaves whole on every rank are `replicated_bytes`);
- activations: what autograd keeps for the backward pass, per token and layer, counted tensor by tensor for a
  Qwen3/Llama decoder layer (`layer_activation_bytes`): the two RMSNorms' fp32 inputs (4h each), Qwen3's q/k
  norms' fp32 inputs (4q + 4kv), the attention's q, k, v and output in bf16 (4q + 4kv: a fused attention,
  SDPA/flash/flex, keeps no s^2 scores, only a log-sum-exp per query; Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", arXiv:2205.05198, Sec. 4.1, whose 34sbh is for a
  plain GPT block), the SwiGLU MLP's gate, up, silu(gate) outputs... (6I), and each LoRA-targeted
  projection's input as its adapter needs it (dropout: a 1-byte mask and the 2-byte dropped copy per adapter;
  no dropout: the 2-byte input once per distinct input). The frozen base's projections keep nothing (their
  weight gradients are not taken). Compiled blocks (torch.compile fuses the norms and the MLP's elementwise
  work) keep COMPILED_SHARE of that, measured; with checkpointing each layer keeps only its bf16 input
  (2h), plus one layer recomputed in full during backward. Checked against measured peaks on an H100
  (benchmarks/bench_memory.py, BENCHMARKS.md "Memory model"): within 3.1% of the allocated peak for Qwen3
  0.6B-8B at 512 and 2048 tokens, eager, compiled and checkpointed;
- loss_head: TRL's fused LM head (trl/trainer/utils.py, `fused_lm_head=True`, the default loss of SFTTrainer in
  TRL 1.16 and the fast path's) projects [4096 tokens x 32768 vocabulary] tiles, never the whole
  [tokens x vocabulary] logits, and accumulates the hidden states' gradient in fp32. Without it (`fused_lm_head
  False`), the logits are kept in bf16, upcast to fp32 for the loss and their log-softmax saved: 10 bytes per
  token per vocabulary entry, which at Qwen's 151,936 entries outweighs everything else on long rows;
- runtime: what the process holds outside the tensors: the CUDA context and libraries' workspaces
  (CUDA_CONTEXT_BYTES, measured: 0.73 GiB on an H100 with torch 2.11) and the caching allocator's slack over
  the allocated peak (ALLOCATOR_SLACK; 0.2-2.2% measured).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

# The fast path's token budget (training/fastpath/memory.py): activation bytes per token per (hidden unit x
# layer) and a reserve, upper bounds that leave room on every GPU it ran on. Not the prediction: that is
# `layer_activation_bytes` and the runtime below, checked against measured peaks.
ACTIVATION_BYTES_PER_UNIT = {"compiled": 80.0, "eager": 112.0, "checkpointed": 8.0}
MEMORY_RESERVE_BYTES = 2.5 * 2**30
# Compiled decoder layers keep this share of what eager ones keep (measured on an H100, BENCHMARKS.md
# "Memory model": 0.75-0.77 for Qwen3 0.6B, 4B and 8B; 1.7B, not used to set it, within 1.2%).
COMPILED_SHARE = 0.76
# Outside the tensors: the CUDA context and library workspaces (0.73 GiB measured on an H100, torch 2.11),
# and the caching allocator's reserve over the allocated peak (0.2-2.2% measured; 3% taken).
CUDA_CONTEXT_BYTES = 0.75 * 2**30
ALLOCATOR_SLACK = 0.03
# TRL's fused LM head (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, trl/trainer/utils.py
# _CHUNKED_LOGPROB_CHUNK_SIZE): the logits exist one [tokens x vocabulary] tile at a time.
LOSS_TILE_TOKENS, LOSS_TILE_VOCAB = 4096, 32768
# Full logits (no fused head): bf16 logits + their fp32 upcast + the fp32 log-softmax saved for backward.
FULL_LOGITS_BYTES = 2 + 4 + 4
# Per trainable (LoRA) parameter: fp32 weight, fp32 gradient, AdamW's exp_avg and exp_avg_sq (fp32).
LORA_BYTES = 4 + 4 + 8
DDP_BUCKET_BYTES = 4  # DDP's gradient buckets, a second fp32 copy of the gradients, when ranks replicate
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GIB = 2**30


class ModelConfigError(ValueError):
    """A config.json the model cannot read: the field, and what it must be."""


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes, from its config.json (Qwen3, Qwen2, Llama and Mistral name them alike)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool  # Qwen3: an RMSNorm of head_dim on queries and keys (modeling_qwen3.py)
    attention_bias: bool  # bias on q, k, v and o (Llama/Qwen3's attention_bias)
    qkv_bias: bool  # bias on q, k and v only (Qwen2)
    mlp_bias: bool

    @classmethod
    def of(cls, config: Mapping) -> Shape:
        cfg = dict(config.get("text_config") or config)  # a multimodal config keeps its language model's here

        def whole(key: str, default: int | None = None) -> int:
            value = default if cfg.get(key) is None else cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"config.json field {key!r} is {value!r}: a positive whole number is needed "
                                       "(a decoder-only transformer's config, e.g. Qwen/Qwen3-4B's)")
            return value

        hidden, heads = whole("hidden_size"), whole("num_attention_heads")
        head_dim = cfg.get("head_dim") or hidden // heads
        model_type = str(cfg.get("model_type") or "")
        return cls(hidden=hidden, intermediate=whole("intermediate_size"), layers=whole("num_hidden_layers"),
                   heads=heads, kv_heads=whole("num_key_value_heads", heads), head_dim=int(head_dim),
                   vocab=whole("vocab_size"), tied=bool(cfg.get("tie_word_embeddings", False)),
                   qk_norm=model_type.startswith("qwen3"), attention_bias=bool(cfg.get("attention_bias", False)),
                   qkv_bias=model_type == "qwen2", mlp_bias=bool(cfg.get("mlp_bias", False)))

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear projections: name -> (in_features, out_features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_parameters(self) -> int:
        proj = self.projections()
        weights = sum(a * b for a, b in proj.values())
        biases = 0
        if self.attention_bias:
            biases += sum(proj[n][1] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        elif self.qkv_bias:
            biases += sum(proj[n][1] for n in ("q_proj", "k_proj", "v_proj"))
        if self.mlp_bias:
            biases += sum(proj[n][1] for n in ("gate_proj", "up_proj", "down_proj"))
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return weights + biases + norms

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden


def parameter_count(config: Mapping) -> int:
    """The model's parameters: embedding, layers, final norm, and the LM head unless tied to the embedding."""
    s = Shape.of(config)
    head = 0 if s.tied else s.embedding_parameters()
    return s.embedding_parameters() + s.layers * s.layer_parameters() + s.hidden + head


def replicated_bytes(config: Mapping) -> int:
    """What every rank keeps whole when the model is sharded (FSDP2 shards parameters, not buffers): the rotary
    embedding's inverse frequencies, `inv_freq` and `original_inv_freq`, head_dim / 2 fp32 values each
    (transformers' modeling_rope_utils / Qwen3RotaryEmbedding). A few hundred bytes: nothing beside the shards,
    but what a per-rank measurement adds to them."""
    s = Shape.of(config)
    return 2 * (s.head_dim // 2) * 4


def lora_parameters(config: Mapping, r: int, targets) -> int:
    """Trainable LoRA parameters: r x (in + out) for each targeted projection of each layer. `targets`: module
    names, or "all-linear" (PEFT: every linear layer but the LM head)."""
    s = Shape.of(config)
    proj = s.projections()
    names = list(PROJECTIONS) if targets in ("all-linear", ["all-linear"]) else list(targets or [])
    unknown = [n for n in names if n not in proj]
    if unknown:
        raise ModelConfigError(f"lora_target_modules {unknown}: the memory model knows {', '.join(PROJECTIONS)} "
                               "and all-linear")
    return s.layers * sum(r * (proj[n][0] + proj[n][1]) for n in names)


@dataclass(frozen=True)
class Plan:
    """What one rank holds: `tokens` per micro-batch (rows x their length), how its blocks keep activations,
    the LoRA adapters, and how many ranks there are and how many of them share (shard) the base."""

    tokens: int
    checkpointing: bool = False
    blocks: str = "eager"  # "eager" or "compiled" (the fast path's compile_layers)
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_dropout: bool = True  # the adapters' inputs go through dropout (lora_dropout > 0)
    ranks: int = 1
    shards: int = 1  # 1: every rank holds the whole base (DDP); N: FSDP over N ranks
    dtype: str = "bfloat16"
    fused_lm_head: bool = True
    # How the plan came about, for the report: e.g. "packed path: one 1024-token row must fit".
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if self.tokens < 1:
            raise ValueError(f"tokens per micro-batch must be at least 1, not {self.tokens}")
        if self.blocks not in ("eager", "compiled"):
            raise ValueError(f"blocks must be eager or compiled, not {self.blocks!r}")
        if self.shards < 1 or self.ranks < 1:
            raise ValueError(f"ranks and shards must be at least 1, not {self.ranks} and {self.shards}")
        if self.shards > self.ranks:
            raise ValueError(f"sharding {self.shards}-way needs at least {self.shards} ranks; this run has "
                             f"{self.ranks}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r}: one of {', '.join(DTYPE_BYTES)}")


def breakdown(config: Mapping, plan: Plan) -> dict[str, float]:
    """Predicted peak bytes on one GPU, per term (the module's docstring); their sum is the peak."""
    s = Shape.of(config)
    weight_bytes = DTYPE_BYTES[plan.dtype]
    params = parameter_count(config)
    trainable = lora_parameters(config, plan.lora_r, plan.lora_targets)
    replicated = plan.ranks > 1 and plan.shards == 1
    out = {"base_weights": params * weight_bytes / plan.shards}
    if plan.shards > 1:
        unit = max(s.layer_parameters(), s.embedding_parameters())
        out["gathered_weights"] = 2 * unit * weight_bytes
    out["lora_state"] = trainable * (LORA_BYTES + (DDP_BUCKET_BYTES if replicated else 0)) / plan.shards
    layer = layer_activation_bytes(s, plan.lora_targets, plan.lora_dropout, plan.dtype)
    if plan.blocks == "compiled":
        layer *= COMPILED_SHARE
    if plan.checkpointing:  # each layer's input, and one layer recomputed in full
        out["activations"] = plan.tokens * (s.layers * s.hidden * weight_bytes + layer)
    else:
        out["activations"] = plan.tokens * s.layers * layer
    if plan.fused_lm_head:
        tile = min(plan.tokens, LOSS_TILE_TOKENS) * min(s.vocab, LOSS_TILE_VOCAB) * weight_bytes
        out["loss_head"] = tile + plan.tokens * s.hidden * 4
    else:
        out["loss_head"] = plan.tokens * s.vocab * FULL_LOGITS_BYTES
    out["runtime"] = CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK * sum(out.values())
    return out


def layer_activation_bytes(s: Shape, targets, dropout: bool = True, dtype: str = "bfloat16") -> float:
    """Bytes one decoder layer keeps for the backward pass per token, eager (the module's docstring)."""
    b = DTYPE_BYTES[dtype]
    q, kv, h, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    kept = 2 * 4 * h  # the two RMSNorms' fp32 inputs
    kept += (4 * q + 4 * kv) if s.qk_norm else 0  # Qwen3's q/k norms, fp32
    kept += 2 * b * q + 2 * b * kv  # the attention's q and output, k and v
    kept += 3 * b * i  # SwiGLU: gate, up and silu(gate)
    proj = s.projections()
    chosen = [t for t in targets if t in proj]
    if dropout:  # per adapter: a 1-byte mask and the dropped copy
        kept += sum((1 + b) * proj[t][0] for t in chosen)
    else:  # the adapters read the input the layer already has: once per distinct input
        sources = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
                   "up_proj": "mlp", "down_proj": "down"}
        kept += sum(b * proj[next(t for t in chosen if sources[t] == src)][0]
                    for src in {sources[t] for t in chosen})
    return kept


def peak_bytes(config: Mapping, plan: Plan) -> float:
    return sum(breakdown(config, plan).values())


# ---------------------------------------------------------------- the run's settings -> a plan


def plan_from_settings(setting: Callable[[str], object], ranks: int, gpu: bool = True, shards: int = 1) -> Plan:
    """The plan of a run of training/train.py with these settings (`setting(key)`: the config's value, else
    args.py's default) on `ranks` ranks. Mirrors what the run decides (training/fastpath/layout.py, trainer.py):

    - on a GPU with flex_packing auto/true (the packed path), step_layout auto packs a step's batch x
      accumulation rows into one micro-batch that is split to what the GPU's memory holds (token_budget): what
      must fit is one max_length row (or token_budget tokens when the config sets it);
      activation_checkpointing auto is off there until one row does not fit, then on;
    - the padded path (flex_packing false, or no GPU) pads per_device_train_batch_size rows to the longest,
      at most max_length tokens each, with checkpointing on unless the config says false.
    """
    length = int(setting("max_length") or 1024)
    batch, accumulation = int(setting("per_device_train_batch_size")), int(setting("gradient_accumulation_steps"))
    packed = gpu and str(setting("flex_packing")).lower() in ("auto", "true")
    ckpt = str(setting("activation_checkpointing")).lower()
    targets = setting("lora_target_modules") or ()
    common = {"lora_r": int(setting("lora_r") or 16), "lora_dropout": float(setting("lora_dropout") or 0) > 0,
              "lora_targets": (targets,) if isinstance(targets, str) else tuple(targets),
              "ranks": ranks, "shards": shards, "dtype": str(setting("dtype") or "bfloat16") if gpu else "float32"}
    if packed:
        rows = batch * accumulation if str(setting("step_layout")) == "auto" else batch
        budget = setting("token_budget")
        tokens = max(length, min(int(budget), rows * length)) if budget else length
        blocks = "compiled" if str(setting("compile_layers")).lower() == "true" else "eager"
        why = (f"packed path: {rows} rows a micro-batch, split at token_budget {budget}" if budget else
               f"packed path: a step's rows are split to what the GPU holds; one {length}-token row must fit")
        return Plan(tokens=tokens, checkpointing=ckpt == "true", blocks=blocks, notes=(why,), **common)
    return Plan(tokens=batch * length, checkpointing=ckpt != "false", blocks="eager",
                notes=(f"padded batches: {batch} rows of up to {length} tokens a micro-batch",), **common)


def predict(config: Mapping, settings: Mapping, ranks: int = 1, shards: int = 1, gpu: bool = True) -> dict[str, float]:
    """One call for a benchmark: a config.json (dict) and a run's training settings (the YAML's keys; one left out
    has training/args.py's default) -> predicted peak bytes on one GPU per term (`breakdown`)."""
    from training.validate import default

    plan = plan_from_settings(lambda key: settings[key] if key in settings else default(key), ranks, gpu, shards)
    return breakdown(config, plan)


# ---------------------------------------------------------------- the plan the run takes


class ShardingError(ValueError):
    """A `sharding` setting the run cannot take (fsdp with one rank): the setting and the fix."""


def one_rank_refusal(ranks: int) -> str:
    return (f"sharding: fsdp needs 2 or more ranks to shard over; this run has {ranks}: set sharding to auto or "
            "none, or run on more GPUs (--nodes, --gpus-per-node)")


def run_plan(config: Mapping, setting: Callable[[str], object], ranks: int, usable: float,
             gpu: bool = True) -> Plan:
    """The plan a run of these settings takes on `ranks` ranks of `usable` bytes each: what the run itself decides
    (training/train.py asks this with its GPU's memory; ops/cost/fit.py with the instance type's), in order:

    1. `plan_from_settings`, unsharded;
    2. the packed path's `activation_checkpointing: auto` turns recomputation on when one row does not fit
       without it (training/fastpath/trainer.py);
    3. `sharding`: fsdp shards the base over every rank; auto shards it when the plan of 2. does not fit one
       GPU and there are ranks to shard over (never on CPU: no GPU memory to fit), and then 2. again for the
       sharded plan (sharded, the row may fit without recomputation); none never shards.
    ShardingError: fsdp with one rank."""
    packed = gpu and str(setting("flex_packing")).lower() in ("auto", "true")
    ckpt_auto = packed and str(setting("activation_checkpointing")).lower() == "auto"

    def recompute_if_needed(plan: Plan) -> Plan:
        if ckpt_auto and not plan.checkpointing and peak_bytes(config, plan) > usable:
            return replace(plan, checkpointing=True,
                           notes=(*plan.notes, "activation_checkpointing auto: on, as the run would turn it on"))
        return plan

    first = plan_from_settings(setting, ranks, gpu)
    plan = recompute_if_needed(first)
    sharding = str(setting("sharding") or "auto").lower()
    if sharding == "fsdp":
        if ranks < 2:
            raise ShardingError(one_rank_refusal(ranks))
        why = f"sharding fsdp: the base sharded {ranks}-way (config)"
    elif sharding == "auto" and gpu and ranks > 1 and peak_bytes(config, plan) > usable:
        why = (f"sharding auto: the base sharded {ranks}-way, as one GPU cannot hold the run unsharded "
               f"(peak {peak_bytes(config, plan) / GIB:.1f} GiB > {usable / GIB:.1f} GiB)")
    else:
        return plan
    return recompute_if_needed(replace(first, shards=ranks, notes=(*first.notes, why)))


# ---------------------------------------------------------------- what would make it fit


@dataclass(frozen=True)
class FitChange:
    """A change of the run's settings and the plan it gives."""

    what: str  # e.g. "max_length 512"
    plan: Plan


def changes(plan: Plan, setting: Callable[[str], object], packed: bool) -> list[FitChange]:
    """The setting changes that lower this plan's peak, cheapest first (what they cost the run), each on top of
    the ones before it: recomputing activations (slower, the same result), a smaller micro-batch with more
    accumulation (the same examples per optimizer step), shorter rows (long rows truncated), and apart from
    those the base sharded over the run's ranks with recomputation."""
    out: list[FitChange] = []
    done: list[str] = []
    base = plan
    if not plan.checkpointing:
        done.append("activation_checkpointing: true")
        base = replace(plan, checkpointing=True)
        out.append(FitChange(done[0], base))
    length = int(setting("max_length") or 1024)
    rows = max(1, plan.tokens // length)
    if not packed:
        batch, accumulation = int(setting("per_device_train_batch_size")), int(setting("gradient_accumulation_steps"))
        for b in (d for d in range(batch - 1, 0, -1) if batch % d == 0):  # the same examples per optimizer step
            step = f"per_device_train_batch_size: {b}, gradient_accumulation_steps: {batch * accumulation // b}"
            out.append(FitChange(", ".join([*done, step]), replace(base, tokens=b * length)))
        if batch > 1:
            done.append(f"per_device_train_batch_size: 1, gradient_accumulation_steps: {batch * accumulation}")
            rows = 1
    shorter = length // 2
    while shorter >= 128:
        out.append(FitChange(", ".join([*done, f"max_length: {shorter}"]), replace(base, tokens=rows * shorter)))
        shorter //= 2
    if plan.ranks > 1 and plan.shards < plan.ranks:
        out.append(FitChange(f"sharding: fsdp (the base sharded {plan.ranks}-way over the run's ranks), "
                             "activation_checkpointing: true", replace(plan, shards=plan.ranks, checkpointing=True)))
    return out


def fitting_change(config: Mapping, plan: Plan, usable: float, setting: Callable[[str], object],
                   packed: bool) -> FitChange | None:
    """The cheapest change (in `changes` order) whose peak fits `usable` bytes; None when none does."""
    for change in changes(plan, setting, packed):
        if peak_bytes(config, change.plan) <= usable:
            return change
    return None
