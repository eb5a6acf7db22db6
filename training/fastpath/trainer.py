"""PackedSFTTrainer: TRL's SFTTrainer whose optimizer steps are packed rows (training/fastpath/).

Built with the config's fast-path settings (training/args.py): `step_layout`, `activation_checkpointing`,
`compile_layers`, `cuda_graphs`, `token_budget`, `defer_logs`; each choice is the config's word or, under
`auto`, the fast path's, and `choices` records which (value, who decided and why) for the run's log and
metrics.json. The Trainer's public hooks carry most of it (compute_loss, training_step, get_train_dataloader,
floating_point_ops, log); what they cannot do is in PRIVATE_OVERRIDES below, with the reason, and
tests/unit/test_trainer_contract.py holds the pinned transformers' signatures of those methods.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from trl import SFTTrainer

from training.fastpath.accounting import TokenAccounting
from training.fastpath.attention import PACKED_SDPA, attention_mask_for, register_packed_attention
from training.fastpath.batches import (
    DEFAULT_TOKEN_BUDGET,
    PAD_MULTIPLE,
    PackedCollator,
    example_targets,
    packed_shape,
    split_by_token_budget,
)
from training.fastpath.compile_choice import decide_compile, mark_compile_cache
from training.fastpath.deferred_logs import DeferredLogs
from training.fastpath.layout import config_value, prepare_args
from training.fastpath.memory import token_budget_for, usable_gpu_bytes
from training.fastpath.model import add_packed_lm_head, compile_layers, unwrap
from training.fastpath.sampler import EpochDataLoader, StepShardSampler
from training.fastpath.step_graphs import StepGraphs, decide_graphs

log = logging.getLogger(__name__)

# Private methods of transformers.Trainer that the fast path overrides (in this module, deferred_logs.py or
# training/checkpoints.py), and why no public hook does it. tests/unit/test_trainer_contract.py fails when the
# pinned transformers changes one of their signatures.
PRIVATE_OVERRIDES: dict[str, str] = {
    "_prepare_input": "tensors to the GPU with non_blocking=True: the Trainer's blocking copy waits for the "
                      "previous step's kernels (a sync a step); no hook moves the batch",
    "_get_num_items_in_batch": "one process: the step's scored-token count as a host int; the Trainer's copies "
                               "it to the GPU with a blocking copy (a sync a step)",
    "_maybe_log_save_evaluate": "deferred logs: the Trainer reads the loss and grad norm (.item()) here; "
                                "on_log callbacks run after that read",
    "_finalize_training": "deferred logs: the pending log must be written before the Trainer sums train_loss; "
                          "on_train_end runs after",
    "_save_checkpoint": "background checkpoints: the files written from a host copy on another thread; "
                        "on_save runs after the Trainer has written them",
}
# Private Trainer methods the overrides call (their signatures are held by the same test).
PRIVATE_CALLS = ("_save", "_save_scaler", "_save_rng_state", "_get_output_dir", "_get_learning_rate")


class PackedSFTTrainer(DeferredLogs, TokenAccounting, SFTTrainer):
    """SFTTrainer whose steps are packed rows with a document mask (see training/fastpath/__init__.py)."""

    def __init__(self, *args, **kwargs):
        kwargs["args"] = prepare_args(kwargs["args"])
        self.choices = dict(kwargs["args"].fastpath_choices)
        super().__init__(*args, **kwargs)
        self.model.config.use_cache = False
        add_packed_lm_head(unwrap(self.model))
        self._lengths: list[int] | None = None
        self.planned_tokens = self._planned_tokens()
        setting = {"auto": None, "true": True, "false": False}[config_value(self.args, "compile_layers")]
        compile_model, self.compile_reason = decide_compile(setting, self.planned_tokens, self.model)
        config = unwrap(self.model).config
        if config._attn_implementation == PACKED_SDPA:
            register_packed_attention()
        if config._attn_implementation in (PACKED_SDPA, "flex_attention") and not compile_model \
                and torch.cuda.is_available():
            # Eager on a GPU without varlen attention: one SDPA call with a dense document mask launches far
            # fewer kernels than packed_sdpa's gathers, and flex attention needs compiling.
            config._attn_implementation = "sdpa"
        self.compiled_layers = compile_layers(self.model) if compile_model else 0
        self.choices["compile_layers"] = {"value": bool(self.compiled_layers), "by": self.compile_reason}
        self._set_token_budget()
        graphs = {"auto": None, "true": True, "false": False}[config_value(self.args, "cuda_graphs")]
        lengths = self._row_lengths()
        step_tokens = sum(lengths) / max(len(lengths), 1) * self.args.per_device_train_batch_size
        self.use_step_graphs, why = decide_graphs(graphs, bool(compile_model), max(1, self.args.world_size),
                                                  self.args.gradient_accumulation_steps, step_tokens)
        self.choices["cuda_graphs"] = {"value": self.use_step_graphs, "by": why}
        attention = config_value(self.args, "attention")
        self.choices["attention"] = {"value": config._attn_implementation,
                                     "by": "config" if attention != "auto" else "auto: this machine's"}
        if self.use_step_graphs and isinstance(self.data_collator, PackedCollator) and \
                config._attn_implementation != "flex_attention":
            self.data_collator.pad_to_multiple_of = 1  # the step graphs pad each row to its bucket
        self.step_graphs = None  # built at the first step, around the model the Trainer steps
        self.real_tokens_seen = 0
        self.defer_logs = bool(getattr(self.args, "defer_logs", True))
        self.choices["defer_logs"] = {"value": self.defer_logs, "by": "config"}

    # ---- data
    def _row_lengths(self) -> list[int]:
        """Each training row's tokens, read once (reading a column materialises all of it)."""
        if self._lengths is None:
            self._lengths = [len(x) for x in self.train_dataset["input_ids"]]
        return self._lengths

    def _planned_tokens(self) -> float:
        """Tokens this rank will train on in this run (after tokenization and truncation)."""
        lengths = self._row_lengths()
        world = max(1, self.args.world_size)
        if self.args.max_steps and self.args.max_steps > 0:
            per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
            return min(self.args.max_steps * per_step, len(lengths) / world) * (sum(lengths) / len(lengths))
        return sum(lengths) * self.args.num_train_epochs / world

    def _set_token_budget(self) -> None:
        collator = self.data_collator
        if not isinstance(collator, PackedCollator):
            return
        if getattr(self.args, "token_budget", None):
            self.choices["token_budget"] = {"value": collator.token_budget, "by": "config"}
            return
        by = "auto: no GPU (the default)"
        checkpointed = bool(self.args.activation_checkpointing)
        if torch.cuda.is_available():
            mode = "checkpointed" if checkpointed else "compiled" if self.compiled_layers else "eager"
            budget = token_budget_for(self.model, mode)
            longest = self.args.max_length or 1024
            by = f"auto: the GPU's free memory ({mode} blocks)"
            if budget < longest and not checkpointed:
                if self.choices["activation_checkpointing"]["by"] != "config":
                    # Not even one row of the maximum length fits: recompute activations in backward.
                    unwrap(self.model).gradient_checkpointing_enable({"use_reentrant": False})
                    budget = token_budget_for(self.model, "checkpointed")
                    self.choices["activation_checkpointing"] = {
                        "value": True, "by": f"auto: the GPU's memory holds no {longest}-token row without it"}
                    by = "auto: the GPU's free memory (checkpointed blocks)"
                else:
                    log.warning("GPU memory allows no %d-token row without recomputation, and "
                                "activation_checkpointing is false in the config", longest)
            collator.token_budget = max(budget, PAD_MULTIPLE)
        self.choices["token_budget"] = {"value": collator.token_budget, "by": by}

    def _step_sampler(self) -> StepShardSampler:
        return StepShardSampler(
            len(self.train_dataset), self.args.per_device_train_batch_size, max(1, self.args.world_size),
            self.args.process_index, self.args.data_seed if self.args.data_seed is not None else self.args.seed)

    def _planned_step_shapes(self) -> list[tuple[int, int, int, int]]:
        """The packed shape (packed_shape) of every single-micro-batch step this run will take: the sampler's
        order is seeded and the rows are tokenized, so the step graphs can size their buckets before the run's
        first step."""
        dataset, collator = self.train_dataset, self.data_collator
        columns = dataset.column_names
        ids = list(dataset["input_ids"])
        labels = list(dataset["labels"]) if "labels" in columns else [None] * len(ids)
        masks = list(dataset["completion_mask"]) if "completion_mask" in columns else [None] * len(ids)
        lengths = self._row_lengths()
        targets = [example_targets(x, y, m) for x, y, m in zip(ids, labels, masks, strict=True)]
        sampler = self._step_sampler()
        steps = self.args.max_steps if self.args.max_steps and self.args.max_steps > 0 else \
            math.ceil(len(sampler) * self.args.num_train_epochs)
        shapes: list[tuple[int, int, int, int]] = []
        taken = epoch = 0
        while len(sampler) and taken < steps:
            sampler.set_epoch(epoch)
            for batch in sampler:
                if taken == steps:
                    break
                taken += 1
                step_lengths = [lengths[i] for i in batch]
                if len(split_by_token_budget(step_lengths, collator.token_budget)) == 1:  # else: not graphed
                    shapes.append(packed_shape(step_lengths, [targets[i] for i in batch],
                                               collator.pad_to_multiple_of))
            epoch += 1
        return shapes

    def get_train_dataloader(self):
        """One rank's share of every optimizer step (StepShardSampler), without accelerate's even-batch
        padding, which would repeat examples."""
        return EpochDataLoader(self.train_dataset, batch_sampler=self._step_sampler(),
                               collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
                               pin_memory=self.args.dataloader_pin_memory)

    def _prepare_input(self, data):
        """As the Trainer's, but tensors go to the GPU without blocking (PRIVATE_OVERRIDES)."""
        if torch.is_tensor(data) and not self.is_deepspeed_enabled:
            return data.to(device=self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def _get_num_items_in_batch(self, batch_samples, device):
        """The step's scored-token count. One process: a host int, counted on the host (PRIVATE_OVERRIDES).
        Several processes: the Trainer's, which all-gathers the counts."""
        if max(1, self.args.world_size) > 1:
            return super()._get_num_items_in_batch(batch_samples, device)
        count = super()._get_num_items_in_batch(batch_samples, torch.device("cpu"))
        return int(count) if torch.is_tensor(count) else count

    # ---- step
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = attention_mask_for(unwrap(self.model), inputs)
        log_probs, is_top1 = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                                   attention_mask=mask, use_cache=False, packed_head=True,
                                   target_index=inputs["target_index"], target_ids=inputs["target_ids"])
        denominator = num_items_in_batch if num_items_in_batch is not None else inputs["num_targets"]
        denominator = denominator.clamp(min=1) if torch.is_tensor(denominator) else max(int(denominator), 1)
        loss = -log_probs.sum() / denominator
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch counts every rank's tokens and DDP averages the gradients.
            loss = loss * self.accelerator.num_processes
        hits = is_top1.sum()
        self._correct = hits if self._correct is None else self._correct + hits
        self._scored += int(inputs["num_targets"])
        return (loss, (log_probs, is_top1)) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch's examples: forward + backward over each packed row of it."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self.real_tokens_seen += int(inputs.get("num_real_tokens", 0))
        micro_batches = self._prepare_inputs(inputs)["micro_batches"]
        graphs = self._graphs_for(model)
        if graphs is not None and len(micro_batches) == 1 and graphs.fits(micro_batches[0]):
            loss = self._graph_step(graphs, micro_batches[0])
            self._after_first_step()
            return loss
        total = None
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # Under DDP every rank all-reduces once per step, whatever its number of micro-batches.
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, micro, num_items_in_batch=num_items_in_batch)
                self.accelerator.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        self._after_first_step()
        return total

    def _graphs_for(self, model):
        if not self.use_step_graphs:
            return None
        if self.step_graphs is None:
            mode = "compiled" if self.compiled_layers else "eager"
            # The graphs keep their own memory pool: graph only steps whose activations fit twice.
            max_tokens = token_budget_for(self.model, mode, usable_gpu_bytes() / 2) \
                if torch.cuda.is_available() else DEFAULT_TOKEN_BUDGET
            params = [p for p in model.parameters() if p.requires_grad]
            attention = getattr(unwrap(self.model).config, "_attn_implementation", None)
            self.step_graphs = StepGraphs(model, params, self.data_collator.pad_token_id, max_tokens,
                                          attention, self.compute_loss_context_manager)
            self.step_graphs.plan(self._planned_step_shapes())
            log.info("step CUDA graphs for packed rows of up to %d tokens; buckets planned for the run's "
                     "steps (tokens, targets, documents, longest): %s", max_tokens, self.step_graphs.planned)
        return self.step_graphs if self.step_graphs.enabled else None

    def _graph_step(self, graphs, micro):
        """One step of a single micro-batch through the step graphs (one process, one micro-batch a step: the
        loss is the mean over this row's scored tokens, taken from the host so that nothing waits)."""
        scale = 1.0 / max(int(micro["num_targets"]), 1)
        loss, hits, grads = graphs.step(micro, scale)
        graphs.set_grads(grads)
        self._correct = hits.clone() if self._correct is None else self._correct + hits
        self._scored += int(micro["num_targets"])
        return loss.clone()

    def _after_first_step(self) -> None:
        if self.compiled_layers and self.state.global_step == 0 and torch.cuda.is_available():
            mark_compile_cache(self.model)  # the next run on this cache finds the blocks compiled
