"""`fab merge` (ops/finetune/ship.py, jobs/merge_adapters.py, ops/finetune/model_card.py) without a cluster:
the merge program on the tiny model with real peft adapters, reloaded with plain transformers; the model card
from a run's records; the data hash run.json keeps; and the refusals made before any host is touched.
tests/cluster/test_run_after_training_cluster.py runs the same merge as a Slurm job after a real `fab train`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import invoke
import pytest

from ops.finetune import model_card, run_home, ship

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
PROMPT = "### Instruction:\nWhat is the capital of Peru?\n\n### Response:\nLima"


def logit_gaps(merged: Path, base: Path, adapters: Path, text: str = PROMPT) -> dict[str, float]:
    """Largest logit differences on `text` between: the merged model (plain transformers, its own bf16), the
    base model in bf16 with the adapters on top (peft, unmerged), the same in fp32 (the reference), and the base
    alone. The reference is as exact as this CPU gets; each bf16 path is one rounding per weight or activation
    away from it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(merged)(text, return_tensors="pt")
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(merged).eval()  # in config.json's dtype: bf16 for a merge
        out = {"merged": m(**ids).logits.float()}
        b16 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
        out["base"] = b16(**ids).logits.float()
        out["unmerged"] = PeftModel.from_pretrained(b16, str(adapters)).eval()(**ids).logits.float()
        b32 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        out["reference"] = PeftModel.from_pretrained(b32, str(adapters)).eval()(**ids).logits

    def gap(a, b):
        return (out[a] - out[b]).abs().max().item()

    return {"merged_vs_unmerged": gap("merged", "unmerged"), "merged_vs_reference": gap("merged", "reference"),
            "unmerged_vs_reference": gap("unmerged", "reference"), "adapters_effect": gap("unmerged", "base")}


def assert_same_model(g: dict[str, float]) -> None:
    """The tolerance. bf16 keeps 8 significant bits: rounding a value to it moves it by at most 2^-9 of itself
    (round to nearest). The merged model rounds each W + scale * B @ A once (peft computes the sum in fp32 on a
    CPU, get_delta_weight); the unmerged bf16 model rounds W x and scale * B (A x) and their sum instead. Both are
    the exact model perturbed by one bf16 rounding per weight or activation, so the merge may move the logits
    from the fp32 reference by no more than twice what running the unmerged model in bf16 already does (measured
    on the tiny model with random rank-16 adapters: 0.047 merged vs 0.037 unmerged, logits up to 3.2, where one
    bf16 step is 2^-6 = 0.016; with the adapters a local-cluster `fab train` made: 0.074 vs 0.080, and 0.076
    between merged and unmerged). And the adapters must matter far more than that (measured: 3.8 and 6.4), else
    the check could not tell a merge from no merge: the base alone fails it."""
    assert g["merged_vs_reference"] <= 2 * g["unmerged_vs_reference"], g
    assert g["adapters_effect"] > 10 * g["merged_vs_unmerged"], g


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny model and random LoRA adapters on it (B != 0: peft's init would leave the model unchanged),
    saved as a run's output is: adapters and tokenizer; returns (tmp, model dir, adapters dir)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.make_tiny import make_tiny

    tmp = tmp_path_factory.mktemp("merge")
    model_dir, _ = make_tiny(tmp, examples=50)
    torch.manual_seed(1)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora)
    adapters = tmp / "output"
    peft_model.save_pretrained(adapters)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(adapters)
    return tmp, model_dir, adapters


