"""Multi-GPU scaling of the project's recipe on one host: the same workload on 1, 2, 4 and 8 GPUs.

For each GPU count N this runs the project's recipe (training.train.build_trainer with the packed
fast path, as benchmarks/bench_train.py's "project" row: same model, same seeded synthetic
workload, same optimizer semantics) under the torchrun command line of jobs/finetune.sbatch.j2,
on one node:

    python -m torch.distributed.run --nnodes=1 --nproc_per_node=N --rdzv_backend=c10d \
        --rdzv_endpoint=127.0.0.1:PORT --rdzv_id=bench-scaling-N-PID --max_restarts=0 \
        -m benchmarks.bench_scaling --worker ...

Global batch: 16 examples per optimizer step whatever N (the single-GPU benchmark's workload and
learning-rate schedule: 125 steps for 2,000 examples), split across the ranks, 16/N each; the
Trainer's sampler gives rank r the r-th slice of each step's 16 examples. The loss is normalised
by the step's completion tokens over all ranks (average_tokens_across_devices), so the gradients
equal the one-GPU run's. DDP with ddp_find_unused_parameters=False; a step's packed micro-batches
run under no_sync except the last, so gradients are all-reduced once per optimizer step (one
all-reduce per DDP bucket).

Per N it records: tokens/s in all and per GPU (steady state, the first `--warmup-steps` optimizer
steps left out, as bench_train), scaling efficiency (tokens/s per GPU at N / tokens/s at 1 GPU of
the same run), the gradient all-reduces (calls, buckets, time from a bucket being ready to its
all-reduce being done, measured by a DDP comm hook: CUDA events on GPU, wall clock on CPU; that
time overlaps the backward pass, so it is an upper bound on what communication costs), the other
collectives per step, and NCCL's transport choice (NCCL_DEBUG=INFO in the child's environment,
parsed by ops/actions/nccl.py). No other NCCL variable is set: the machine's settings (NCCL_NVLS_ENABLE)
stay as they are.

    python -m benchmarks.bench_scaling                      # GPUs: 1,2,4,8 (capped by the GPUs seen)
        -> benchmarks/results/<date>-<gpu>-scaling.json
    python -m benchmarks.bench_scaling --device cpu --tiny --counts 1,2 --examples 160 --warmup-steps 2 \
        --record-examples
        # the same code path on CPU ranks (gloo): a code-path check, not a performance figure;
        # writes no file unless --output is given
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GLOBAL_EXAMPLES_PER_STEP = 16  # bench_train's 2 x 8: kept global, split across the ranks
DEFAULT_COUNTS = (1, 2, 4, 8)
# Python-level collectives counted per step (accelerate and the DDP hook call them by attribute).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
               "all_gather_object", "broadcast_object_list", "barrier")


# ---------------------------------------------------------------- worker (one rank)

def example_key(ids) -> str:
    """A short stable id of one example's token ids (the examples are random: ids are unique)."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def step_example_keys(inputs) -> list[str]:
    """The examples of one packed step (its micro-batches), in order. Reads tensors: a host sync on GPU."""
    keys = []
    for micro in inputs["micro_batches"]:
        n = int(micro["num_real_tokens"])
        ids = micro["input_ids"][0][:n].tolist()
        docs = micro["document_ids"][0][:n].tolist()
        start = 0
        for i in range(1, n + 1):
            if i == n or docs[i] != docs[start]:
                keys.append(example_key(ids[start:i]))
                start = i
    return keys


