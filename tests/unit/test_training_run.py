"""training/train.py for real on CPU with the tiny Qwen3: masking, a run, resume, 2 gloo ranks, a dying rank."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from training import train
from training.make_tiny import make_tiny

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "training" / "configs" / "local-tiny.yaml"
N_EXAMPLES = 96  # 24 optimizer steps at batch 4 on one process, 12 on two
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model_dir, data_file = make_tiny(root, examples=N_EXAMPLES, seed=0)
    return model_dir, data_file


def argv_for(tiny, out, *extra):
    """The tests' run: every row trains (no held-out rows: the steps and the reference numbers count them
    all); a test that evaluates passes its own --eval_split, which wins."""
    model_dir, data_file = tiny
    return ["--config", str(CONFIG), "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file),
            "--output_dir", str(out), "--save_steps", "5", "--eval_split", "0", *extra]


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """One uninterrupted single-process run; several tests read its output."""
    out = tmp_path_factory.mktemp("full")
    metrics = train.main(argv_for(tiny, out))
    return out, metrics


def test_collator_masks_the_prompt(tiny, tmp_path):
    from training.args import parse_args

    data_args, model_args, train_args = parse_args(argv_for(tiny, tmp_path / "out"))
    dataset = train.prepare_dataset(data_args)
    tokenizer = train.load_tokenizer(model_args, train_args)
    model = train.load_model(model_args, train_args, flex_packing=False)
    trainer = train.build_trainer(model, tokenizer, dataset, model_args, train_args)

    rows = [dataset[i] for i in range(4)]
    with_input = next(i for i, r in enumerate(rows) if "### Input:" in r["prompt"])
    # The trainer's own prepared rows (file order: the sampler shuffles later) through its own collator.
    assert len(trainer.train_dataset) == len(dataset)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    for i, row in enumerate(rows):
        prompt_len = len(tokenizer(row["prompt"])["input_ids"])
        labels = batch["labels"][i]
        ids = batch["input_ids"][i][batch["attention_mask"][i] == 1]
        assert (labels[:prompt_len] == -100).all(), "prompt tokens must not carry loss"
        trained = labels[labels != -100]
        assert tokenizer.decode(trained) == row["completion"] + tokenizer.eos_token
        assert tokenizer.decode(ids) == row["prompt"] + row["completion"] + tokenizer.eos_token
    assert "### Input:" in tokenizer.decode(batch["input_ids"][with_input])
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all(), "padding must not carry loss"


def test_training_run_loss_falls_and_writes_outputs(full_run, tiny):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, metrics = full_run
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert metrics["world_size"] == 1 and metrics["train_steps"] == N_EXAMPLES // 4
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert len(losses) == metrics["train_steps"]  # logged every step
    assert metrics["first_loss"] == losses[0] and metrics["last_loss"] == losses[-1]
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses
    assert 0 <= metrics["mean_token_accuracy"] <= 1
    assert metrics["train_tokens"] > 0 and metrics["tokens_per_s"] > 0 and metrics["train_runtime"] > 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == metrics["train_steps"]
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    assert any(p.name.startswith("checkpoint-") for p in out.iterdir())
    # The completion marker a requeued job checks: the final metrics, written after everything else.
    marker = out / train.COMPLETED_MARKER
    assert json.loads(marker.read_text()) == {k: v for k, v in on_disk.items() if k not in ("log_history", "phases")}
    for name in ("adapter_model.safetensors", "trainer_state.json", "metrics.json"):
        assert marker.stat().st_mtime_ns >= (out / name).stat().st_mtime_ns, name

    model_dir, _ = tiny
    tok = AutoTokenizer.from_pretrained(model_dir)
    inputs = tok("### Instruction:\nWhat is the capital of Peru?\n\n### Response:\n", return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        before = base(**inputs).logits
        tuned = PeftModel.from_pretrained(base, out)
        after = tuned(**inputs).logits
    assert (after - before).abs().max() > 1e-2


def test_timing_marks_the_phases_in_order(full_run):
    """metrics.json's timing (what time to adapters is split into): each phase's wall clock, in run order,
    the first step's end inside training, and the checkpoints' share of it (one every save_steps=5)."""
    _, metrics = full_run
    timing = metrics["timing"]
    order = ["args_parsed", "data_ready", "model_loaded", "trainer_built", "first_step_done", "trained",
             "adapters_written"]
    assert list(timing) == order
    assert all(timing[a] <= timing[b] for a, b in zip(order, order[1:], strict=False)), timing
    assert metrics["checkpoints_saved"] == metrics["train_steps"] // 5 == 4
    assert 0 < metrics["checkpoint_s"] < timing["trained"] - timing["first_step_done"]


def assert_rank_phases(record: dict, rank: int, checkpoints: int) -> None:
    """One rank's phases (docs/ARCHITECTURE.md, Training contract): in run order, each ending before the next
    starts (the checkpoints inside `steps`), first_step saying whether it compiled."""
    assert record["rank"] == rank and record["host"]
    phases = record["phases"]
    main = [p for p in phases if p["name"] != "checkpoint"]
    names = [p["name"] for p in main]
    assert names[-6:] == ["data", "model_load", "trainer", "first_step", "steps", "save"], names
    assert names[:-6] in ([], ["imports"])  # imports: the process's first run only
    assert all(p["start"] <= p["end"] for p in phases)
    assert all(a["end"] <= b["start"] + 1e-3 for a, b in zip(main, main[1:], strict=False)), main
    steps = next(p for p in main if p["name"] == "steps")
    saved = [p for p in phases if p["name"] == "checkpoint"]
    assert len(saved) == checkpoints and all(steps["start"] <= c["start"] <= c["end"] <= steps["end"] for c in saved)
    assert next(p for p in main if p["name"] == "first_step")["compiled"] is False  # CPU: never compiled


def test_metrics_keep_each_ranks_phases(full_run):
    _, metrics = full_run
    (record,) = metrics["phases"]
    assert_rank_phases(record, 0, checkpoints=metrics["checkpoints_saved"])
    assert metrics["choices"]["path"] == {"value": "packed", "by": "config"}  # local-tiny.yaml: flex_packing true


def test_no_checkpoint_at_the_last_step_unless_asked(full_run, tiny, tmp_path):
    """final_checkpoint=false (the default): checkpoints every save_steps for a requeue, none at the last step
    (the adapters and trainer state follow in output_dir); true keeps the Trainer's checkpoint there."""
    out, metrics = full_run
    assert metrics["train_steps"] == 24
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-20"]
    kept = tmp_path / "kept"
    asked = train.main(argv_for(tiny, kept, "--final_checkpoint", "true", "--max_steps", "6"))
    assert asked["checkpoints_saved"] == 2
    assert sorted(p.name for p in kept.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-6"]
    assert (kept / "checkpoint-6" / "optimizer.pt").exists()


def test_train_tokens_counts_non_padding_tokens(full_run, tiny):
    from transformers import AutoTokenizer

    from training.data import load_instruction_dataset

    _, metrics = full_run
    tok = AutoTokenizer.from_pretrained(tiny[0])
    rows = load_instruction_dataset(str(tiny[1]))
    expected = sum(len(tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"]) for r in rows)
    assert metrics["train_tokens"] == expected


def test_total_flos_counts_the_packed_tokens(full_run, tiny):
    """The Trainer's flos estimate, 6 x tokens x non-embedding parameters, over the packed micro-batches (the
    Trainer alone finds no input_ids in a packed batch and counts 0): between the non-padding tokens' figure and
    that plus the packing's padding (to a multiple of PAD_MULTIPLE tokens, one micro-batch a step here)."""
    from transformers import AutoModelForCausalLM

    from training.fastpath.batches import PAD_MULTIPLE

    _, metrics = full_run
    params = AutoModelForCausalLM.from_pretrained(tiny[0]).num_parameters(exclude_embeddings=True)
    flos = metrics["log_history"][-1]["total_flos"]
    low = 6 * metrics["train_tokens"] * params
    assert low <= flos <= low + 6 * (PAD_MULTIPLE - 1) * metrics["train_steps"] * params, (flos, low)


def test_resume_after_a_crash_reaches_the_same_step(full_run, tiny, tmp_path, monkeypatch):
    _, uninterrupted = full_run
    out = tmp_path / "out"
    monkeypatch.setenv(train.FAULT_RANK_ENV, "0")
    monkeypatch.setenv(train.FAULT_STEP_ENV, "12")
    with pytest.raises(RuntimeError, match="injected fault"):
        train.main(argv_for(tiny, out))
    assert train.find_resume_checkpoint(str(out)) == str(out / "checkpoint-10")
    assert not (out / "metrics.json").exists()
    assert not (out / train.COMPLETED_MARKER).exists()  # a crashed run is not marked completed

    monkeypatch.delenv(train.FAULT_RANK_ENV)
    monkeypatch.delenv(train.FAULT_STEP_ENV)
    resumed = train.main(argv_for(tiny, out))
    assert resumed["resumed_from_step"] == 10
    assert resumed["train_steps"] == uninterrupted["train_steps"]
    assert resumed["train_tokens"] == uninterrupted["train_tokens"]
    # Same data order and optimizer state after the resume: the loss curve continues where it left off.
    full = {h["step"]: h["loss"] for h in uninterrupted["log_history"] if "loss" in h}
    again = {h["step"]: h["loss"] for h in resumed["log_history"] if "loss" in h}
    assert again.keys() == full.keys()
    for step in full:
        assert again[step] == pytest.approx(full[step], rel=1e-3), step


def torchrun(tiny, out, *extra, env=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "training.train", *argv_for(tiny, out, *extra)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_two_processes_over_gloo(tiny, tmp_path):
    out = tmp_path / "out"
    proc = torchrun(tiny, out, "--max_steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["distributed_backend"] == "gloo"
    assert metrics["train_steps"] == 4
    assert [r["rank"] for r in metrics["phases"]] == [0, 1]  # every rank's own phases, gathered to rank 0
    for record in metrics["phases"]:
        assert_rank_phases(record, record["rank"], checkpoints=0)
    printed = [line for line in proc.stdout.splitlines() if line.startswith(train.METRICS_PREFIX)]
    assert len(printed) == 1, "rank 0 alone prints the metrics line"
    summary = json.loads(printed[0][len(train.METRICS_PREFIX):])
    assert summary["train_steps"] == 4 and "log_history" not in summary
    steps = [json.loads(line[len(train.LOG_PREFIX):])["step"] for line in proc.stdout.splitlines()
             if line.startswith(train.LOG_PREFIX) and '"loss"' in line]
    assert steps == [1, 2, 3, 4]
    assert (out / "adapter_model.safetensors").exists()
    assert ABORT not in proc.stderr, proc.stderr[-3000:]


# A gloo thread whose group is gone ends on its own, a moment later (seen once on a loaded CI machine:
# one thread still listed right after the run); one whose group a reference cycle keeps stays while the
# rank sleeps (no allocation, so no automatic collection): the probe waits up to 10 s for none.
_RANK_PROBE = """
import os, sys, time
sys.path.insert(0, sys.argv.pop(1))
from training import train
train.cli(sys.argv[1:])
def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(n.startswith(('pt_gloo', 'gloo_')) for n in names)
deadline = time.monotonic() + 10
while gloo_threads() and time.monotonic() < deadline:
    time.sleep(0.1)
# one line, one write: both ranks share torchrun's stdout, and print() writes each piece on its own
os.write(1, f"rank {os.environ['RANK']} gloo threads {gloo_threads()}\\n".encode())
"""


@pytest.mark.slow
def test_no_rank_keeps_gloo_threads_after_the_run(tiny, tmp_path):
    """Two gloo ranks (DDP): once the training's entry point returns, no gloo thread is left on either
    rank. destroy_process_group() only unregisters a group: one the Trainer's reference cycles still
    hold keeps its threads, which can abort a rank at interpreter exit with ABORT."""
    probe = tmp_path / "probe.py"
    probe.write_text(_RANK_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe),
           str(REPO), *argv_for(tiny, tmp_path / "out", "--max_steps", "2")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = sorted(re.findall(r"^rank (\d) gloo threads (\d+)$", proc.stdout, re.M))
    assert counts == [("0", "0"), ("1", "0")], proc.stdout[-3000:]


@pytest.mark.slow
def test_two_processes_deferred_logs_are_the_trainers(tiny, tmp_path):
    """2 gloo ranks, a log every step and a checkpoint at step 5: the deferred logs (one all-reduce of the
    ranks' loss, hits, scored tokens and flos, written a step later) give the Trainer's own log history,
    train_loss, total flos and checkpointed history (defer_logs false: the Trainer's log)."""
    runs = {}
    for defer in ("1", "0"):
        out = tmp_path / f"defer-{defer}"
        proc = torchrun(tiny, out, "--max_steps", "6", "--defer_logs", {"1": "true", "0": "false"}[defer])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        metrics = json.loads((out / "metrics.json").read_text())
        saved = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
        runs[defer] = metrics, saved
    (deferred, deferred_saved), (own, own_saved) = runs["1"], runs["0"]
    assert deferred["deferred_logs"] is True and own["deferred_logs"] is False
    assert deferred["world_size"] == own["world_size"] == 2

    from tests.unit.test_deferred_logs import TIMING

    def history(entries):
        return [{k: v for k, v in h.items() if k not in TIMING} for h in entries]

    for got, want in ((deferred["log_history"], own["log_history"]),
                      (deferred_saved["log_history"], own_saved["log_history"])):
        got, want = history(got), history(want)
        assert [sorted(h) for h in got] == [sorted(h) for h in want]
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-6), (g, w)
    logged = [h for h in deferred["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == [1, 2, 3, 4, 5, 6]
    assert all(0.0 <= h["mean_token_accuracy"] <= 1.0 for h in logged)
    assert deferred["train_loss"] == pytest.approx(own["train_loss"], rel=1e-6)
    assert deferred_saved["total_flos"] == own_saved["total_flos"] > 0
    assert deferred["log_history"][-1]["total_flos"] == own["log_history"][-1]["total_flos"] > 0


# In a fresh interpreter: a live gloo process group, then cli() on success or on bad data; prints
# whether the group is still alive afterwards.
_TEARDOWN_PROBE = """
import sys, torch.distributed as dist
from training import train
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
try:
    train.cli(sys.argv[2:])
except SystemExit as e:
    print("exit", e.code)
print("alive", dist.is_initialized())
import os
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("gloo threads", sum(n.startswith(("pt_gloo", "gloo_")) for n in threads))
"""


@pytest.mark.parametrize("case", ["success", "bad data"])
def test_cli_destroys_the_process_group(tiny, tmp_path, case):
    import socket

    with socket.socket() as s:  # a free loopback port for the group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = argv_for(tiny, tmp_path / "out", "--max_steps", "2")
    if case == "bad data":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"no_instruction": 1}\n')
        args[args.index("--dataset_name") + 1] = str(bad)
    proc = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE, str(port), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"})
    assert "alive False" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("exit 2" in proc.stdout) == (case == "bad data"), proc.stdout[-2000:]
    # Unregistered is not gone: a group still referenced (the Trainer's cycles) keeps gloo's threads,
    # which can abort a rank at interpreter exit ("terminate called without an active exception").
    assert "gloo threads 0" in proc.stdout, proc.stdout[-2000:]


# What a rank prints when it dies with its gloo threads still running (the process group left alive).
ABORT = "terminate called without an active exception"


@pytest.mark.slow
def test_sigterm_stops_every_rank_cleanly(tiny, tmp_path):
    """scancel / a requeue sends SIGTERM: every rank tears its process group down and exits, none aborts."""
    import signal
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "training.train", *argv_for(tiny, out, "--max_steps", "10000")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # wait until both ranks are inside the training loop
        if line.startswith(train.LOG_PREFIX) or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0  # the run was stopped, not finished
    assert ABORT not in stderr, stderr[-3000:]
    # torchrun reports each worker's exit: 143 (SIGTERM turned into SystemExit), never a signal death.
    assert "SIGABRT" not in stderr and "Signal 6" not in stderr, stderr[-3000:]
    assert not (out / "metrics.json").exists()


@pytest.mark.slow
def test_a_dying_rank_fails_the_run(tiny, tmp_path):
    out = tmp_path / "out"
    # The timeout only guards against a hang; the assertion is on the exit status.
    proc = torchrun(tiny, out, env={train.FAULT_RANK_ENV: "1", train.FAULT_STEP_ENV: "2"}, timeout=300)
    assert proc.returncode != 0
    assert "injected fault" in proc.stdout + proc.stderr
    assert not (out / "metrics.json").exists()
