"""One run's life after `fab train`, on the real local cluster (one GPU host, tiny model, CPU): trained on a JSONL
that exists only on the user's side, then talked to with `fab chat` and merged with `fab merge`. One cluster and
one training run serve all three (each would otherwise bring up its own and train again).

- Upload: the file goes once to /scratch/uploads/<sha256>/<name>, is trained on and recorded in run.json; the same
  file a second time is found there and not uploaded again. (An interrupted or changed upload:
  tests/unit/test_upload_sftp.py.)
- Chat: a one-shot answer from the run's adapters, streamed back from a Slurm step on the GPU host (real Slurm,
  real CPU inference), is the one the same adapters give on this machine (greedy, float32, one thread on both
  sides): it came from the run's adapters, not from the base model alone; a prompts file is answered by one
  loaded model.
- Merge: the adapters merged by a Slurm job into bf16 safetensors on /scratch, brought home with --download and
  reloaded with plain transformers give the base model's logits with the adapters on top, within
  tests/unit/test_merge.py's tolerance; the model card names the data's content hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from localcluster import topology as layout
from ops.finetune import upload
from ops.say import shown
from tests.support.local_cluster import fresh_cluster
from tests.unit.test_merge import assert_same_model, logit_gaps

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
SCRATCH = layout.SCRATCH  # /scratch inside the hosts
UPLOADS = SCRATCH / upload.UPLOADS  # /scratch/uploads as this machine sees it
BASE = SCRATCH / "tiny" / "model"
PROMPT = "What is the capital of Peru?"
ROWS = 64

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def fab(runs: Path, *args: str, timeout: int = 600) -> tuple[int, str]:
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs)}
    res = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def fab_train(runs: Path, data: Path, job_dirs: list[str]) -> tuple[str, str, str]:
    """(output, job id, job folder) of a `fab train --data FILE` that succeeded."""
    rc, out = fab(runs, "train", "--target", "local", "--skip-check", "--data", str(data), timeout=500)
    m = re.search(r"submitted job (\d+): .* in (\S+);", out)
    if m:
        job_dirs.append(m[2])
    assert rc == 0 and m, out
    return out, m[1], m[2]


def run_record(runs: Path) -> dict:
    (record,) = runs.glob("*/run.json")
    return json.loads(record.read_text())


@dataclass
class Trained:
    runs: Path  # the first run's runs/ folder (it holds that run alone)
    out: str  # its `fab train` output
    job: str
    job_dir: str  # on the cluster
    data: Path  # the user's file
    sha: str
    job_dirs: list[str]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = tmp_path_factory.mktemp("user-side") / "mine.jsonl"  # on the user's side only
    runs = tmp_path_factory.mktemp("runs")
    with fresh_cluster(nodes=1, gpus=1) as (_inv, job_dirs):
        try:
            # The tiny data set's first rows, as a file of the user's own: instructions with answers of a few
            # words, so that the tuned model has something to say to the chat's prompt.
            rows = [ln for ln in (SCRATCH / "tiny" / "data" / "train.jsonl").read_text().splitlines() if ln.strip()]
            data.write_text("\n".join(rows[:ROWS]) + "\n")
            sha = hashlib.sha256(data.read_bytes()).hexdigest()
            # /scratch outlives clusters (`fab local.down` keeps it): an earlier, interrupted run of this module may
            # have left this file's upload, and the first run below must make its own.
            subprocess.run(["rm", "-rf", str(UPLOADS / sha)], check=True)
            out, job, job_dir = fab_train(runs, data, job_dirs)
            yield Trained(runs, out, job, job_dir, data, sha, job_dirs)
        finally:
            subprocess.run(["rm", "-rf", str(UPLOADS)], check=False)


def test_a_local_jsonl_is_uploaded_once_trained_on_and_recorded(trained, tmp_path):
    t = trained
    home = UPLOADS / t.sha / "mine.jsonl"
    assert f"--data: local file {t.data} (" in t.out and f"{ROWS} rows, format alpaca" in t.out, t.out
    assert "sha256 verified on the controller" in t.out, t.out
    assert home.read_bytes() == t.data.read_bytes() and oct(home.stat().st_mode & 0o777) == "0o644"
    assert not list(UPLOADS.glob(".partial-*"))
    rec = run_record(t.runs)
    assert rec["data"] == f"/scratch/uploads/{t.sha}/mine.jsonl"
    assert rec["data_source"] | {} == {"kind": "local file", "path": str(t.data), "sha256": t.sha,
                                       "bytes": t.data.stat().st_size, "rows": ROWS, "format": "alpaca",
                                       "cluster_path": rec["data"], "uploaded": True}
    stamp = home.stat().st_mtime_ns

    out, _job, _dir = fab_train(tmp_path / "second", t.data, t.job_dirs)  # the same file again: nothing uploaded
    assert f"already on the cluster at /scratch/uploads/{t.sha}/mine.jsonl (same sha256), not uploaded" in out, out
    assert "uploading" not in out and "sha256 verified" not in out, out
    assert home.stat().st_mtime_ns == stamp
    assert run_record(tmp_path / "second")["data_source"]["uploaded"] is False


def local_answer(run: Path, prompt: str, max_new_tokens: int) -> str:
    import torch

    from training import talk

    torch.set_num_threads(1)
    model, tok = talk.load(str(BASE), str(run), "cpu")
    return talk.answer(model, tok, talk.prompt_text(tok, "alpaca", prompt), max_new_tokens)["text"]


def test_one_shot_answer_from_the_tuned_adapters(trained, tmp_path):
    t = trained
    rc, out = fab(t.runs, "chat", "--target", "local", "--prompt", PROMPT, "--max-new-tokens", "12")
    assert rc == 0, out
    assert f"fab chat: run {t.job} " in out, out  # the newest run with adapters
    stats = re.findall(r"^\[first token [\d.]+ s, (\d+) tokens, [\d.]+ tokens/s\]$", out, re.M)
    assert stats == ["12"] or (len(stats) == 1 and 0 < int(stats[0]) <= 12), out
    expected = shown(local_answer(t.runs / t.job, PROMPT, 12), block=True)  # as fab prints it
    assert expected.strip() and expected in out, (expected, out)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n\nAdd 2 and 3.\n")
    rc, out = fab(t.runs, "chat", "--target", "local", "--run", t.job, "--prompts-file", str(prompts),
                  "--max-new-tokens", "8")
    assert rc == 0, out
    assert out.count("loaded on cpu") == 1 and len(re.findall(r"^\[first token ", out, re.M)) == 2, out
    assert not list((SCRATCH / "slurm-gpu" / "chat").glob("*"))  # nothing of the chat is left


def test_merge_gives_base_plus_adapters_and_a_card_naming_the_data(trained):
    t = trained
    rc, merged_out = fab(t.runs, "merge", "--target", "local", "--run", t.job, "--download")
    assert rc == 0, merged_out
    on_cluster = SCRATCH / Path(t.job_dir).relative_to("/scratch") / "merged"
    assert f"in {t.job_dir}/merged on the cluster" in merged_out, merged_out
    assert re.search(r"merged model: \d+ files, [0-9.]+ GB of bf16 safetensors", merged_out), merged_out
    assert (on_cluster / "model.safetensors").is_file()
    run = t.runs / t.job
    home = run / "merged"
    assert sorted(os.listdir(home)) == sorted(os.listdir(on_cluster))
    # the data's content hash, kept in run.json at training time and named by the model card
    record = json.loads((run / "run.json").read_text())
    data = SCRATCH / Path(record["data_on_cluster"]).relative_to("/scratch")
    assert record["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest() == t.sha, record
    card = (home / "README.md").read_text()
    assert card == (run / "README.md").read_text()
    for want in (f"| data SHA-256 | {t.sha} |", "| data format | alpaca",
                 "| config | local-tiny.yaml |", "held-out loss, base -> tuned", "```yaml"):
        assert want in card, want
    # plain transformers, nothing of this project: the same logits as base + adapters (tests/unit/test_merge.py)
    adapter_cfg = json.loads((run / "adapter_config.json").read_text())
    base = SCRATCH / Path(adapter_cfg["base_model_name_or_path"]).relative_to("/scratch")
    gaps = logit_gaps(home, base, run)
    print("logit gaps:", gaps)
    assert_same_model(gaps)