class CommProbe:
    """Counts and times DDP's gradient all-reduces (a comm hook around the default all-reduce) and counts
    the other collectives, per optimizer step. Installed on the first training_step, once the model is
    wrapped in DDP."""

    def __init__(self, trainer, record_examples: bool):
        self.trainer = trainer
        self.record_examples = record_examples
        self.buckets: list[dict] = []  # one per gradient all-reduce: step, index, numel, timing
        self.collectives: dict[int, Counter] = defaultdict(Counter)  # step -> name -> calls
        self.micro_batches: list[int] = []  # per optimizer step
        self.examples: list[list[str]] = []  # per optimizer step (record_examples)
        self.ddp = self.find_unused_parameters = None
        self.training = False
        self._patch_collectives()
        original = trainer.training_step

        def probed_step(model, inputs, num_items_in_batch=None):
            if self.ddp is None:
                self._install(model)
            self.micro_batches.append(len(inputs["micro_batches"]))
            if self.record_examples:
                self.examples.append(step_example_keys(inputs))
            return original(model, inputs, num_items_in_batch)

        trainer.training_step = probed_step

    def _step(self) -> int:
        # the optimizer step under way (0-based); after training (restore), the teardown's collectives
        return self.trainer.state.global_step if self.trainer is not None else -1

    def _patch_collectives(self):
        import torch.distributed as dist

        probe = self
        self._originals = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                if probe.training:
                    probe.collectives[probe._step()][_name] += 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)

    def restore(self):
        """Once training is over: put torch.distributed's own functions back and let go of the trainer.
        Both held the trainer, whose DDP holds the process group, where the garbage collector cannot free
        it (a module global; the comm hook, referenced from C++), keeping gloo's threads alive into exit."""
        import torch.distributed as dist

        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self.trainer = None

    def _install(self, model):
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = isinstance(model, DistributedDataParallel)
        self.find_unused_parameters = getattr(model, "find_unused_parameters", None)
        if not self.ddp:
            return
        cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
        probe = self

        def timed_allreduce(state, bucket):
            record = {"step": probe._step(), "index": bucket.index(), "numel": bucket.buffer().numel(),
                      "last": bucket.is_last()}
            if cuda:  # stream-ordered: from the bucket being ready on the compute stream to the all-reduce done
                record["start"] = torch.cuda.Event(enable_timing=True)
                record["start"].record()
            else:
                record["t0"] = time.perf_counter()
            probe.buckets.append(record)

            device = bucket.buffer().device

            def done(fut):
                if cuda:  # on the bucket's device, whatever thread runs the callback
                    with torch.cuda.device(device):
                        record["end"] = torch.cuda.Event(enable_timing=True)
                        record["end"].record()  # the callback's current stream waits for the all-reduce
                else:
                    record["t1"] = time.perf_counter()
                return fut.value()

            return default_hooks.allreduce_hook(state, bucket).then(done)

        model.register_comm_hook(None, timed_allreduce)

    def _others(self, step: int) -> Counter:
        counts = Counter(self.collectives.get(step, {}))
        counts["all_reduce"] -= sum(1 for r in self.buckets if r["step"] == step)
        return +counts  # drops the zero (and negative) entries

    def report(self, warmup: int, steps: int) -> dict:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for r in self.buckets:
            if "start" in r:
                start, end = r.pop("start"), r.pop("end", None)
                try:  # never lose a run's results to a timing read (not yet exercised on GPUs)
                    r["ms"] = start.elapsed_time(end) if end is not None else None
                except RuntimeError as e:
                    print(f"all-reduce timing unreadable: {e}", file=sys.stderr, flush=True)
                    r["ms"] = None
            else:
                r["ms"] = (r.pop("t1") - r.pop("t0")) * 1e3 if "t1" in r else None
        per_step = Counter(r["step"] for r in self.buckets)
        steady = [r["ms"] for r in self.buckets if r["step"] >= warmup and r["ms"] is not None]
        # The last bucket is reduced after the last gradient: nothing of the backward is left to hide it.
        steady_last = [r["ms"] for r in self.buckets if r["step"] >= warmup and r["last"] and r["ms"] is not None]
        steady_steps = max(steps - warmup, 0)
        hook_calls = len(self.buckets)
        other = Counter()
        for _step, counts in self.collectives.items():
            other.update(counts)
        other["all_reduce"] -= hook_calls  # the hook's own all-reduces are counted above
        return {
            "ddp": self.ddp,
            "find_unused_parameters": self.find_unused_parameters,
            "allreduce_calls": hook_calls,
            "allreduce_calls_by_step": [per_step.get(s, 0) for s in range(steps)],
            "buckets_by_step": [sorted(r["index"] for r in self.buckets if r["step"] == s) for s in range(steps)],
            "bucket_numel": sorted({(r["index"], r["numel"]) for r in self.buckets}),
            "allreduce_ms_steady": sum(steady),
            "allreduce_ms_per_step": sum(steady) / steady_steps if steady_steps else None,
            "allreduce_last_bucket_ms_per_step": sum(steady_last) / steady_steps if steady_steps else None,
            "other_collectives": {k: v for k, v in sorted(other.items()) if v},
            "other_collectives_by_step": [dict(self._others(s)) for s in range(steps)],
            "micro_batches_by_step": self.micro_batches,
            "examples_by_step": self.examples if self.record_examples else None,
        }