def test_merged_model_loads_with_plain_transformers_and_gives_base_plus_adapters_logits(tiny_run):
    from jobs import merge_adapters

    tmp, model_dir, adapters = tiny_run
    out = tmp / "merged"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"x")  # an earlier merge's file does not stay
    card = tmp / "card.md"
    card.write_text("# card\n")
    result = merge_adapters.merge(adapters, out, card)
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert "stale.safetensors" not in names and not any(n.startswith("adapter_") for n in names), names
    assert result["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert keys and all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
        assert not any("lora" in k for k in keys), keys
    assert (out / "README.md").read_text() == "# card\n"
    assert_same_model(logit_gaps(out, model_dir, adapters))


def test_the_tolerance_tells_a_merge_from_the_base_alone(tiny_run):
    """The check above fails for a 'merged' model that is the base model unchanged."""
    tmp, model_dir, adapters = tiny_run
    g = logit_gaps(model_dir, model_dir, adapters)
    with pytest.raises(AssertionError, match="merged_vs_reference"):
        assert_same_model(g)


def test_merge_refuses_a_base_model_that_is_gone(tiny_run, tmp_path):
    from jobs import merge_adapters

    _, _, adapters = tiny_run
    moved = tmp_path / "output"
    moved.mkdir()
    cfg = json.loads((adapters / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "/scratch/gone"}))
    with pytest.raises(SystemExit, match="base model '/scratch/gone'.*gone from /scratch"):
        merge_adapters.merge(moved, tmp_path, tmp_path / "card.md")


def _run_dir(root: Path, name: str = "7", adapters: bool = True, job_dir: str | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "job_dir").write_text((job_dir or "/scratch/slurm-gpu/jobs/20260101-120000-abc123") + "\n")
    (run / "metrics.json").write_text(json.dumps({
        "train_rows": 380, "world_size": 4, "last_loss": 0.4321, "tokens_per_s": 1234.5,
        "eval": {"rows": 20, "base": {"loss": 3.5, "token_accuracy": 0.1}, "tuned": {"loss": 0.9, "token_accuracy": 0.8}},
        "choices": {"data_format": {"value": "chat", "by": "auto: the data's columns"},
                    "chat_template": {"value": "0123456789ab", "by": "the tokenizer's own, with generation markers"}}}))
    (run / "run.json").write_text(json.dumps({
        "model": "Qwen/Qwen3-4B", "data": "/home/me/chats.jsonl", "config": "qwen3-4b-lora.yaml", "nodes": 2,
        "gpus_per_node": 8, "gpu_type": "h100", "data_on_cluster": "/scratch/data/ab12/chats.jsonl",
        "data_sha256": "ab" * 32}))
    if adapters:
        (run / "adapter_config.json").write_text(json.dumps({
            "base_model_name_or_path": "/scratch/hub/models/Qwen/Qwen3-4B@" + "1" * 40, "r": 16, "lora_alpha": 32,
            "lora_dropout": 0.05, "target_modules": ["v_proj", "q_proj"]}))
    return run


def test_model_card_names_what_the_model_was_made_from(tmp_path):
    run = _run_dir(tmp_path)
    card = model_card.render(run, "lora_r: 16\nlearning_rate: 2.0e-4\n")
    assert card.startswith('---\nbase_model: "Qwen/Qwen3-4B"\nlibrary_name: transformers\n'), card
    for want in ("| base model | Qwen/Qwen3-4B |", "| data | /home/me/chats.jsonl |",
                 "| data read on the cluster | /scratch/data/ab12/chats.jsonl |", f"| data SHA-256 | {'ab' * 32} |",
                 "| data format | chat (auto: the data's columns) |",
                 "| chat template | 0123456789ab (the tokenizer's own, with generation markers) |",
                 "| config | qwen3-4b-lora.yaml |", "rank 16, alpha 32, dropout 0.05; modules q_proj, v_proj",
                 "| held-out loss, base -> tuned | 3.5000 -> 0.9000 |",
                 "| held-out token accuracy, base -> tuned | 0.1000 -> 0.8000 |", "| final training loss | 0.4321 |",
                 "```yaml\nlora_r: 16\nlearning_rate: 2.0e-4\n```"):
        assert want in card, want


def test_model_card_of_a_run_without_records_says_so_and_quotes_nothing_raw(tmp_path):
    run = _run_dir(tmp_path)
    (run / "run.json").unlink()
    m = json.loads((run / "metrics.json").read_text())
    m["choices"]["data_format"]["value"] = "chat\n## <script>x</script>"  # a job wrote metrics.json
    (run / "metrics.json").write_text(json.dumps(m))
    card = model_card.render(run, None)
    assert "base_model:" not in card  # a path on the cluster is no Hub model to link
    assert "| data SHA-256 | - |" in card and "Training config" not in card
    assert "| data format | chat ## &lt;script&gt;x&lt;/script&gt; (auto: the data's columns) |" in card


