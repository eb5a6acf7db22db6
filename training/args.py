"""Settings of training/train.py as dataclasses, parsed by TRL's TrlParser (YAML `--config` + flags).

Defaults are the baseline recipe (Qwen/Qwen3-4B, tatsu-lab/alpaca first 2,000 rows, LoRA r16/alpha 32/
dropout 0.05 on q/k/v/o, lr 2e-4, one epoch, batch 2 x 8, max length 1024, bf16), so running
without a config reproduces it; configs/*.yaml override them and flags override the config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trl import ModelConfig, SFTConfig, TrlParser

from training.choices import choice

log = logging.getLogger(__name__)


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class DataArguments:
    """What to train on."""

    dataset_name: str = field(
        default="tatsu-lab/alpaca",
        metadata={"help": "Hub data set ID, or a local JSON/JSONL/Parquet file or directory. The format comes from "
                          "the columns: instruction/input/output (Alpaca), prompt/completion, or messages (chat, "
                          "through the tokenizer's chat template, the loss on the assistant turns only)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub data set configuration name."})
    long_rows: str = field(
        default="truncate",
        metadata={"help": "Rows longer than max_length tokens: truncate (keep the first max_length tokens; a chat row "
                          "with no assistant token left is dropped) or drop. Either way they are counted and "
                          "reported. One of truncate, drop."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Hub split to train on."})
    n_examples: int = field(
        default=2000, metadata={"help": "Train on the first N rows (0 = all rows)."}
    )
    flex_packing: str = field(
        default="auto",
        metadata={"help": "The padding-free packed fast path (training/fastpath/; the name is historic: on a GPU "
                          "the attention is set by `attention`). auto: on when a GPU is present; true: on (on CPU "
                          "too); false: TRL's padded batches. One of auto, true, false."},
    )

    eval_split: str = field(
        default="auto",
        metadata={"help": "Rows held out of the training rows for evaluation (picked with the seed): a count "
                          "(32), a fraction (0.05), 0 = no evaluation, or auto: 5% of the rows, at most 64, none "
                          "below 20 rows. Ignored when eval_dataset_name is set."},
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={"help": "A separate evaluation data set (local file or hub ID, same columns): all of its rows "
                          "are evaluated and no training row is held out."},
    )
    samples: int = field(
        default=3,
        metadata={"help": "Prompts answered greedily by the base model and by the tuned one, into samples.md "
                          "(from samples_file, else the first held-out rows); 0 = none."},
    )
    samples_file: str | None = field(
        default=None,
        metadata={"help": "A JSON/JSONL file of instruction/input(/output) rows to answer in samples.md "
                          "instead of held-out rows."},
    )
    sample_max_new_tokens: int = field(default=64, metadata={"help": "Most tokens of each sample answer."})
    sample_max_time_s: float = field(
        default=60.0, metadata={"help": "Most seconds all sample answers together may take (base and tuned)."}
    )

    def __post_init__(self):
        self.flex_packing = choice("flex_packing", self.flex_packing)
        self.long_rows = choice("long_rows", self.long_rows)
        if self.samples < 0 or self.sample_max_new_tokens < 1 or self.sample_max_time_s <= 0:
            raise ValueError("samples must be >= 0, sample_max_new_tokens >= 1 and sample_max_time_s > 0: "
                             f"got {self.samples}, {self.sample_max_new_tokens}, {self.sample_max_time_s}")


@dataclass
class ModelArguments(ModelConfig):
    """TRL's ModelConfig with the baseline's model and LoRA as defaults."""

    model_name_or_path: str | None = field(
        default="Qwen/Qwen3-4B", metadata={"help": "Hub model ID or a local model directory."}
    )
    dtype: str | None = field(
        default="bfloat16",
        metadata={"help": "dtype to load the base model in; forced to float32 without a GPU.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    use_peft: bool = field(default=True, metadata={"help": "Train LoRA adapters (the base stays frozen)."})
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "Modules that get LoRA adapters."},
    )


@dataclass
class TrainConfig(SFTConfig):
    """TRL's SFTConfig with the baseline recipe as defaults, plus CPU handling (fp32 when no GPU)."""

    output_dir: str | None = field(default="/scratch/lora-out", metadata={"help": "Adapters, checkpoints, metrics."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate (AdamW)."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs over the data set."})
    per_device_train_batch_size: int = field(default=2, metadata={"help": "Micro-batch per rank."})
    gradient_accumulation_steps: int = field(default=8, metadata={"help": "Micro-batches per optimizer step."})
    max_length: int | None = field(default=1024, metadata={"help": "Truncate sequences to this many tokens."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps (fab streams them)."})
    save_steps: float = field(default=50, metadata={"help": "Checkpoint every N optimizer steps (for requeue)."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep at most N checkpoints."})
    final_checkpoint: bool = field(
        default=False,
        metadata={"help": "Also checkpoint at the last step (the Trainer's habit). Off: the run writes its adapters, "
                          "trainer_state.json and COMPLETED marker right after, and a finished job is not resumed, "
                          "so that checkpoint (optimizer state included: ~140 MB for Qwen3-4B's adapters) only "
                          "delays the adapters. On: keep it, to continue training from the optimizer state."},
    )
    report_to: None | str | list[str] = field(
        default="tensorboard",
        metadata={"help": "Experiment trackers (Transformers' report_to): tensorboard (events in "
                          "output_dir/tensorboard, brought home to runs/<job>/), wandb, or none."},
    )
    eval_every_steps: int = field(
        default=0,
        metadata={"help": "Also evaluate the held-out rows every N optimizer steps (0 = only before and after "
                          "training)."},
    )
    hang_timeout_factor: float = field(
        default=10.0,
        metadata={"help": "Hang watchdog (training/watchdog.py): a rank that completes no optimizer step within "
                          "max(this x the run's measured step time, hang_timeout_floor_s) writes every rank's "
                          "stack to output_dir/hangs/ and the job requeues from its last checkpoint. 0 = off."},
    )
    hang_timeout_floor_s: float = field(
        default=600.0, metadata={"help": "Hang watchdog: the shortest deadline, in seconds."}
    )
    hang_first_step_s: float = field(
        default=1800.0,
        metadata={"help": "Hang watchdog: the deadline of the first step after a start or resume (compilation, "
                          "warm-up) and of a checkpoint save or evaluation, in seconds."},
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "False: frozen base weights are not searched for every step."}
    )
    activation_checkpointing: str = field(
        default="auto",
        metadata={"help": "Recompute activations in backward (saves memory). auto: on for padded batches (the "
                          "baseline recipe); on the packed path off unless the GPU's memory cannot hold one "
                          "max_length row without it. One of auto, true, false."},
    )
    activation_checkpointing_setting: str = field(
        default="auto", init=False, metadata={"help": "The setting as given (activation_checkpointing becomes "
                                                      "the Trainer's bool)."},
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing."}
    )
    disable_tqdm: bool | None = field(
        default=True, metadata={"help": "No progress bar: logs go to files; each logged step is one line."}
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Unset = on with a GPU; always off (fp32) without one."},
    )

    step_layout: str = field(
        default="auto",
        metadata={"help": "Packed path: how an optimizer step's examples reach the GPU. auto: the step's "
                          "per_device_train_batch_size x gradient_accumulation_steps examples packed into one row "
                          "(one micro-batch; split only beyond token_budget), the same examples per step; "
                          "as_configured: micro-batches of per_device_train_batch_size examples, "
                          "gradient_accumulation_steps of them. One of auto, as_configured."},
    )
    attention: str = field(
        default="auto",
        metadata={"help": "Packed path on a GPU: varlen (flash attention over the documents' offsets) or flex "
                          "(flex attention with a document BlockMask). auto: varlen where this torch has it, else "
                          "flex. On CPU always packed_sdpa. One of auto, varlen, flex."},
    )
    sharding: str = field(
        default="auto",
        metadata={"help": "The frozen base (and the adapters) sharded across the ranks with PyTorch FSDP2 "
                          "(training/sharding.py; docs/MEMORY.md). auto: sharded when the memory model says one GPU "
                          "cannot hold the run unsharded (never on CPU); fsdp: sharded (needs 2 or more ranks); "
                          "none: every rank holds the whole model (DDP). One of auto, none, fsdp."},
    )
    compile_layers: str = field(
        default="auto",
        metadata={"help": "Packed path: torch.compile the decoder blocks. auto: decided per run from this rank's "
                          "tokens and whether the compile cache is warm (compiling pays off only on longer runs). "
                          "One of auto, true, false."},
    )
    cuda_graphs: str = field(
        default="auto",
        metadata={"help": "Packed path: replay each single-micro-batch step as a CUDA graph (one process only). "
                          "auto: on for compiled runs of short (launch-bound) steps. true without a GPU runs the "
                          "same bucketed steps uncaptured. One of auto, true, false."},
    )
    defer_logs: bool = field(
        default=True,
        metadata={"help": "Packed path: read a logging step's loss, grad norm and accuracy one step later, so the "
                          "host never waits for the GPU to log; false: the Trainer's own log (read at once)."},
    )
    background_checkpoints: bool = field(
        default=True,
        metadata={"help": "Write checkpoints from a host copy of the step's state on a background thread; "
                          "false: the Trainer writes them on the training thread."},
    )
    compile_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Inductor and Triton compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), on "
                          "storage every node shares, so later jobs skip the compile; jobs set it to "
                          "/scratch/torch-compile-cache. Unset = the environment's or torch's default."},
    )
    token_budget: int | None = field(
        default=None,
        metadata={"help": "Packed path: most tokens per packed micro-batch. Unset = from the GPU's free memory "
                          "(a step with more tokens runs as several micro-batches)."},
    )
    # The cost cap (`fab train --max-cost` sets all three; training/cost_cap.py).
    max_cost_usd: float = field(
        default=0.0, metadata={"help": "Stop with a checkpoint before the run's cost would pass this many US "
                                       "dollars (0 = no cap)."})
    cost_per_hour_usd: float = field(default=0.0, metadata={"help": "What the run's instances cost per hour."})
    cost_started_at: float = field(
        default=0.0, metadata={"help": "When the run began costing (Unix seconds): the time before training "
                                       "counts as spent."})

    def __post_init__(self):
        for name in ("step_layout", "attention", "compile_layers", "cuda_graphs", "sharding"):
            setattr(self, name, choice(name, getattr(self, name)))
        setting = choice("activation_checkpointing", self.activation_checkpointing)
        if setting == "auto" and self.gradient_checkpointing is not None:  # the deprecated alias, if given
            setting = choice("activation_checkpointing", self.gradient_checkpointing)
        # The Trainer's bool: auto is the baseline's (on) until the packed path decides (training/fastpath/layout.py).
        self.activation_checkpointing_setting = setting
        self.activation_checkpointing = setting != "false"
        self.gradient_checkpointing = None
        # The same config runs on GPU nodes and on the CPU-only local cluster: bf16 needs a GPU.
        if not gpu_available():
            if self.bf16:
                log.warning("no GPU: bf16 is turned off, training runs in float32")
            self.bf16 = False
            # use_cpu makes accelerate treat torchrun ranks as MULTI_CPU with the gloo backend;
            # without it, ranks on a GPU-less machine would each train alone (world size 1).
            self.use_cpu = True
        elif self.bf16 is None:
            self.bf16 = True
        if self.max_cost_usd < 0 or (self.max_cost_usd and self.cost_per_hour_usd <= 0):
            raise ValueError(f"max_cost_usd must be 0 (no cap) or positive with cost_per_hour_usd > 0: got "
                             f"{self.max_cost_usd}, {self.cost_per_hour_usd}")
        super().__post_init__()


    @property
    def place_model_on_device(self) -> bool | None:
        """The Trainer moves the model to the GPU unless this says False (transformers TrainingArguments'
        documented override): a sharded run's model is placed unit by unit as it is sharded
        (training/sharding.py), never whole."""
        return False if getattr(self, "sharded", False) else None


def make_parser() -> TrlParser:
    return TrlParser((DataArguments, ModelArguments, TrainConfig))


def parse_args(argv: list[str] | None = None) -> tuple[DataArguments, ModelArguments, TrainConfig]:
    """Parse `--config file.yaml` and flags (flags win); unknown settings are an error."""
    return make_parser().parse_args_and_config(argv)