def worker(args) -> None:
    """One rank of the torchrun group: build the project's trainer on the benchmark workload and train."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from benchmarks import bench_train
    from training.args import ModelArguments, TrainConfig
    from training.fastpath import attention
    from training.train import build_trainer

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    per_rank = args.global_batch // world
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)  # make_model builds on the current device
    cfg = bench_train.TINY if args.tiny else bench_train.QWEN3_4B
    rows = workload(args, cfg)
    model = bench_train.make_model(cfg, args.device, attention.attention_implementation())
    train_args = TrainConfig(
        output_dir=os.path.join(args.out_dir, f"trainer-{rank}"), per_device_train_batch_size=per_rank,
        gradient_accumulation_steps=1, learning_rate=2e-4, num_train_epochs=1,
        max_steps=args.steps if args.steps > 0 else -1, logging_steps=args.logging_steps, save_strategy="no",
        report_to="none", max_length=1024, seed=42, activation_checkpointing="auto", completion_only_loss=True,
        use_cpu=args.device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False)
    if args.token_budget:
        train_args.token_budget = args.token_budget  # read by batches.make_collator: splits a step
    if args.bucket_cap_mb:
        train_args.ddp_bucket_cap_mb = args.bucket_cap_mb  # passed to DDP as is (a float is fine there)
    model_args = ModelArguments(model_name_or_path="synthetic-qwen3")
    if args.lora_dropout is not None:
        model_args.lora_dropout = args.lora_dropout
    trainer = build_trainer(model, bench_train.make_tokenizer(), Dataset.from_list(rows), model_args, train_args,
                            flex_packing=True)
    clock = token_clock(trainer, cfg, model_args.lora_r, args.warmup_steps)
    probe = CommProbe(trainer, args.record_examples)

    class Window(TrainerCallback):  # count collectives during training only
        def on_train_begin(self, *a, **kw):
            probe.training = True

        def on_train_end(self, *a, **kw):
            probe.training = False

    trainer.add_callback(Window())
    if args.profile and rank == 0 and args.device == "cuda":
        trainer.add_callback(bench_train.ProfileSteps(*(int(x) for x in args.profile.split(":"))))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        output = trainer.train()
    finally:
        probe.restore()
    end_t, end_tok, _, end_step, _ = clock.end
    row = {
        "rank": rank, "world_size": world, "examples_per_rank_step": trainer.args.per_device_train_batch_size,
        "gradient_accumulation": trainer.args.gradient_accumulation_steps,
        "distributed_type": str(trainer.accelerator.distributed_type), "backend": dist_backend(),
        "steps": end_step, "tokens": int(end_tok), "runtime_s": end_t - clock.start,
        "steady": None, "compiled_layers": getattr(trainer, "compiled_layers", 0),
        "train_loss": output.training_loss,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        **probe.report(clock.warmup if clock.mark else 0, end_step),
    }
    if clock.mark and end_step > clock.mark[3]:
        t0, tok0, _, s0, _ = clock.mark
        row["steady"] = {"steps": end_step - s0, "tokens": int(end_tok - tok0), "time_s": end_t - t0}
    if args.record_examples:
        # lora_B starts at zero: what it holds after training comes from the (all-reduced) gradients
        row["lora_B_abs_sum"] = float(sum(p.detach().double().abs().sum() for n, p in trainer.model.named_parameters()
                                          if "lora_B" in n))
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(row))


def token_clock(trainer, cfg: dict, lora_r: int, warmup: int):
    """bench_train's StepClock (sync at the end of the warmup step and of training), counting this rank's
    tokens from the batch's plain-int example lengths only: its FLOP accounting reads the labels, a host
    sync every step on a GPU, and this benchmark reports no MFU."""
    from benchmarks import bench_train

    class TokenClock(bench_train.StepClock):
        def account(self, inputs):
            self.tokens += sum(inputs["example_lengths"])

    return TokenClock(trainer, bench_train.model_counts(cfg, lora_r=lora_r), warmup)


def dist_backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def workload(args, cfg: dict) -> list[dict]:
    """bench_train's workload (same generator and parameters as its main())."""
    from benchmarks import bench_train

    n = args.examples or (64 if args.tiny else 2000)
    return bench_train.make_workload(n, cfg["vocab_size"], seed=0, max_length=256 if args.tiny else 1024,
                                     prompt_median=15 if args.tiny else 60, response_median=30 if args.tiny else 150)


