"""Settings of training/train.py as dataclasses, parsed by TRL's TrlParser (YAML `--config` + flags).

Defaults are the seed's recipe (Qwen/Qwen3-4B, tatsu-lab/alpaca first 2,000 rows, LoRA r16/alpha 32/
dropout 0.05 on q/k/v/o, lr 2e-4, one epoch, batch 2 x 8, max length 1024, bf16), so running
without a config reproduces it; configs/*.yaml override them and flags override the config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trl import ModelConfig, SFTConfig, TrlParser

log = logging.getLogger(__name__)


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class DataArguments:
    """What to train on."""

    dataset_name: str = field(
        default="tatsu-lab/alpaca",
        metadata={"help": "Hub data set ID, or a local JSON/JSONL/Parquet file or directory with "
                          "instruction/input/output columns."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub data set configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Hub split to train on."})
    n_examples: int = field(
        default=2000, metadata={"help": "Train on the first N rows (0 = all rows)."}
    )
    flex_packing: bool | None = field(
        default=None,
        metadata={"help": "Padding-free packed batches (training/packing.py; the name is historic: on a GPU the "
                          "attention is flash varlen, TRAINING_ATTENTION=flex for flex). Unset = auto: on when a "
                          "GPU is present and the fast path is installed; false = padded batches."},
    )


@dataclass
class ModelArguments(ModelConfig):
    """TRL's ModelConfig with the seed's model and LoRA as defaults."""

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
    """TRL's SFTConfig with the seed's recipe as defaults, plus CPU handling (fp32 when no GPU)."""

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
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Experiment trackers (none)."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "False: frozen base weights are not searched for every step."}
    )
    activation_checkpointing: bool | None = field(
        default=True, metadata={"help": "Recompute activations in backward (the seed's recipe; saves memory)."}
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

    compile_layers: bool | None = field(
        default=None,
        metadata={"help": "Packed path: torch.compile the decoder blocks. Unset = decided per run from this "
                          "rank's tokens and whether the compile cache is warm (compiling pays off only on "
                          "longer runs); the environment variable TRAINING_COMPILE=1/0 forces it."},
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

    def __post_init__(self):
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
        super().__post_init__()


def make_parser() -> TrlParser:
    return TrlParser((DataArguments, ModelArguments, TrainConfig))


def parse_args(argv: list[str] | None = None) -> tuple[DataArguments, ModelArguments, TrainConfig]:
    """Parse `--config file.yaml` and flags (flags win); unknown settings are an error."""
    return make_parser().parse_args_and_config(argv)
