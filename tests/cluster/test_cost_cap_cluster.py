"""`fab train --max-cost` on the real local cluster: a cap the estimate fits, a run slower than the
estimate, and the job stops with a checkpoint before the cap instead of training to the end.

The local cluster is priced at its stand-in rate per node (ops/data/local.json). Its estimate knows
make_tiny's 2-layer model; this run trains a wider, deeper one on the same rows (as a run on AWS with
a model bigger than the estimate assumed), so its steps take many times longer than estimated. The cap
is the estimate's cost: `fab train` accepts it, and the run reaches it during training. Where it
stops depends on how fast the phases before training ran against the estimate's calibration (on the
2-core CI machine, with 4 examples a step: step 1 under load; steps 17-18 of 25 with the cap 5-10 s
of cluster time above the estimate): 2 examples a step give twice the steps, so a run whose early
phases are quick still reaches the cap well before its last step (measured: step 13 of 50). No held-out rows and no samples: the time before training stays near the
estimate's, so the stop falls among the steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from ops.actions import options
from ops.cost import cap as cost_cap
from ops.cost import estimate as est
from tests.support.local_cluster import fresh_cluster

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def wider_model(out: Path) -> tuple[Path, Path]:
    """make_tiny's rows and tokenizer with a 6-layer, 768-wide Qwen3 (some 500x the tiny model's compute)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from training.make_tiny import make_tiny

    model_dir, data = make_tiny(out)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=768, intermediate_size=3072, num_hidden_layers=6,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    return model_dir, data


def test_cap_stops_the_run_with_a_checkpoint_and_brings_its_adapters_home(tmp_path):
    from safetensors.torch import load_file

    from localcluster import topology as layout

    with fresh_cluster(nodes=2, gpus=2) as (inv, job_dirs):
        wider_model(layout.SCRATCH / "captest")
        job_dirs.append("/scratch/captest")
        model, data = "/scratch/captest/model", "/scratch/captest/data/train.jsonl"
        config = tmp_path / "cap.yaml"
        tiny = (REPO / "training" / "configs" / "local-tiny.yaml").read_text()
        for key, value in (("samples", 0), ("eval_split", 0), ("per_device_train_batch_size", 2)):
            tiny = re.sub(rf"(?m)^{key}: .*$", f"{key}: {value}", tiny)
        config.write_text(tiny)
        opts = options.parse(target="local", config=str(config), model=model, data=data)
        plan = est.for_run(opts, inv)
        cap = math.ceil(cost_cap.run_cost(plan, "first") * 1000) / 1000  # the estimate, to a tenth of a cent

        env = {**os.environ, "SLURM_GPU_RUNS": str(tmp_path)}
        res = subprocess.run([FAB, "train", "--target", "local", "--config", str(config), "--model", model, "--data", data,
                              "--max-cost", str(cap)], cwd=REPO, env=env,
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
