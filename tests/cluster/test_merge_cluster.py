"""`fab merge` on the real local cluster: a real `fab train` (tiny model, CPU), then its adapters merged by a
Slurm job into bf16 safetensors on /scratch, brought home with --download, and reloaded with plain transformers:
the same logits as the base model with the adapters on top, within tests/unit/test_merge.py's tolerance. The run's
record keeps the data's content hash, and the model card names it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.local_cluster import fresh_cluster
from tests.unit.test_merge import assert_same_model, logit_gaps

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
SCRATCH = Path("/var/lib/slurm-gpu-local/scratch")  # /scratch inside the hosts

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def fab(runs: Path, *args: str, timeout: int = 600) -> tuple[int, str]:
    env = {**os.environ, "SLURM_GPU_RUNS": str(runs)}
    res = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def test_train_then_merge_gives_base_plus_adapters(tmp_path):
    runs = tmp_path / "runs"
    with fresh_cluster(nodes=1, gpus=1) as (_inv, job_dirs):
        rc, out = fab(runs, "train", "--target", "local", "--skip-check")
        m = re.search(r"submitted job (\d+): .* in (\S+);", out)
        assert m, out
        job_id, job_dir = m[1], m[2]
        job_dirs.append(job_dir)
        assert rc == 0, out

        rc, merged_out = fab(runs, "merge", "--target", "local", "--run", job_id, "--download")
        assert rc == 0, merged_out
        on_cluster = SCRATCH / Path(job_dir).relative_to("/scratch") / "merged"
        assert f"in {job_dir}/merged on the cluster" in merged_out, merged_out
        assert re.search(r"merged model: \d+ files, [0-9.]+ GB of bf16 safetensors", merged_out), merged_out
        assert (on_cluster / "model.safetensors").is_file()
        run = runs / job_id
        home = run / "merged"
        assert sorted(os.listdir(home)) == sorted(os.listdir(on_cluster))
        # the data's content hash, kept in run.json at training time and named by the model card
        record = json.loads((run / "run.json").read_text())
        data = SCRATCH / Path(record["data_on_cluster"]).relative_to("/scratch")
        assert record["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest(), record
        card = (home / "README.md").read_text()
        assert card == (run / "README.md").read_text()
        for want in (f"| data SHA-256 | {record['data_sha256']} |", "| data format | alpaca",
                     "| config | local-tiny.yaml |", "held-out loss, base -> tuned", "```yaml"):
            assert want in card, want
        # plain transformers, nothing of this project: the same logits as base + adapters (tests/unit/test_merge.py)
        adapter_cfg = json.loads((run / "adapter_config.json").read_text())
        base = SCRATCH / Path(adapter_cfg["base_model_name_or_path"]).relative_to("/scratch")
        gaps = logit_gaps(home, base, run)
        print("logit gaps:", gaps)
        assert_same_model(gaps)
