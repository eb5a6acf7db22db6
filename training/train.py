"""LoRA fine-tune of a causal LM with TRL's SFTTrainer, on one process or many (torchrun).

Defaults are the seed's recipe (Qwen/Qwen3-4B on the first 2,000 rows of tatsu-lab/alpaca, LoRA r16 on
q/k/v/o, lr 2e-4, one epoch, batch 2 x 8, max length 1024, bf16); settings come from a YAML config
and/or flags (flags win), see training/args.py. Launched by jobs/ on every node, from the job
directory (so `training` imports as a package):

    python -m torch.distributed.run --nnodes=$SLURM_JOB_NUM_NODES --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=$SLURM_JOB_ID \
        -m training.train --config training/configs/qwen3-4b-lora.yaml

One process on a laptop: `python -m training.train --config training/configs/local-tiny.yaml
--model_name_or_path DIR/model --dataset_name DIR/data/train.jsonl --output_dir out`.

What it fixes relative to the seed: the Alpaca `input` joins the prompt; the loss covers the response
only (prompt/completion rows); local data files are validated before the model loads; a checkpoint
every `save_steps` and an automatic resume from the last complete one (Slurm requeue); fp32 and gloo
on machines without a GPU. With a GPU, the padding-free fast path (training/packing.py) is the
default (`flex_packing`, unset = auto). Output in `output_dir`: the adapters, trainer_state.json and metrics.json;
rank 0 prints `SLURM_GPU_LOG {json}` per logged step and `SLURM_GPU_METRICS {json}` at the end.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from training.args import DataArguments, ModelArguments, TrainConfig, gpu_available, parse_args
from training.data import DataError, load_instruction_dataset

log = logging.getLogger("training.train")

METRICS_PREFIX = "SLURM_GPU_METRICS "
LOG_PREFIX = "SLURM_GPU_LOG "
RESUME_PREFIX = "SLURM_GPU_RESUMED "
# Written last, after the adapters, trainer_state.json and metrics.json: a requeued instance of a
# job that finished (a node lost after training, e.g. munged killed) sees it and does not retrain.
COMPLETED_MARKER = "COMPLETED"
# Test-only fault injection: the rank SLURM_GPU_FAULT_RANK raises after optimizer step SLURM_GPU_FAULT_STEP.
FAULT_RANK_ENV = "SLURM_GPU_FAULT_RANK"
FAULT_STEP_ENV = "SLURM_GPU_FAULT_STEP"


# ---------------------------------------------------------------- data and model

def prepare_dataset(data_args: DataArguments):
    """Load and validate the rows (before any model is loaded, so bad data fails in seconds)."""
    return load_instruction_dataset(
        data_args.dataset_name,
        split=data_args.dataset_train_split,
        config=data_args.dataset_config,
        n_examples=data_args.n_examples or None,
    )


def resolve_flex_packing(setting: bool | None, gpu: bool | None = None) -> bool:
    """Whether to use the padding-free packed fast path (training/packing.py).

    None = auto: on with a GPU when the fast path is installed, otherwise padded batches.
    True without the module is an error rather than a silent slow run.
    """
    installed = importlib.util.find_spec("training.packing") is not None
    if setting is True and not installed:
        raise ValueError("flex_packing=true needs training/packing.py, which is not installed; "
                         "set flex_packing to false (padded batches) or leave it unset (auto)")
    if setting is None:
        return installed and (gpu_available() if gpu is None else gpu)
    return setting


def load_tokenizer(model_args: ModelArguments, train_args: TrainConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision,
        trust_remote_code=train_args.trust_remote_code,
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_args: ModelArguments, train_args: TrainConfig, flex_packing: bool):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = model_args.dtype or "auto"
    if not gpu_available() and dtype != "float32":
        log.warning("no GPU: loading the model in float32 instead of %s", dtype)
        dtype = "float32"
    attn_implementation = model_args.attn_implementation
    if flex_packing:
        from training import packing  # the fast path needs an attention that takes its document mask
        packing.register_packed_attention()
        attn_implementation = packing.attention_implementation()
    # Straight onto this rank's GPU: no staging copy of the weights in host memory.
    device_map = {"": torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))} if gpu_available() else None
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=train_args.trust_remote_code,
        attn_implementation=attn_implementation,
        dtype=dtype if dtype == "auto" else getattr(torch, dtype),
        device_map=device_map,
    )


def use_compile_cache(directory: str | None) -> None:
    """Point Inductor's and Triton's caches at `directory` (shared storage: the compiled blocks of one
    job serve every later job and node), unless the environment already names them."""
    if not directory:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", directory)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton"))


def make_collator(tokenizer, train_args: TrainConfig, flex_packing: bool):
    """None = TRL's own collator (padded batches, labels -100 on prompt and padding)."""
    if flex_packing:
        from training import packing
        return packing.make_collator(tokenizer, train_args)
    return None