# ---------------------------------------------------------------- launcher (parent)

def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, port: int, worker_args: list[str]) -> list[str]:
    """jobs/finetune.sbatch.j2's torchrun line for one node, rendezvous and store on loopback."""
    return [sys.executable, "-m", "torch.distributed.run", "--local_addr=127.0.0.1",
            "--nnodes=1", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=bench-scaling-{nproc}-{os.getpid()}", "--max_restarts=0",
            "-m", "benchmarks.bench_scaling", "--worker", *worker_args]


def run_count(nproc: int, args, worker_args: list[str], tmp: Path) -> dict:
    """Launch N ranks, wait, and fold the ranks' reports into one row."""
    from ops.actions import nccl

    out_dir = tmp / f"gpus-{nproc}"
    out_dir.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("NCCL_DEBUG", "INFO")  # for the transport picture; no other NCCL setting is touched
    cmd = torchrun_command(nproc, free_port(), [*worker_args, "--out-dir", str(out_dir)])
    print("$ " + " ".join(cmd), flush=True)
    started = time.time()
    log_path = out_dir / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=args.timeout)
            hung = False
        except subprocess.TimeoutExpired:
            # Ranks stuck in a collective (e.g. unequal all-reduce counts). torchrun ends its workers on
            # TERM; killing torchrun alone would leave them running (each is in its own process group).
            hung = True
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        (args.log_dir / f"torchrun-{nproc}.log").write_text(text)
    if hung or proc.returncode != 0:
        why = f"did not finish within --timeout {args.timeout:g} s" if hung else f"failed (exit {proc.returncode})"
        raise SystemExit(f"torchrun with {nproc} process(es) {why}; log tail:\n"
                         + "\n".join(text.splitlines()[-40:]))
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    picture = nccl.parse(text.splitlines())
    return fold(nproc, ranks, picture, time.time() - started)


