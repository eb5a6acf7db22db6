"""The frozen base (and the LoRA adapters) sharded across the ranks with PyTorch FSDP2 (`fully_shard`).

The `sharding` setting (training/args.py): fsdp shards; auto shards when training/memory_model.py's `run_plan`
says one GPU cannot hold the run unsharded (the fit check before launch asks the same function, with the
instance type's memory: ops/cost/fit.py); none never does. On CPU (the local cluster) auto never shards: there
is no GPU memory to fit.

How: after PEFT has wrapped the model, each decoder layer becomes one FSDP2 unit (`fully_shard(layer)`) and the
root (embedding, final norm, LM head) another (PyTorch's FSDP2 guide, docs.pytorch.org/docs/stable/
distributed.fsdp.fully_shard.html: "apply fully_shard to submodules before the root"). Each parameter is then a
DTensor holding 1/N of its rows on each rank (`Shard(0)`), frozen or not: FSDP2 lets one unit mix frozen and
trainable parameters, so the adapters are sharded with their layer (their gradients reduce-scattered, AdamW's
state 1/N per rank). Sharded over every rank (one mesh dimension); the same on one node or many.

Accelerate's FSDP support (its FullyShardedDataParallelPlugin, transformers' `fsdp` TrainingArguments) is
only for GPU-like devices: accelerate/state.py sets DistributedType.FSDP only for MULTI_GPU and its kin, never
MULTI_CPU, so the local cluster's gloo ranks could not run it. Sharding here directly works on both, and the
model is marked prepared so that accelerate does not wrap it in DDP (accelerator.py `prepare_model`: "Ensure
we can't double wrap a model", `_is_accelerate_prepared`).

What a sharded run does differently (each printed once, in the run's choices):
- the adapters are gathered whole (`DTensor.full_tensor`, every rank) and rank 0 writes them in PEFT's format,
  so they load without sharding (`ShardedSaves._save`);
- a checkpoint's optimizer state is each rank's shard, in its own file (`optimizer.rank<r>.pt`), read back by
  the same rank on resume (the same world size is needed, as a requeue has);
- evaluation scores every held-out row on every rank (a sharded forward is a collective: each rank must run
  as many as the others), and sample answers are skipped (generating on rank 0 alone would wait for ranks that
  do not generate);
- the fast path's compiled blocks and CUDA graphs are off, and checkpoints are written by the Trainer (not in
  the background).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch

from training import memory_model as mm

log = logging.getLogger(__name__)

OPTIMIZER_SHARD = "optimizer.rank{rank}.pt"


ShardingError = mm.ShardingError  # a sharding setting this run cannot take: the setting and the fix, one line


def setting_reader(*configs) -> Callable[[str], object]:
    """A setting by name from the run's parsed dataclasses (the first that has it), in the form the memory model
    reads (training/memory_model.py `plan_from_settings`): the YAML's words, not the Trainer's bools."""
    def read(key: str):
        if key == "activation_checkpointing":
            for c in configs:
                if hasattr(c, "activation_checkpointing_setting"):
                    return c.activation_checkpointing_setting
        if key == "flex_packing":
            for c in configs:
                if hasattr(c, "flex_packing_setting"):
                    return c.flex_packing_setting
        for c in configs:
            if hasattr(c, key):
                return getattr(c, key)
        return None
    return read


def decide(setting: Callable[[str], object], config: dict, world_size: int, gpu: bool,
           usable: float | None = None) -> tuple[bool, str]:
    """(shard?, why) for this run: the memory model's `run_plan` with this GPU's memory (`usable`; on CPU none:
    auto never shards there). ShardingError for fsdp with one rank."""
    value = str(setting("sharding") or "auto")
    if value == "none":
        return False, "config"
    if value == "fsdp" and world_size < 2:
        raise ShardingError(mm.one_rank_refusal(world_size))
    if value == "fsdp":
        return True, "config"
    if not gpu:
        return False, "auto: no GPU memory to fit (CPU)"
    try:
        plan = mm.run_plan(config, setting, world_size, usable if usable is not None else math.inf, gpu=True)
    except mm.ModelConfigError as exc:  # a config the memory model cannot read: unsharded, as before
        return False, f"auto: unsharded (the memory model cannot read config.json: {exc})"
    if plan.shards > 1:
        return True, next(n for n in plan.notes if n.startswith("sharding auto"))
    if world_size < 2:
        return False, "auto: one rank, nothing to shard over"
    return False, "auto: the run fits one GPU unsharded"


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a (PEFT-wrapped) causal LM: the first ModuleList named `layers`."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise ShardingError("sharding: fsdp: no decoder `layers` in this model to shard; set sharding to none")


def shard(model, world_size: int) -> torch.nn.Module:
    """Shard `model` (PEFT-wrapped, on this rank's device) over `world_size` ranks in place: each decoder layer one
    FSDP2 unit, the root another; marked prepared so accelerate leaves it (no DDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._is_accelerate_prepared = True
    return model


def local_bytes(model) -> dict[str, int]:
    """This rank's bytes of parameters (each DTensor's local shard) and buffers: {"sharded", "replicated",
    "buffers", "trainable"}. A plain tensor parameter is replicated (every rank holds all of it)."""
    from torch.distributed.tensor import DTensor

    out = {"sharded": 0, "replicated": 0, "buffers": 0, "trainable": 0}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        size = local.numel() * local.element_size()
        out["sharded" if isinstance(p, DTensor) else "replicated"] += size
        if p.requires_grad:
            out["trainable"] += size
    out["buffers"] = sum(b.numel() * b.element_size() for b in model.buffers())
    return out


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The trainable parameters (the adapters) whole, on the CPU: a collective, every rank calls it."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = whole.detach().to("cpu")
    return out


class ShardedSaves:
    """Trainer mixin for a sharded model: the adapters gathered whole and written by rank 0 in PEFT's format,
    each rank's optimizer shard in its own file. Mixed in before the Trainer class (`sharded_trainer`)."""

    def save_model(self, output_dir=None, _internal_call=False):
        """Every rank gathers (a collective); rank 0 writes. The Trainer calls `_save` on rank 0 alone."""
        output_dir = output_dir or self.args.output_dir
        state = full_state_dict(self.model)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            # PEFT's save_pretrained keeps the adapter keys of `state_dict` (peft/peft_model.py save_pretrained:
            # get_peft_model_state_dict(self, state_dict=...)): adapter_model.safetensors + adapter_config.json.
            self.model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir):
        rank = self.args.process_index
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_SHARD.format(rank=rank)))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
        # Every shard on disk before rank 0 writes trainer_state.json, the mark of a complete checkpoint.
        torch.distributed.barrier()

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_SHARD.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            raise ShardingError(f"sharding: {checkpoint} has no {os.path.basename(path)}: it was written by a "
                                "run of another world size or unsharded; resume with the same ranks and sharding")
        self.optimizer.load_state_dict(torch.load(path, weights_only=False))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The checkpoint's adapters (whole, as saved) into the sharded model, every rank its shard."""
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor, distribute_tensor

        weights = load_file(os.path.join(resume_from_checkpoint, "adapter_model.safetensors"))
        model = model or self.model
        wanted = {name: p for name, p in model.named_parameters() if p.requires_grad}
        loaded = _peft_names_to_model(model, weights)  # PEFT's saved names -> this model's
        missing = sorted(set(wanted) - set(loaded))
        if missing:
            raise ShardingError(f"sharding: {resume_from_checkpoint} lacks adapters {missing[:3]}...")
        with torch.no_grad():
            for name, p in wanted.items():
                whole = loaded[name].to(p.dtype)
                if isinstance(p, DTensor):
                    p.copy_(distribute_tensor(whole.to(p.to_local().device), p.device_mesh, p.placements))
                else:
                    p.copy_(whole)


def _peft_names_to_model(model, weights: dict) -> dict:
    """PEFT's saved keys (`...q_proj.lora_A.weight`) as this model's parameter names (`...lora_A.default.weight`)."""
    adapter = getattr(model, "active_adapter", "default")
    out = {}
    for key, value in weights.items():
        for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            key = key.replace(f".{part}.", f".{part}.{adapter}.")
        out[key] = value
    return out


def sharded_trainer(trainer_class: type) -> type:
    """`trainer_class` with ShardedSaves mixed in."""
    return type(f"Sharded{trainer_class.__name__}", (ShardedSaves, trainer_class), {})
