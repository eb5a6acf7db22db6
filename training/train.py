"""LoRA fine-tune of a causal LM with TRL's SFTTrainer, on one process or many (torchrun).

Parse the settings (training/args.py: dataclasses, a YAML config, flags), load and check the data, load the
model, build the trainer, train, save. Defaults are the baseline recipe (Qwen/Qwen3-4B on the first 2,000 rows
of tatsu-lab/alpaca, LoRA r16 on q/k/v/o, lr 2e-4, one epoch, batch 2 x 8, max length 1024, bf16). Launched by
jobs/finetune.sbatch.j2 on every node, from the job directory (so `training` imports as a package):

    python -m torch.distributed.run --nnodes=$SLURM_JOB_NUM_NODES --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=$SLURM_JOB_ID \
        -m training.train --config training/configs/qwen3-4b-lora.yaml --output_dir /scratch/lora-out

One process on a laptop: `python -m training.train --config training/configs/local-tiny.yaml
--model_name_or_path DIR/model --dataset_name DIR/data/train.jsonl --output_dir out`.

Two paths, chosen once (`flex_packing`, training_path below): TRL's padded batches (training/padded.py) or
the packed GPU fast path (training/fastpath/). Each choice a path makes for the run is the config's word or,
where the config says `auto`, the path's; rank 0 logs them as one block at the start and metrics.json keeps
them (`choices`). Output in `output_dir`: the adapters, trainer_state.json, metrics.json (docs/ARCHITECTURE.md,
"Training contract") and the COMPLETED marker; rank 0 prints `SLURM_GPU_LOG {json}` per logged step and
`SLURM_GPU_METRICS {json}` at the end. Local data files are validated before the model loads; a checkpoint
every `save_steps` and an automatic resume from the last complete one (Slurm requeue); fp32 and gloo on
machines without a GPU.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from training import cost_cap, interrupts, protocol, sharding, tensorboard_events
from training import samples as sample_answers
from training.args import DataArguments, ModelArguments, TrainConfig, gpu_available, parse_args
from training.callbacks import FAULT_RANK_ENV, FAULT_STEP_ENV, LOG_PREFIX, PhaseTimingCallback, make_callbacks
from training.chat import prepare_dataset as format_rows
from training.checkpoints import with_background_checkpoints
from training.choices import switch
from training.data import DataError, load_rows
from training.evaluate import EvalEveryCallback, base_model, evaluate, log_eval, split_eval
from training.interrupts import CheckpointOnSignal, mark_interrupted
from training.outputs import (
    COMPLETED_MARKER,
    METRICS_PREFIX,
    collect_metrics,
    dataset_tokens,
    find_resume_checkpoint,
    write_completed,
    write_metrics,
)
from training.phases import RankPhases, process_start
from training.watchdog import HangWatchdog

# Names other modules and tests read from here.
__all__ = ["COMPLETED_MARKER", "FAULT_RANK_ENV", "FAULT_STEP_ENV", "LOG_PREFIX", "METRICS_PREFIX", "cli", "main"]

log = logging.getLogger("training.train")

RESUME_PREFIX = protocol.prefix(protocol.RESUMED)
_RUNS = 0  # main() calls in this process


def training_path(flex_packing: bool):
    """THE branch between the two paths: the module that gives the attention, trainer class and collator."""
    if flex_packing:  # ---- the packed GPU fast path: training/fastpath/
        from training.fastpath import entry
        return entry
    from training import padded  # ---- TRL's padded batches
    return padded


def resolve_flex_packing(setting: bool | None, gpu: bool | None = None) -> bool:
    """Whether to use the packed fast path: the config's `flex_packing` (None = auto: with a GPU)."""
    if setting is None:
        return gpu_available() if gpu is None else gpu
    return setting


def prepare_dataset(data_args: DataArguments, tokenizer=None, max_length: int | None = None,
                    reports: dict | None = None, rows=None):
    """Load and validate the rows (before any model is loaded, so bad data fails in seconds), then format them
    (training/chat.py). `reports` (when given) gets their Report (format, template, rows left out or
    truncated) as "train". `rows`: already loaded ones."""
    rows = rows if rows is not None else load_rows(data_args.dataset_name, split=data_args.dataset_train_split,
                     config=data_args.dataset_config, n_examples=data_args.n_examples or None)
    dataset, report = format_rows(rows, tokenizer, max_length, data_args.long_rows)
    if reports is not None:
        reports["train"] = report
    return dataset


