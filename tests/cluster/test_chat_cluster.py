"""`fab chat` on the real local cluster: a tiny run trained with `fab train`, then a one-shot answer from its tuned
adapters, streamed back from a Slurm step on a GPU host (real Slurm, real CPU inference), and a prompts file
answered by one loaded model. The answer is the one the same adapters give on this machine (greedy, float32,
one thread on both sides): it came from the run's adapters, not from the base model alone or anything else."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from ops.say import shown
from tests.support.local_cluster import fresh_cluster

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
BASE = "/var/lib/slurm-gpu-local/scratch/tiny/model"  # /scratch/tiny/model inside the hosts
PROMPT = "What is the capital of Peru?"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def fab(runs_dir, *args, timeout=600):
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs_dir)}
    res = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def local_answer(run: Path, prompt: str, max_new_tokens: int) -> str:
    import torch

    from training import talk

    torch.set_num_threads(1)
    model, tok = talk.load(BASE, str(run), "cpu")
    return talk.answer(model, tok, talk.prompt_text(tok, "alpaca", prompt), max_new_tokens)["text"]


def test_one_shot_answer_from_the_tuned_adapters(tmp_path):
    runs_dir = tmp_path / "runs"
    with fresh_cluster(nodes=1, gpus=1) as (_inv, job_dirs):
        rc, out = fab(runs_dir, "train", "--target", "local", "--skip-check", "--examples", "64")
        m = re.search(r"submitted job (\d+): .* in (\S+);", out)
        assert m, out
        job_dirs.append(m[2])
        assert rc == 0, out
        job = m[1]

        rc, out = fab(runs_dir, "chat", "--target", "local", "--prompt", PROMPT, "--max-new-tokens", "12")
        assert rc == 0, out
        assert f"fab chat: run {job} " in out, out
        stats = re.findall(r"^\[first token [\d.]+ s, (\d+) tokens, [\d.]+ tokens/s\]$", out, re.M)
        assert stats == ["12"] or (len(stats) == 1 and 0 < int(stats[0]) <= 12), out
        expected = shown(local_answer(runs_dir / job, PROMPT, 12), block=True)  # as fab prints it
        assert expected.strip() and expected in out, (expected, out)

        prompts = tmp_path / "prompts.txt"
        prompts.write_text(f"{PROMPT}\n\nAdd 2 and 3.\n")
        rc, out = fab(runs_dir, "chat", "--target", "local", "--run", job, "--prompts-file", str(prompts),
                      "--max-new-tokens", "8")
        assert rc == 0, out
        assert out.count("loaded on cpu") == 1 and len(re.findall(r"^\[first token ", out, re.M)) == 2, out
        # nothing of the chat is left: no step, no chat folder
        assert not list((Path("/var/lib/slurm-gpu-local/scratch/slurm-gpu/chat")).glob("*"))
