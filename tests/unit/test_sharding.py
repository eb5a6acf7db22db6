"""training/sharding.py: the `sharding` setting decided and refused, and sharded training for real on CPU ranks
over gloo with the tiny Qwen3: per-rank parameter bytes, the same losses as unsharded, adapters that load
without sharding, and a run killed mid-way that resumes sharded and completes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training import memory_model as mm
from training import sharding, train
from training.make_tiny import make_tiny
from training.validate import default

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "training" / "configs" / "local-tiny.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
RANKS = 4
STEPS = 6  # 6 optimizer steps of 4 ranks x 4 rows; checkpoints at 3 and 6
EVAL_ROWS = 16


def setting_with(**given):
    return lambda key: given[key] if key in given else default(key)


def tiny_config() -> dict:
    return {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 475,
            "tie_word_embeddings": True}


# ---------------------------------------------------------------- the decision


def test_fsdp_with_one_rank_is_refused_naming_the_setting_and_the_fix():
    with pytest.raises(sharding.ShardingError, match=r"^sharding: fsdp needs 2 or more ranks to shard over; this "
                                                     r"run has 1: set sharding to auto or none"):
        sharding.decide(setting_with(sharding="fsdp"), tiny_config(), 1, gpu=False)


def test_auto_never_shards_on_cpu_and_none_never_shards():
    assert sharding.decide(setting_with(), tiny_config(), 4, gpu=False) == (False, "auto: no GPU memory to fit (CPU)")
    assert sharding.decide(setting_with(sharding="none"), tiny_config(), 4, gpu=True, usable=1) == (False, "config")
    assert sharding.decide(setting_with(sharding="fsdp"), tiny_config(), 4, gpu=False) == (True, "config")


def test_auto_shards_when_the_memory_model_says_one_gpu_cannot_hold_it():
    config = tiny_config()
    unsharded = mm.peak_bytes(config, mm.run_plan(config, setting_with(sharding="none"), 4, math.inf))
    shard, why = sharding.decide(setting_with(), config, 4, gpu=True, usable=unsharded * 0.99)
    assert shard and why.startswith("sharding auto: the base sharded 4-way, as one GPU cannot hold the run unsharded")
    assert sharding.decide(setting_with(), config, 4, gpu=True, usable=unsharded * 2) == (
        False, "auto: the run fits one GPU unsharded")
    assert sharding.decide(setting_with(), config, 1, gpu=True, usable=1)[0] is False  # nothing to shard over


def test_a_run_asking_fsdp_on_one_process_stops_before_the_model_loads(tmp_path):
    with pytest.raises(sharding.ShardingError, match="sharding: fsdp needs 2 or more ranks"):
        train.main(["--config", str(CONFIG), "--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name",
                    str(tmp_path / "no-data.jsonl"), "--output_dir", str(tmp_path / "out"), "--sharding", "fsdp"])


def test_a_bad_sharding_value_names_the_choices():
    from training.validate import ConfigProblem, check_config

    with pytest.raises(ConfigProblem, match="sharding='zero3' is not allowed: set sharding to one of auto, none, fsdp"):
        check_config({"sharding": "zero3"}, "x.yaml")


# ---------------------------------------------------------------- for real, 4 CPU ranks over gloo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"), examples=RANKS * 4 * STEPS + EVAL_ROWS, seed=0)


def torchrun(tiny, out: Path, *extra, env=None, ranks=RANKS, timeout=900) -> subprocess.CompletedProcess:
    model_dir, data_file = tiny
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "training.train", "--config", str(CONFIG), "--model_name_or_path", str(model_dir),
           "--dataset_name", str(data_file), "--output_dir", str(out), "--save_steps", "3",
           "--eval_split", str(EVAL_ROWS), "--samples", "0", "--report_to", "none", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", **(env or {})})


def step_losses(stdout: str) -> dict[int, float]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith(train.LOG_PREFIX) and '"loss"' in line:
            entry = json.loads(line[len(train.LOG_PREFIX):])
            out[entry["step"]] = entry["loss"]
    return out


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """The same 4-rank run sharded and unsharded: (output dir, stdout) of each."""
    done = {}
    for name in ("fsdp", "none"):
        out = tmp_path_factory.mktemp(name) / "out"
        proc = torchrun(tiny, out, "--sharding", name)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        done[name] = (out, proc.stdout)
    return done


# Why these tolerances. Sharded and unsharded runs do the same arithmetic on the same rows in float32, with two
# differences: FSDP2 averages the adapters' gradients by a reduce-scatter, DDP by an all-reduce (another order of
# additions), and a sharded forward uses all-gathered weights (bitwise the originals). So step 1's loss (before
# any update) is the same to float32 rounding (1e-6 relative); afterwards the gradients differ by float32
# rounding (~1e-7 relative), which AdamW's normalised update carries into the weights at most at that scale per
# step; over 6 steps at lr 5e-3 the losses may drift apart by ~1e-5 relative. 1e-4 leaves a margin of 10 over that
# and is still 100 times smaller than one step's change of the loss here (~1e-2 relative), so a sharding bug
# (a wrong shard, a missing reduction, a gradient not averaged) cannot hide in it. Measured here (torch 2.13 CPU,
# 2026-12-07): steps 1-3 bitwise equal, at most 4.4e-8 relative over the 6 steps, held-out loss 1e-8.
FIRST_STEP_RTOL, STEP_RTOL, EVAL_RTOL = 1e-5, 1e-4, 1e-4


@pytest.mark.slow
def test_four_ranks_sharded_train_as_unsharded(runs):
    (sharded, out_s), (plain, out_p) = runs["fsdp"], runs["none"]
    losses_s, losses_p = step_losses(out_s), step_losses(out_p)
    assert sorted(losses_s) == sorted(losses_p) == list(range(1, STEPS + 1))
    assert losses_s[1] == pytest.approx(losses_p[1], rel=FIRST_STEP_RTOL)
    for step in losses_p:
        assert losses_s[step] == pytest.approx(losses_p[step], rel=STEP_RTOL), step
    assert losses_s[STEPS] < losses_s[1] * 0.98  # it trains: the loss falls
    m_s, m_p = (json.loads((d / "metrics.json").read_text()) for d in (sharded, plain))
    assert m_s["choices"]["sharding"] == {"value": "fsdp 4-way", "by": "config"}
    assert m_p["choices"]["sharding"] == {"value": "none", "by": "config"}
    assert m_s["world_size"] == RANKS and m_s["eval"]["rows"] == EVAL_ROWS
    for key in ("base", "tuned"):  # the same held-out eval loss (every rank scores all rows when sharded)
        assert m_s["eval"][key]["tokens"] == m_p["eval"][key]["tokens"]
        assert m_s["eval"][key]["loss"] == pytest.approx(m_p["eval"][key]["loss"], rel=EVAL_RTOL)
    assert m_s["eval"]["tuned"]["loss"] < m_s["eval"]["base"]["loss"]
    # what the fast path cannot do sharded, and why, in the run's choices
    assert m_s["choices"]["background_checkpoints"]["value"] is False
    assert "sharded (FSDP2)" in m_s["choices"]["background_checkpoints"]["by"]
    ckpt = sharded / "checkpoint-3"
    assert {f"optimizer.rank{r}.pt" for r in range(RANKS)} <= {p.name for p in ckpt.iterdir()}


@pytest.mark.slow
def test_sharded_adapters_load_without_sharding_in_peft_format(runs, tiny):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    (sharded, _), (plain, _) = runs["fsdp"], runs["none"]
    saved_s, saved_p = (load_file(d / "adapter_model.safetensors") for d in (sharded, plain))
    assert sorted(saved_s) == sorted(saved_p) and saved_s  # PEFT's keys, whole tensors
    for key, tensor in saved_p.items():
        assert saved_s[key].shape == tensor.shape, key
        assert torch.allclose(saved_s[key], tensor, rtol=1e-3, atol=1e-5), key
    # one process, no process group: PEFT loads them onto the plain base
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny[0]), sharded)
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved_s)
    key = next(iter(saved_s))
    name = next(n for n in loaded if n.replace(".default", "").endswith(key.removeprefix("base_model.model.")))
    assert torch.equal(loaded[name].detach(), saved_s[key])


@pytest.mark.slow
def test_per_rank_parameter_bytes_are_a_quarter_plus_the_replicated_parts(tmp_path):
    from benchmarks import bench_shard_params

    out = tmp_path / "shard.json"
    assert bench_shard_params.main(["--ranks", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    predicted = result["predicted"]["per_rank_bytes"]
    for rank in result["ranks"]:
        assert abs(rank["total"] / predicted - 1) <= 0.10, rank
        assert rank["replicated"] == 0 and rank["buffers"] == result["predicted"]["replicated_bytes"]
    # the shards add up to the whole: nothing lost, nothing held twice
    assert sum(r["sharded"] for r in result["ranks"]) == result["measured_whole"]["parameters"]
    assert result["measured_whole"]["parameters"] == (result["predicted"]["base_bytes"]
                                                      + result["predicted"]["adapter_bytes"])


@pytest.mark.slow
def test_a_sharded_run_killed_mid_way_resumes_sharded_and_completes(runs, tiny, tmp_path):
    out = tmp_path / "out"
    # rank 2 dies after step 4: the checkpoint of step 3 is the last complete one
    proc = torchrun(tiny, out, "--sharding", "fsdp", env={train.FAULT_RANK_ENV: "2", train.FAULT_STEP_ENV: "4"})
    assert proc.returncode != 0 and "injected fault" in proc.stdout + proc.stderr
    assert (out / "checkpoint-3" / "trainer_state.json").exists() and not (out / "metrics.json").exists()
    again = torchrun(tiny, out, "--sharding", "fsdp")  # the requeue: the same command
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert train.RESUME_PREFIX + json.dumps({"checkpoint": str(out / "checkpoint-3"), "step": 3}) in again.stdout
    resumed, whole = step_losses(again.stdout), step_losses(runs["fsdp"][1])
    assert sorted(resumed) == list(range(4, STEPS + 1))
    for step in resumed:  # the same steps as the uninterrupted sharded run: adapters, optimizer shards, data order
        assert resumed[step] == pytest.approx(whole[step], rel=STEP_RTOL), step
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 3 and metrics["choices"]["sharding"]["value"] == "fsdp 4-way"
    assert (out / "adapter_model.safetensors").exists() and (out / train.COMPLETED_MARKER).exists()


@pytest.mark.slow
def test_the_padded_path_with_recomputation_trains_sharded_as_unsharded(tiny, tmp_path):
    """TRL's padded batches (flex_packing false) and activation checkpointing, sharded over 2 ranks: the same
    losses as the same run unsharded (tolerances above)."""
    losses = {}
    for name in ("fsdp", "none"):
        proc = torchrun(tiny, tmp_path / name, "--sharding", name, "--flex_packing", "false",
                        "--activation_checkpointing", "true", "--max_steps", "3", "--eval_split", "0", ranks=2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses[name] = step_losses(proc.stdout)
    assert sorted(losses["fsdp"]) == [1, 2, 3]
    for step, loss in losses["none"].items():
        assert losses["fsdp"][step] == pytest.approx(loss, rel=STEP_RTOL), step
    metrics = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())
    assert metrics["choices"]["path"]["value"] == "padded" and metrics["choices"]["activation_checkpointing"]["value"]
    assert metrics["choices"]["sharding"]["value"] == "fsdp 2-way"