def prepare_datasets(data_args: DataArguments, seed: int, tokenizer=None, max_length: int | None = None,
                     reports: dict | None = None, rows=None):
    """(training rows, held-out rows or None): eval_split's rows held out, or eval_dataset_name's file.
    `reports` (when given) gets each file's Report: "train" and "eval"."""
    dataset = prepare_dataset(data_args, tokenizer, max_length, reports, rows)
    separate = None
    if data_args.eval_dataset_name:
        separate, eval_report = format_rows(load_rows(data_args.eval_dataset_name, split="train"), tokenizer,
                                            max_length, data_args.long_rows)
        if reports is not None:
            reports["eval"] = eval_report
    return split_eval(dataset, data_args.eval_split, seed, separate)


def load_tokenizer(model_args: ModelArguments, train_args: TrainConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              trust_remote_code=train_args.trust_remote_code)
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
    # Straight onto this rank's GPU: no staging copy of the weights in host memory. Sharded, the whole model would
    # not fit one GPU: it loads into host memory and each FSDP2 unit moves to the GPU as it is sharded
    # (training/sharding.py).
    on_gpu = gpu_available() and not getattr(train_args, "sharded", False)
    device_map = {"": torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))} if on_gpu else None
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision,
        trust_remote_code=train_args.trust_remote_code,
        attn_implementation=training_path(flex_packing).attention_implementation(model_args, train_args),
        dtype=dtype if dtype == "auto" else getattr(torch, dtype), device_map=device_map)


def use_compile_cache(directory: str | None) -> None:
    """Point Inductor's and Triton's caches at `directory` (shared storage: the compiled blocks of one
    job serve every later job and node), unless the environment already names them."""
    if not directory:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", directory)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton"))


def decide_sharding(data_args: DataArguments, model_args: ModelArguments, train_args: TrainConfig) -> dict:
    """Whether this run shards the base (training/sharding.py): {"value", "by"}. Decided before the model loads,
    from its config.json, the settings, the world size and this GPU's memory; the same function as the fit check
    before launch (training/memory_model.py `run_plan`). A sharded run turns off what cannot run sharded, and
    says why in its choices."""
    from transformers import AutoConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = gpu_available()
    usable = None
    if gpu:
        import torch

        usable = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    setting = sharding.setting_reader(train_args, model_args, data_args)
    config = {}
    if str(train_args.sharding) == "auto" and gpu:  # config.json alone, no weights
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                            trust_remote_code=train_args.trust_remote_code).to_dict()
    shard, why = sharding.decide(setting, config, world, gpu, usable)
    train_args.sharded = shard
    choice = {"sharding": {"value": f"fsdp {world}-way" if shard else "none", "by": why}}
    if shard:  # what the fast path cannot do sharded falls back, and says why
        fallback = "off: sharded (FSDP2) runs "
        if train_args.compile_layers != "false":
            train_args.compile_layers = "false"
            choice["compile_layers"] = {"value": False, "by": fallback + "eager blocks"}
        if train_args.cuda_graphs != "false":
            train_args.cuda_graphs = "false"
            choice["cuda_graphs"] = {"value": False, "by": fallback + "no CUDA graphs"}
        if train_args.background_checkpoints:
            train_args.background_checkpoints = False
            choice["background_checkpoints"] = {
                "value": False, "by": fallback + "write checkpoints on the training thread (every rank its shard)"}
        if data_args.samples:
            data_args.samples = 0
            choice["samples"] = {"value": 0, "by": fallback + "answer no samples (one rank cannot "
                                                           "generate alone from a sharded model)"}
    return choice


def build_trainer(model, tokenizer, dataset, model_args: ModelArguments, train_args: TrainConfig,
                  flex_packing: bool = False, callbacks: list[TrainerCallback] | None = None, eval_dataset=None):
    from trl import get_peft_config

    path = training_path(flex_packing)
    sharded = bool(getattr(train_args, "sharded", False))
    trainer_class = with_background_checkpoints(path.trainer_class())
    if sharded:
        trainer_class = sharding.sharded_trainer(trainer_class)
    trainer = trainer_class(
        model=model, args=train_args, train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
        data_collator=path.make_collator(tokenizer, train_args), peft_config=get_peft_config(model_args),
        callbacks=callbacks)
    trainer.sharded = sharded
    if sharded:
        sharding.shard(trainer.model, train_args.world_size)
        if gpu_available() and hasattr(trainer, "_set_token_budget"):
            trainer._set_token_budget()  # the packed path's budget again, from the memory left beside the shards
    if not trainer.completion_only_loss:
        raise ValueError("completion_only_loss is off: the loss would cover the prompt; leave it unset or true")
    trainer.choices = {"path": {"value": path.NAME, "by": "config" if switch(getattr(
        train_args, "flex_packing_setting", "auto")) is not None else "auto"}, **run_choices(trainer)}
    if "assistant_masks" in dataset.column_names:  # chat rows: the labels come from the assistant masks
        labels = trainer.train_dataset[0]["labels"]
        if all(y != -100 for y in labels):
            raise ValueError("the chat rows' labels cover every token: the loss would include the user's turns")
    return trainer