def fold(nproc: int, ranks: list[dict], picture, wall_s: float) -> dict:
    """One row per GPU count from its ranks' reports: totals over ranks, time of the slowest rank."""
    r0 = ranks[0]
    row = {"gpus": nproc, "world_size": r0["world_size"], "distributed_type": r0["distributed_type"],
           "backend": r0["backend"], "ddp": r0["ddp"], "find_unused_parameters": r0["find_unused_parameters"],
           "examples_per_step": sum(r["examples_per_rank_step"] for r in ranks),
           "examples_per_rank_step": r0["examples_per_rank_step"],
           "gradient_accumulation": r0["gradient_accumulation"], "steps": r0["steps"],
           "compiled_layers": r0["compiled_layers"],
           "tokens": sum(r["tokens"] for r in ranks),
           "train_runtime_s": max(r["runtime_s"] for r in ranks)}
    row["tokens_per_s_incl_warmup"] = row["tokens"] / row["train_runtime_s"]
    if all(r["steady"] for r in ranks):
        steady_time = max(r["steady"]["time_s"] for r in ranks)
        row.update(warmup_steps_excluded=r0["steps"] - r0["steady"]["steps"], steady_time_s=steady_time,
                   tokens_per_s=sum(r["steady"]["tokens"] for r in ranks) / steady_time)
    else:  # fewer steps than --warmup-steps: the rate includes the first steps (compile, first buckets)
        row.update(warmup_steps_excluded=0, steady_time_s=row["train_runtime_s"],
                   tokens_per_s=row["tokens_per_s_incl_warmup"], note="no step after the warmup: rates include it")
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / nproc
    steady_steps = row["steps"] - row["warmup_steps_excluded"]
    ms = [r["allreduce_ms_per_step"] for r in ranks if r["allreduce_ms_per_step"] is not None]
    row.update(
        allreduce_calls=r0["allreduce_calls"],
        allreduce_calls_per_rank=[r["allreduce_calls"] for r in ranks],
        # DDP re-buckets after its first step (by the order gradients became ready): the last step's count
        allreduce_buckets=len(r0["buckets_by_step"][-1]) if r0["buckets_by_step"] else 0,
        allreduce_calls_by_step=r0["allreduce_calls_by_step"],
        buckets_by_step=r0["buckets_by_step"],
        bucket_numel=r0["bucket_numel"],
        allreduce_ms_per_step=max(ms) if ms else None,
        allreduce_last_bucket_ms_per_step=max((r["allreduce_last_bucket_ms_per_step"] for r in ranks
                                               if r["allreduce_last_bucket_ms_per_step"] is not None), default=None),
        step_ms=row["steady_time_s"] / steady_steps * 1e3 if steady_steps else None,
        other_collectives=r0["other_collectives"],
        other_collectives_by_step=r0["other_collectives_by_step"],
        micro_batches_by_step=[r["micro_batches_by_step"] for r in ranks],
        nccl_transport=picture.describe(), nccl_links=dict(picture.intra | picture.inter),
        nccl_info_lines=picture.lines,
        final_loss=r0["losses"][-1] if r0["losses"] else None, losses=r0["losses"], grad_norms=r0["grad_norms"],
        train_loss=r0["train_loss"],
        peak_mem_gib=max((r["peak_mem_gib"] for r in ranks if r["peak_mem_gib"] is not None), default=None),
        wall_s=round(wall_s, 1))
    if row["allreduce_ms_per_step"] is not None and row["step_ms"]:
        row["allreduce_fraction_of_step"] = row["allreduce_ms_per_step"] / row["step_ms"]
    if r0.get("examples_by_step") is not None:
        row["examples_by_rank_step"] = [r["examples_by_step"] for r in ranks]
        row["lora_B_abs_sum"] = [r["lora_B_abs_sum"] for r in ranks]
    return row


def parse_counts(text: str, available: int | None, global_batch: int = GLOBAL_EXAMPLES_PER_STEP) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--counts {text!r}: give comma-separated process counts, e.g. --counts 1,2,4,8") from None
    bad = [n for n in counts if n < 1 or global_batch % n]
    if not counts or bad:
        raise SystemExit(f"--counts {text!r}: each count must divide the {global_batch} examples per optimizer "
                         "step (--global-batch)")
    if available is not None:
        dropped = [n for n in counts if n > available]
        if dropped:
            print(f"only {available} GPU(s) visible: skipping counts {dropped}", flush=True)
        counts = [n for n in counts if n <= available]
        if not counts:
            raise SystemExit(f"--counts {text!r}: none fits the {available} GPU(s) visible")
    return counts


