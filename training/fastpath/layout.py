"""What the packed path makes of the config's step layout: examples per micro-batch, micro-batches per step,
activation checkpointing, and the Trainer settings that would stop the host waiting on the GPU.

Each choice is the config's word, or the fast path's under a setting the config states (`step_layout: auto`,
`activation_checkpointing: auto`); `prepare_args` returns them as the run's choices (value, who decided).
"""

from __future__ import annotations

import torch


def config_value(args, name: str, default: str = "auto") -> str:
    """A fast-path setting of `args`: TrainConfig has them all; a plain SFTConfig (tests, benchmarks) has the
    Trainer's fields only and gets the default."""
    value = getattr(args, name, default)
    return default if value is None else value


def prepare_args(train_args):
    """Mutate and return `train_args` for the packed path, with the choices it made, {name: {value, by}}, in
    its `fastpath_choices` attribute. A second call changes nothing (PackedSFTTrainer calls it too).

    step_layout auto: one packed row per optimizer step (per_device_train_batch_size x
    gradient_accumulation_steps examples, accumulation 1): the same examples per optimizer step, far fewer
    and larger kernels. activation_checkpointing auto: off (the trainer turns it back on when the GPU's
    memory cannot hold one max_length row without it).
    """
    if getattr(train_args, "fastpath_choices", None) is not None:
        return train_args
    per_device, accumulation = train_args.per_device_train_batch_size, train_args.gradient_accumulation_steps
    choices: dict[str, dict] = {}
    if config_value(train_args, "step_layout") == "auto":
        train_args.per_device_train_batch_size = per_device * accumulation
        train_args.gradient_accumulation_steps = 1
        by = f"auto (step_layout): {per_device} x {accumulation} packed into one row a step"
    else:
        by = "config (step_layout: as_configured)"
    choices["examples_per_micro_batch"] = {"value": train_args.per_device_train_batch_size, "by": by}
    choices["gradient_accumulation_steps"] = {"value": train_args.gradient_accumulation_steps, "by": by}

    # A plain SFTConfig says True/False, which is the user's word; TrainConfig keeps the setting itself.
    setting = getattr(train_args, "activation_checkpointing_setting", None) or \
        ("true" if train_args.activation_checkpointing else "false")
    if setting == "auto":
        train_args.activation_checkpointing = False
        choices["activation_checkpointing"] = {"value": False, "by": "auto: packed rows need no recomputation "
                                                                     "while the memory budget allows"}
    else:
        train_args.activation_checkpointing = setting == "true"
        choices["activation_checkpointing"] = {"value": setting == "true", "by": "config"}
    train_args.gradient_checkpointing = train_args.activation_checkpointing
    # The packed row is not a padded batch: TRL's own padding-free handling must stay out of the way.
    if getattr(train_args, "padding_free", False):
        train_args.padding_free = False
    # Keep the prepared columns (input_ids, labels) for the collator.
    train_args.remove_unused_columns = False
    # No host<->device sync inside a step, so the CPU queues the next step while the GPU works:
    # the Trainer's NaN filter of the logged loss reads the loss every step (a sync), and a blocking
    # copy of the batch waits for the previous step's kernels.
    train_args.logging_nan_inf_filter = False
    train_args.dataloader_pin_memory = torch.cuda.is_available()
    config = getattr(train_args, "accelerator_config", None)
    if config is not None and hasattr(config, "non_blocking"):
        config.non_blocking = True
    train_args.fastpath_choices = choices
    return train_args