def run_choices(trainer) -> dict[str, dict]:
    """The run's choices (value, who decided): the fast path's own, or the config's on the padded path."""
    args = trainer.args
    choices = dict(getattr(trainer, "choices", None) or {
        "examples_per_micro_batch": {"value": args.per_device_train_batch_size, "by": "config"},
        "gradient_accumulation_steps": {"value": args.gradient_accumulation_steps, "by": "config"},
        "activation_checkpointing": {"value": bool(args.activation_checkpointing), "by": "config" if getattr(
            args, "activation_checkpointing_setting", "auto") != "auto" else "auto: on for padded batches"},
        "attention": {"value": trainer.model.config._attn_implementation, "by": "config or the model's default"}})
    choices["background_checkpoints"] = {"value": bool(getattr(args, "background_checkpoints", True)), "by": "config"}
    return choices


def log_choices(choices: dict[str, dict]) -> None:
    width = max(map(len, choices))
    lines = [f"  {name:<{width}}  {c['value']!s:<14} {c['by']}" for name, c in choices.items()]
    log.info("run choices (value, who decided):\n%s", "\n".join(lines))


def main(argv: list[str] | None = None) -> dict | None:
    """Train; return the metrics on rank 0 (None on other ranks)."""
    from transformers import set_seed

    global _RUNS
    phases = RankPhases()
    if not _RUNS:  # the interpreter's start and the imports (a second run in one process has none)
        phases.add("imports", process_start(), time.time())
    _RUNS += 1
    data_args, model_args, train_args = parse_args(argv)
    train_args.flex_packing_setting = data_args.flex_packing
    timing = {"args_parsed": time.time()}
    use_compile_cache(train_args.compile_cache_dir)
    logging.basicConfig(level=logging.INFO if phases.rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    set_seed(train_args.seed)

    flex_packing = resolve_flex_packing(switch(data_args.flex_packing))
    sharding_choice = decide_sharding(data_args, model_args, train_args)  # before the model loads
    # Rank 0 first: it fills the (shared) HF_HOME cache from the hub, then the other ranks read it.
    with train_args.main_process_first(local=False, desc="loading data and model"):
        with phases.phase("data"):
            rows = load_rows(data_args.dataset_name, split=data_args.dataset_train_split,  # bad data fails here,
                             config=data_args.dataset_config, n_examples=data_args.n_examples or None)  # first
            tokenizer = load_tokenizer(model_args, train_args)
            reports: dict = {}
            dataset, eval_rows = prepare_datasets(data_args, train_args.seed, tokenizer, train_args.max_length,
                                                  reports, rows)
            prompts = sample_answers.sample_prompts(data_args.samples, data_args.samples_file, eval_rows)
        if phases.rank == 0:  # the format, the template and the rows left out: printed, and kept in metrics.json
            print(reports["train"].line(), flush=True)
        log.info("%d examples from %s; %s", len(dataset), data_args.dataset_name,
                 f"{len(eval_rows)} held out for evaluation" if eval_rows is not None else "no evaluation")
        timing["data_ready"] = time.time()
        with phases.phase("model_load"):
            model = load_model(model_args, train_args, flex_packing)
        timing["model_loaded"] = time.time()
    clock = PhaseTimingCallback(phases)
    on_signal = CheckpointOnSignal()  # the spot watcher's "checkpoint now" (training/interrupts.py)
    every = EvalEveryCallback(train_args.eval_every_steps if eval_rows is not None else 0)
    cap = cost_cap.make(train_args)  # None without --max-cost
    if tensorboard_events.enabled(train_args):
        tensorboard_events.use_log_dir(train_args)
    # Last: it reads whether a step saves or evaluates from what the callbacks before it decided.
    hangs = HangWatchdog(train_args.output_dir, train_args.hang_timeout_factor, train_args.hang_timeout_floor_s,
                         train_args.hang_first_step_s)
    with phases.phase("trainer"):
        trainer = build_trainer(model, tokenizer, dataset, model_args, train_args, flex_packing,
                                [*make_callbacks(train_args.final_checkpoint), clock, every, on_signal,
                                 *([cap] if cap else []), hangs], eval_rows)
    every.trainer = trainer
    trainer.choices.update(sharding_choice)
    report = reports["train"]
    trainer.choices["data_format"] = {"value": report.format, "by": "auto: the data's columns"}
    if report.template:
        trainer.choices["chat_template"] = {"value": report.template["sha256"][:12], "by": report.template["how"]}
    timing["trainer_built"] = time.time()
    if trainer.is_world_process_zero():
        log_choices(trainer.choices)
    evaluation, answers = {}, {}
    if eval_rows is not None:
        with phases.phase("eval_base"), base_model(trainer.model):  # before the first step, adapters off
            evaluation["base"] = evaluate(trainer)
    sample_s = data_args.sample_max_time_s / 2  # half for the base's answers, half for the tuned's
    if prompts and trainer.is_world_process_zero():
        with phases.phase("samples_base"):
            answers["base"] = sample_answers.answer_base(trainer, tokenizer, prompts,
                                                         data_args.sample_max_new_tokens, sample_s)

    resume = train_args.resume_from_checkpoint or find_resume_checkpoint(train_args.output_dir)
    start_epoch, start_step = 0.0, 0
    if resume:
        saved = json.loads((Path(resume) / "trainer_state.json").read_text())
        start_epoch, start_step = saved.get("epoch") or 0.0, saved.get("global_step", 0)
        if trainer.is_world_process_zero():
            print(RESUME_PREFIX + json.dumps({"checkpoint": resume, "step": start_step}), flush=True)

    if cap:  # the evaluation and samples after training take about as long as those before it
        cap.tail_s = time.time() - timing["trainer_built"]
    try:
        train_output = trainer.train(resume_from_checkpoint=resume)
    finally:
        hangs.close()  # also when training raised: no watcher outlives it (training/watchdog.py)
    timing["trained"] = time.time()
    if on_signal.stopped_at is not None:  # every rank agreed: the checkpoint is complete, the job requeues
        if trainer.is_world_process_zero():
            mark_interrupted(train_args.output_dir, on_signal.stopped_at)
        return None
    if eval_rows is not None:
        with phases.phase("eval"):
            evaluation["tuned"] = evaluate(trainer)
        if trainer.is_world_process_zero():
            log_eval(trainer, evaluation["tuned"])
    if prompts and trainer.is_world_process_zero():
        with phases.phase("samples"):
            answers["tuned"] = sample_answers.answer(trainer, tokenizer, prompts,
                                                     data_args.sample_max_new_tokens, sample_s)
    with phases.phase("save"):
        trainer.save_model(train_args.output_dir)  # the adapters (and tokenizer), rank 0 writes
        timing["adapters_written"] = time.time()
        trainer.save_state()  # trainer_state.json in output_dir
    for item in phases.items:
        if item["name"] == "first_step":
            item["compiled"] = bool(getattr(trainer, "compiled_layers", 0))
    ranks = phases.gather()  # a collective: every rank, before rank 0 goes on alone
    if not trainer.is_world_process_zero():
        return None
    metrics = collect_metrics(trainer, train_output, start_epoch, start_step, dataset_tokens(trainer.train_dataset))
    if clock.first_step_end is not None:
        timing["first_step_done"] = clock.first_step_end
    metrics["timing"] = dict(sorted(timing.items(), key=lambda kv: kv[1]))  # rank 0's wall clock (epoch s)
    metrics["phases"] = ranks
    metrics["checkpoints_saved"] = clock.checkpoints
    metrics["checkpoint_s"] = round(clock.checkpoint_s, 3)
    metrics["compiled_layers"] = getattr(trainer, "compiled_layers", None)
    metrics["compile_reason"] = getattr(trainer, "compile_reason", None)
    metrics["choices"] = trainer.choices
    metrics["train_rows"] = len(dataset)
    metrics["data"] = {name: report.as_dict() for name, report in reports.items()}
    if cap:
        metrics.update(cap.report())
    if evaluation:
        source = data_args.eval_dataset_name or f"{len(eval_rows)} rows held out of the training rows"
        metrics["eval"] = {**evaluation, "rows": len(eval_rows), "source": source,
                           "history": [h for h in trainer.state.log_history if "eval_loss" in h]}
    if answers:
        metrics["samples"] = [{**p, "base": b, "tuned": t}
                              for p, b, t in zip(prompts, answers["base"], answers["tuned"], strict=True)]
        sample_answers.write(train_args.output_dir, metrics["samples"])
    if tensorboard_events.enabled(train_args):
        tensorboard_events.write_run_scalars(os.environ["TENSORBOARD_LOGGING_DIR"], metrics)
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
        # Destroying only unregisters the groups: gloo's threads (pt_gloo_runloop) end when the last
        # reference goes, and the Trainer (its DDP reducer, the callbacks' group) sits in reference
        # cycles. Collected here, on the main thread, not during interpreter exit, where a gloo thread
        # that needs the GIL aborts the rank (pytorch/pytorch#179291).
        gc.collect()


def cli(argv: list[str] | None = None) -> None:
    """Entry point: a bad data set is a one-line error and exit status 2, not a traceback; every
    exit (success, error, SIGTERM) destroys the process group first."""
    import signal

    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    interrupts.install()  # a spot notice during data and model loading is kept for the first step
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