def main(argv: list[str] | None = None) -> dict | None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 and a short workload (CPU check)")
    parser.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)),
                        help="process (GPU) counts, comma-separated; capped by the GPUs visible")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_EXAMPLES_PER_STEP,
                        help="examples per optimizer step over all ranks (default 16: bench_train's workload; "
                             "another value changes the optimizer semantics)")
    parser.add_argument("--examples", type=int, default=None, help="workload size (default 2000; tiny: 64)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = one epoch)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the steady rates")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--token-budget", type=int, default=None,
                        help="split each rank's packed row into micro-batches of at most this many tokens")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP bucket size (default: DDP's 25 MB); small values give several buckets")
    parser.add_argument("--lora-dropout", type=float, default=None, help="default: the training default (0.05)")
    parser.add_argument("--record-examples", action="store_true",
                        help="record each rank's examples per step (reads the batch: a host sync; checks only)")
    parser.add_argument("--profile", default=None, help="FIRST:LAST optimizer steps to profile on rank 0 (GPU)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per GPU count")
    parser.add_argument("--output", type=Path, default=None,
                        help="results file (default on GPU: benchmarks/results/<date>-<gpu>-scaling.json; "
                             "on CPU: none)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each count's torchrun log here")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible (use --device cpu --tiny)")
    if args.worker:
        from training.train import teardown_process_group

        success = False
        try:
            worker(args)  # returns first: its trainer is unreferenced (cycles only) when teardown collects
            success = True
        finally:
            teardown_process_group(success)  # else gloo's threads can abort the rank at exit (as in train.cli)
        return None

    if args.global_batch < 1:
        parser.error("--global-batch must be at least 1")
    counts = parse_counts(args.counts, torch.cuda.device_count() if args.device == "cuda" else None,
                          args.global_batch)
    worker_args = ["--device", args.device, "--global-batch", str(args.global_batch), "--steps", str(args.steps),
                   "--warmup-steps", str(args.warmup_steps), "--logging-steps", str(args.logging_steps)]
    for flag, value in (("--examples", args.examples), ("--token-budget", args.token_budget),
                        ("--bucket-cap-mb", args.bucket_cap_mb),
                        ("--lora-dropout", args.lora_dropout), ("--profile", args.profile)):
        if value is not None:
            worker_args += [flag, str(value)]
    worker_args += ["--tiny"] * args.tiny + ["--record-examples"] * args.record_examples

    from benchmarks import bench_train

    cfg = bench_train.TINY if args.tiny else bench_train.QWEN3_4B
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    import peft
    import transformers  # noqa: E401
    import trl
    results = {"date": dt.date.today().isoformat(), "gpu": gpu, "device": args.device,
               "kind": "performance" if args.device == "cuda" else "cpu code-path check (not a performance figure)",
               "torch": torch.__version__, "versions": {"transformers": transformers.__version__,
                                                        "trl": trl.__version__, "peft": peft.__version__},
               "model": "tiny-qwen3" if args.tiny else "Qwen3-4B architecture, random weights",
               "workload": bench_train.workload_stats(workload(args, cfg)),
               "global_examples_per_step": args.global_batch,
               "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
               "command": "python -m benchmarks.bench_scaling " + " ".join(argv if argv is not None else sys.argv[1:]),
               "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            row = {"gpu": gpu, **run_count(n, args, worker_args, Path(tmp))}
            results["rows"].append(row)
            print("BENCH " + json.dumps({k: v for k, v in row.items() if k not in ("examples_by_rank_step",
                                                                                     "buckets_by_step")}), flush=True)
    base = next((r for r in results["rows"] if r["gpus"] == 1), None)
    for r in results["rows"]:
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s"] if base else None
    label = "CPU ranks (code path only)" if args.device == "cpu" else gpu
    print(f"{'N':>3} {'tok/s':>10} {'tok/s/GPU':>10} {'eff':>6} {'step ms':>8} {'allreduce ms/step':>17} "
          f"{'calls/step':>10}  transport   [{label}]")
    for r in results["rows"]:
        eff = f"{r['scaling_efficiency']:.2f}" if r["scaling_efficiency"] is not None else "-"
        ar = f"{r['allreduce_ms_per_step']:.1f}" if r["allreduce_ms_per_step"] is not None else "-"
        calls = r["allreduce_calls"] / r["steps"] if r["steps"] else 0
        print(f"{r['gpus']:>3} {r['tokens_per_s']:10.0f} {r['tokens_per_s_per_gpu']:10.0f} {eff:>6} "
              f"{r['step_ms']:8.1f} {ar:>17} {calls:10.1f}  {r['nccl_transport']}")
    path = args.output
    from benchmarks import bench_train

    if path is None and args.device == "cuda" and not args.no_write:
        slug = bench_train.gpu_slug(gpu, args.tiny)
        path = REPO / "benchmarks" / "results" / f"{results['date']}-{slug}-scaling.json"
    if path and not args.no_write:
        bench_train.write_results(results, path)
    return results


if __name__ == "__main__":
    main()