# ---------------------------------------------------------------- callbacks

def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class StepLogCallback(TrainerCallback):
    """One JSON line per logged step on rank 0, for `fab train`'s progress display."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            line = {"step": state.global_step, "max_steps": state.max_steps, **logs}
            print(LOG_PREFIX + json.dumps(line), flush=True)


class FaultInjectionCallback(TrainerCallback):
    """Test-only: make one rank crash after a given optimizer step (proves the job fails fast)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, args, state, control, **kwargs):
        if _rank() == self.rank and state.global_step == self.step:
            raise RuntimeError(f"injected fault ({FAULT_RANK_ENV}={self.rank}, {FAULT_STEP_ENV}={self.step})")


class PhaseTimingCallback(TrainerCallback):
    """Where a run's training time goes, for metrics.json and time-to-adapters: the host's clock at the end
    of the first optimizer step (CUDA, kernel and allocator warm-up included) and the wall seconds the loop
    spends on checkpoints: from a saving step's end until training may go on (the queued step finishing on
    the GPU, its log, and the files, or with background checkpoints a copy of the state)."""

    def __init__(self):
        self.first_step_end: float | None = None
        self.checkpoint_s = 0.0
        self.checkpoints = 0
        self._step_end: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        self._step_end = time.time()
        if self.first_step_end is None:
            self.first_step_end = self._step_end

    def on_save(self, args, state, control, **kwargs):
        if self._step_end is not None:
            self.checkpoint_s += time.time() - self._step_end
            self.checkpoints += 1