def test_data_digest_of_a_file_and_of_a_folder(tmp_path):
    c = invoke.Context()
    f = tmp_path / "train.jsonl"
    f.write_bytes(b'{"a": 1}\n')
    assert run_home.data_digest(c, str(f)) == {"path": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    d = tmp_path / "hub"
    (d / "data").mkdir(parents=True)
    (d / "data" / "b 1.parquet").write_bytes(b"two")
    (d / "a.json").write_bytes(b"one")
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(d)}\n"
                    for p in sorted([d / "a.json", d / "data" / "b 1.parquet"]))
    assert run_home.data_digest(c, str(d))["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert run_home.data_digest(c, str(tmp_path / "missing")) is None
    assert run_home.data_digest(c, "org/dataset") is None and run_home.data_digest(c, None) is None


def _fab_merge(runs: Path, *args: str) -> tuple[int, str]:
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs)}
    res = subprocess.run([FAB, "merge", "--target", "local", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.parametrize("make, args, error", [
    (lambda r: None, (), "fab merge: no run with adapters under .* yet: `fab train` brings"),
    (lambda r: _run_dir(r), ("--run", "12"), r"fab merge: --run 12: no such run under .*`fab runs` lists"),
    (lambda r: _run_dir(r), ("--run", "../7"), r"fab merge: --run '../7' is not a run's name"),
    (lambda r: _run_dir(r, adapters=False), ("--run", "7"), r"fab merge: run 7 has no adapters in .*fab logs --job 7"),
    (lambda r: _run_dir(r, job_dir="/scratch/x; rm -rf /"), ("--run", "7"),
     r"fab merge: run 7: .*job_dir does not name the run's job folder on the cluster"),
])
def test_fab_merge_refuses_bad_input_before_touching_a_host(tmp_path, make, args, error):
    import re

    runs = tmp_path / "runs"
    runs.mkdir()
    make(runs)
    rc, out = _fab_merge(runs, *args)
    assert rc == 1 and re.search(error, out) and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_find_run_takes_the_newest_run_with_adapters_by_default(tmp_path):
    import os

    run = _run_dir(tmp_path)
    newer = _run_dir(tmp_path, name="8", adapters=False)  # a newer run that did not finish
    os.utime(newer / "metrics.json", (run.stat().st_mtime + 60,) * 2)
    assert ship.find_run(tmp_path, None) == run


def test_a_download_refuses_a_file_owned_by_another_user_when_opened(tmp_path):
    """fab reads a job's output as the admin over SFTP, which follows a link on open: a file swapped
    for a link to another user's file after the listing is refused by its owner (run_home.job_owner)."""
    import stat as st_

    from ops.finetune import run_home

    class Attrs:
        def __init__(self, uid):
            self.st_mode, self.st_size, self.st_uid = st_.S_IFREG | 0o644, 5, uid

    class File:
        def __init__(self, uid):
            self.uid, self.data = uid, [b"hello", b""]

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def stat(self):
            return Attrs(self.uid)

        def read(self, n):
            return self.data.pop(0)

    class Sftp:
        def __init__(self, uid):
            self.uid = uid

        def open(self, path, mode):
            return File(self.uid)

    why = run_home._copy_capped(Sftp(0), "/scratch/x/output/adapter_model.safetensors", str(tmp_path / "a"), 100, 2950)
    assert why and "owned by uid 0" in why and not (tmp_path / "a").exists()
    assert run_home._copy_capped(Sftp(2950), "/x", str(tmp_path / "b"), 100, 2950) is None
    assert (tmp_path / "b").read_bytes() == b"hello"


def test_job_owner_is_the_job_users_uid_where_jobs_have_their_own_user():
    from ops.finetune import run_home
    from tests.support import inventories

    assert run_home.job_owner(inventories.make("aws")) == 2950
    assert run_home.job_owner(inventories.make("local", job_user="root", ssh_user="root")) is None


def test_model_card_values_carry_no_markdown_of_their_own():
    """A value a job wrote (adapter_config.json, metrics.json) cannot put a link, an image or a table
    cell into the card the user publishes."""
    from ops.finetune import model_card

    text = model_card._text("![x](https://example.invalid/p.png) | [a](b)")
    assert "](" not in text.replace("\\](", "") and "\\|" in text and "\\!\\[" in text
