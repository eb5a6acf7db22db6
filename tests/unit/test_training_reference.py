"""The same losses and adapters on CPU before and after a change to training/: a tiny deterministic run of
training/train.py (the tiny Qwen3, fp32, one process), on the packed path and on the padded one, is held
against tests/data/training_reference.json.

That file was produced by the code as it stood before the fast path was split into training/fastpath/
(commit 8c20cc9, when it was one module, packing.py), by running this test with SLURM_GPU_WRITE_REFERENCE=1. A change that
means to alter the numbers (a new recipe, a new tiny model) regenerates it the same way and says why in its
commit; a refactor must leave it as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.test_training_run import argv_for
from training import train
from training.make_tiny import make_tiny

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "training_reference.json"
WRITE = os.environ.get("SLURM_GPU_WRITE_REFERENCE") == "1"
# 32 rows at 4 per step: 8 optimizer steps; a checkpoint at step 5 exercises the save path in between.
ROWS = 32
PATHS = {"packed": ["--flex_packing", "true"], "padded": ["--flex_packing", "false"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"), examples=ROWS, seed=0)


def adapter_summary(out: Path) -> dict[str, list[float]]:
    """Per adapter tensor: sum, sum of absolute values, sum of squares, first and last element (float64)."""
    from safetensors.torch import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    summary = {}
    for name in sorted(tensors):
        t = tensors[name].double().flatten()
        summary[name] = [t.sum().item(), t.abs().sum().item(), (t * t).sum().item(), t[0].item(), t[-1].item()]
    return summary


def run(tiny, out: Path, path: str) -> dict:
    metrics = train.main(argv_for(tiny, out, "--save_steps", "5", *PATHS[path]))
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    norms = [h["grad_norm"] for h in metrics["log_history"] if "grad_norm" in h]
    return {"steps": metrics["train_steps"], "losses": losses, "grad_norms": norms,
            "train_loss": metrics["train_loss"], "adapters": adapter_summary(out)}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_losses_and_adapters_match_the_reference(tiny, tmp_path, path):
    got = run(tiny, tmp_path / path, path)
    assert got["steps"] == ROWS // 4
    if WRITE:
        reference = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
        reference[path] = got
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
        return
    want = json.loads(REFERENCE.read_text())[path]
    assert got["steps"] == want["steps"]
    # fp32 on CPU, same seeds and order: equal to rounding (a different summation order moves the last bits).
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-7)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4, abs=1e-7)
    assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert sorted(got["adapters"]) == sorted(want["adapters"])
    for name, stats in want["adapters"].items():
        assert got["adapters"][name] == pytest.approx(stats, rel=1e-4, abs=1e-6), name
