"""`fab train --max-cost` on the real local cluster: a cap the estimate fits, a run slower than the
estimate, and the job stops with a checkpoint before the cap instead of training to the end.

The local cluster is priced at its stand-in rate per node (ops/data/local.json). The estimate prices
make_tiny's short rows; this run trains on rows about ten times longer, so its steps take longer than
estimated, as a run on data longer than the estimate assumed would on AWS. The cap is the estimate's
cost: `fab train` accepts it, and the run reaches it during training.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import string
import subprocess
from pathlib import Path

import pytest

from ops import cost_cap, options
from ops import estimate as est
from tests.localcluster_fixture import fresh_cluster

REPO = Path(__file__).resolve().parent.parent
FAB = str(REPO / ".venv" / "bin" / "fab")
ROWS = 200

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def long_rows(n: int) -> list[dict]:
    """Rows whose answers are a few hundred characters the tiny tokenizer splits finely (max_length cuts them)."""
    rng = random.Random(0)
    return [{"instruction": "Copy these letters.", "input": "",
             "output": " ".join("".join(rng.choices(string.ascii_lowercase, k=7)) for _ in range(40))}
            for _ in range(n)]


def test_cap_stops_the_run_with_a_checkpoint_and_brings_its_adapters_home(tmp_path):
    from safetensors.torch import load_file

    from localcluster import layout

    with fresh_cluster(nodes=2, gpus=2) as (inv, job_dirs):
        data = layout.SCRATCH / "captest" / "long.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r) + "\n" for r in long_rows(ROWS)))
        job_dirs.append("/scratch/captest")
        opts = options.parse(target="local", examples=str(ROWS), data="/scratch/captest/long.jsonl")
        plan = est.for_run(opts, inv)
        cap = math.ceil(cost_cap.run_cost(plan, "first") * 1000) / 1000  # the estimate, to a tenth of a cent

        env = {**os.environ, "SLURM_GPU_RUNS": str(tmp_path)}
        res = subprocess.run([FAB, "train", "--target", "local", "--data", "/scratch/captest/long.jsonl",
                              "--examples", str(ROWS), "--max-cost", str(cap)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=420)
        out = res.stdout + res.stderr
        m = re.search(r"submitted job (\d+): .* in (\S+);", out)
        assert m, out
        job_id, job_dir = m[1], m[2]
        job_dirs.append(job_dir)
        assert res.returncode == 0, out
        assert f"--max-cost ${cap:.2f}: estimated at $" in out, out

        run = tmp_path / job_id
        metrics = json.loads((run / "metrics.json").read_text())
        cost = metrics["cost"]
        print(f"cap ${cap}: {json.dumps(cost)}; train_runtime {metrics['train_runtime']:.1f} s")
        assert metrics["stopped_by"] == "max_cost", (cost, out)
        step, max_steps = cost["stopped_at_step"], cost["max_steps"]
        assert 1 <= step < max_steps and metrics["train_steps"] == step, cost
        assert cost["max_usd"] == pytest.approx(cap) and cost["full_run_usd"] > cost["spent_usd"], cost
        # the checkpoint of the stop step is on /scratch, complete; its adapters are the ones brought home
        ckpt = layout.SCRATCH / Path(job_dir).relative_to("/scratch") / "output" / f"checkpoint-{step}"
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
        home, saved = load_file(run / "adapter_model.safetensors"), load_file(ckpt / "adapter_model.safetensors")
        assert home.keys() == saved.keys() and all((home[k] == saved[k]).all() for k in home)
        # the summary says it, and the job ended once: no requeue
        assert re.search(rf"cost cap\s+stopped by --max-cost \${cap:.2f} at step {step} of {max_steps} "
                         r"\(checkpoint saved, its adapters brought home\): \$\d+\.\d\d spent; the full run "
                         r"would have cost ~\$\d+\.\d\d", out), out
        log = (run / "job.log").read_text()
        assert [json.loads(x)["restart"] for x in re.findall(r"^SLURM_GPU_JOB (\{.*\})$", log, re.M)] == [0], log
        assert "requeue" not in log