class NoFinalCheckpointCallback(TrainerCallback):
    """Drop the checkpoint the Trainer schedules at the last step (final_checkpoint=false): the adapters and
    trainer state follow at once in output_dir. Runs after the Trainer's own flow callback, which sets it."""

    def on_step_end(self, args, state, control, **kwargs):
        return self._drop_at_end(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self._drop_at_end(state, control)

    @staticmethod
    def _drop_at_end(state, control):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_save = False
        return control


def make_callbacks(final_checkpoint: bool) -> list[TrainerCallback]:
    callbacks: list[TrainerCallback] = [StepLogCallback()]
    if not final_checkpoint:
        callbacks.append(NoFinalCheckpointCallback())
    if os.environ.get(FAULT_RANK_ENV) and os.environ.get(FAULT_STEP_ENV):
        callbacks.append(FaultInjectionCallback(int(os.environ[FAULT_RANK_ENV]), int(os.environ[FAULT_STEP_ENV])))
    return callbacks


# ---------------------------------------------------------------- trainer, resume, metrics

def build_trainer(model, tokenizer, dataset, model_args: ModelArguments, train_args: TrainConfig,
                  flex_packing: bool = False, callbacks: list[TrainerCallback] | None = None):
    from trl import SFTTrainer, get_peft_config

    from training.background_checkpoints import with_background_checkpoints

    trainer_cls = SFTTrainer
    if flex_packing:
        # One packed row per optimizer step (same examples per step), no checkpointing, compiled layers.
        from training import packing
        train_args = packing.prepare_args(train_args)
        trainer_cls = packing.packed_trainer_class()
    trainer_cls = with_background_checkpoints(trainer_cls)
    extra = {"compile_model": train_args.compile_layers} if flex_packing else {}
    trainer = trainer_cls(
        **extra,
        model=model,
        args=train_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=make_collator(tokenizer, train_args, flex_packing),
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )
    if not trainer.completion_only_loss:
        raise ValueError("completion_only_loss is off: the loss would cover the prompt; leave it unset or true")
    return trainer


_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def find_resume_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in output_dir (None on a fresh directory).

    Like transformers.trainer_utils.get_last_checkpoint, but skips a checkpoint cut short by a node
    loss: trainer_state.json is written last, so a checkpoint without it is incomplete.
    """
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(m.group(1)), name) for name in os.listdir(output_dir)
        if (m := _CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
        log.warning("skipping incomplete checkpoint %s (no trainer_state.json)", path)
    return None


def dataset_tokens(dataset) -> int:
    """Non-padding tokens in one pass over the prepared (tokenized, truncated) data set, all ranks together."""
    return sum(len(ids) for ids in dataset["input_ids"])


def _backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def collect_metrics(trainer, train_output, start_epoch: float, start_step: int, epoch_tokens: int) -> dict:
    state = trainer.state
    history = state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    accuracies = [h["mean_token_accuracy"] for h in history if "mean_token_accuracy" in h]
    end_epoch = state.epoch or 0.0
    runtime = train_output.metrics.get("train_runtime", 0.0)
    run_tokens = epoch_tokens * (end_epoch - start_epoch)  # processed by this run (after any resume)
    return {
        "train_runtime": runtime,
        "train_steps": state.global_step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "train_loss": train_output.training_loss,
        "mean_token_accuracy": accuracies[-1] if accuracies else None,
        "train_tokens": round(epoch_tokens * end_epoch),
        "tokens_per_s": run_tokens / runtime if runtime else None,
        "world_size": trainer.args.world_size,
        "distributed_backend": _backend(),
        "deferred_logs": bool(getattr(trainer, "defer_logs", False)),  # packed path: logs read a step later
        "resumed_from_step": start_step,
        "epoch": end_epoch,
        "log_history": history,
    }


def write_metrics(output_dir: str, metrics: dict) -> None:
    path = Path(output_dir) / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=2))
    tmp.replace(path)
    summary = {k: v for k, v in metrics.items() if k != "log_history"}
    print(METRICS_PREFIX + json.dumps(summary), flush=True)


def write_completed(output_dir: str, metrics: dict) -> None:
    """The completion marker (one JSON line of the final metrics), atomically, after everything else."""
    path = Path(output_dir) / COMPLETED_MARKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: v for k, v in metrics.items() if k != "log_history"}) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict | None:
    """Train; return the metrics on rank 0 (None on other ranks)."""
    from transformers import set_seed

    data_args, model_args, train_args = parse_args(argv)
    timing = {"args_parsed": time.time()}
    use_compile_cache(train_args.compile_cache_dir)
    logging.basicConfig(level=logging.INFO if _rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    set_seed(train_args.seed)

    flex_packing = resolve_flex_packing(data_args.flex_packing)
    # Rank 0 first: it fills the (shared) HF_HOME cache from the hub, then the other ranks read it.
    with train_args.main_process_first(local=False, desc="loading data and model"):
        dataset = prepare_dataset(data_args)  # bad data fails here, before the model loads
        log.info("%d examples from %s; flex_packing=%s; bf16=%s", len(dataset), data_args.dataset_name,
                 flex_packing, train_args.bf16)
        tokenizer = load_tokenizer(model_args, train_args)
        timing["data_ready"] = time.time()
        model = load_model(model_args, train_args, flex_packing)
        timing["model_loaded"] = time.time()
    phases = PhaseTimingCallback()
    trainer = build_trainer(model, tokenizer, dataset, model_args, train_args, flex_packing,
                            [*make_callbacks(train_args.final_checkpoint), phases])
    timing["trainer_built"] = time.time()

    resume = train_args.resume_from_checkpoint or find_resume_checkpoint(train_args.output_dir)
    start_epoch, start_step = 0.0, 0
    if resume:
        saved = json.loads((Path(resume) / "trainer_state.json").read_text())
        start_epoch, start_step = saved.get("epoch") or 0.0, saved.get("global_step", 0)
        if trainer.is_world_process_zero():
            print(RESUME_PREFIX + json.dumps({"checkpoint": resume, "step": start_step}), flush=True)

    started = time.time()
    train_output = trainer.train(resume_from_checkpoint=resume)
    log.info("training took %.1f s", time.time() - started)

    timing["trained"] = time.time()
    trainer.save_model(train_args.output_dir)  # the adapters (and tokenizer), rank 0 writes
    timing["adapters_written"] = time.time()
    trainer.save_state()  # trainer_state.json in output_dir
    if not trainer.is_world_process_zero():
        return None
    metrics = collect_metrics(trainer, train_output, start_epoch, start_step, dataset_tokens(trainer.train_dataset))
    if phases.first_step_end is not None:
        timing["first_step_done"] = phases.first_step_end
    metrics["timing"] = dict(sorted(timing.items(), key=lambda kv: kv[1]))  # wall-clock (epoch) seconds
    metrics["checkpoints_saved"] = phases.checkpoints
    metrics["checkpoint_s"] = round(phases.checkpoint_s, 3)
    metrics["compiled_layers"] = getattr(trainer, "compiled_layers", None)
    metrics["compile_reason"] = getattr(trainer, "compile_reason", None)
    write_metrics(train_args.output_dir, metrics)
    write_completed(train_args.output_dir, metrics)
    return metrics


# ---------------------------------------------------------------- clean exit of every rank

class Terminated(SystemExit):
    """SIGTERM (scancel, a requeue, torchrun stopping the other ranks) as an exception, so the
    process group is torn down on the way out instead of dying with the interpreter."""


def _raise_on_sigterm(signum, _frame) -> None:
    raise Terminated(128 + signum)


def teardown_process_group(success: bool) -> None:
    """Destroy the default process group if one is alive.

    Left alive, gloo's background threads are killed at interpreter exit and a rank can abort with
    "terminate called without an active exception". On success every rank meets at a barrier
    first, so no rank closes its connections while another still uses them.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if success and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def cli(argv: list[str] | None = None) -> None:
    """Entry point: a bad data set is a one-line error and exit status 2, not a traceback; every
    exit (success, error, SIGTERM) destroys the process group first."""
    import signal

    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    success = False
    try:
        main(argv)
        success = True
    except DataError as e:
        print(f"training data error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        teardown_process_group(success)


if __name__ == "__main__":
    cli()
