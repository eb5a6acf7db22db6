"""training/checkpoints.py on CPU with the tiny Qwen3: a checkpoint written by the background thread
holds exactly what the Trainer's own would at that step, even while training runs on during the write; a
writer's error fails the run and leaves no complete-looking checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.unit.test_training_run import argv_for
from training import train
from training.make_tiny import make_tiny

STEPS = ["--max_steps", "7", "--save_steps", "2", "--save_total_limit", "5", "--lora_dropout", "0.1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"), examples=48, seed=0)


def run(tiny, out, monkeypatch, background: bool) -> dict:
    return train.main(argv_for(tiny, out, *STEPS, "--background_checkpoints", str(background).lower()))


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_background_checkpoints_match_the_trainers_while_training_runs_on(tiny, tmp_path, monkeypatch):
    own = tmp_path / "own"
    assert run(tiny, own, monkeypatch, background=False)["train_steps"] == 7

    # A slow writer: it writes only once training has gone on past the checkpoint's step (changing the
    # adapters and the optimizer state meanwhile), so a write that blocked training would show. It waits
    # for the step, not for a time: a loaded machine's slow steps cannot make the writer come too early.
    seen = []  # (the checkpoint's step, the training thread's step when the writer wrote it)
    real_build = train.build_trainer

    def build(*a, **k):
        trainer = real_build(*a, **k)
        inner = trainer._save

        def slow(output_dir, *args, **kwargs):
            name = Path(output_dir).name  # checkpoint-N, or the run's own directory at the end
            step = int(name.split("-")[1]) if name.startswith("checkpoint-") else None
            deadline = time.monotonic() + 120  # a blocking write never sees training move: it ends here
            while step is not None and trainer.state.global_step <= step and time.monotonic() < deadline:
                time.sleep(0.05)
            seen.append((step, trainer.state.global_step))
            return inner(output_dir, *args, **kwargs)

        trainer._save = slow
        return trainer

    monkeypatch.setattr(train, "build_trainer", build)
    bg = tmp_path / "bg"
    metrics = run(tiny, bg, monkeypatch, background=True)
    assert metrics["train_steps"] == 7 and metrics["checkpoints_saved"] == 3
    assert [c for c, _ in seen[:3]] == [2, 4, 6], seen  # then the final adapters (step 7)
    assert any(now > c for c, now in seen[:3]), seen  # training ran on while a checkpoint was written

    names = sorted(p.name for p in own.glob("checkpoint-*"))
    assert names == sorted(p.name for p in bg.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name in names:
        a, b = own / name, bg / name
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()), name
        assert_same(load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors"), name)
        for f in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert_same(load(a / f), load(b / f), f"{name}/{f}")
        assert json.loads((a / "trainer_state.json").read_text()) == json.loads((b / "trainer_state.json").read_text())
        assert (a / "adapter_config.json").read_text() == (b / "adapter_config.json").read_text()
    # And the same run: the final adapters and every logged loss.
    assert_same(load_file(own / "adapter_model.safetensors"), load_file(bg / "adapter_model.safetensors"), "final")
    logs = [[h for h in json.loads((d / "trainer_state.json").read_text())["log_history"] if "loss" in h]
            for d in (own, bg)]
    assert len(logs[0]) == 7 and logs[0] == logs[1]


def test_a_writer_error_fails_the_run_and_leaves_no_complete_checkpoint(tiny, tmp_path, monkeypatch):
    real_build = train.build_trainer

    def build(*a, **k):
        trainer = real_build(*a, **k)

        def broken(*args, **kwargs):
            raise OSError("disk full (injected)")

        trainer._save = broken
        return trainer

    monkeypatch.setattr(train, "build_trainer", build)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        run(tiny, out, monkeypatch, background=True)
    assert not list(out.glob("checkpoint-*/trainer_state.json"))
    assert train.find_resume_checkpoint(str(out)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the benchmark device)")
def test_the_writer_does_not_disturb_a_graph_capture(tmp_path):
    """The writer's work (torch.save and safetensors of host tensors, JSON) runs while the training thread
    captures CUDA graphs in the default (global) capture mode, which fails a capture if any thread makes a
    CUDA call it forbids: every capture succeeds and replays what the eager step computes."""
    import threading

    from safetensors.torch import save_file

    host = {f"w{i}": torch.randn(1024, 1024) for i in range(12)}  # ~50 MB, like a checkpoint's pieces
    stop, errors, writes = threading.Event(), [], [0]

    def writer():
        try:
            while not stop.is_set():
                torch.save(host, tmp_path / "optimizer.pt")
                save_file(host, str(tmp_path / "adapter_model.safetensors"))
                (tmp_path / "trainer_state.json").write_text(json.dumps({"step": writes[0]}))
                writes[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    side = torch.cuda.Stream()
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(30):
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph.capture_begin()
                y = torch.relu(x @ w).sum(dim=0)
                graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            graph.replay()
            torch.testing.assert_close(y, torch.relu(x @ w).sum(dim=0))
    finally:
        stop.set()
        thread.join()
    assert not errors and writes[0] > 0, (errors, writes)
