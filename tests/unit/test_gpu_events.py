"""The nodes' GPU telemetry (the job script's nvidia-smi samples) as TensorBoard events, read back by
tensorboard's own reader; none at all where there are no samples (the local cluster's stand-in GPUs)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ops.finetune import gpu_events

# What `nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits
# -l 5` appends on a node (jobs/finetune.sbatch.j2): one line per GPU per sample, "[N/A]" where a field has no
# reading, and a last line the end of the job cut short.
NODE_01 = ("2026/12/06 10:00:00.120, 0, 90, 20480, 250.50\n2026/12/06 10:00:00.121, 1, 70, 10240, 200.00\n"
           "2026/12/06 10:00:05.130, 0, 100, 20500, 260.25\n2026/12/06 10:00:05.131, 1, [N/A], 10240, 200.00\n"
           "2026/12/06 10:00:10.140, 0, 95, 20510, 255.00\n2026/12/06 10:00:10.141, 1, 60, 10250, 190.00\n2026/12/0")
NODE_02 = "2026/12/06 10:00:02.500, 0, 40, 4096, 100.00\n2026/12/06 10:00:07.500, 0, 45, 4100, 110.00\n"


def _read(directory):
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return acc


def test_gpu_samples_become_tensorboard_events_per_node_and_gpu(tmp_path):
    (tmp_path / "tensorboard").mkdir()  # the training's own events (report_to tensorboard) live here
    (tmp_path / "gpus-gpu-node-01.csv").write_text(NODE_01)
    (tmp_path / "gpus-gpu-node-02.csv").write_text(NODE_02)
    out = gpu_events.write(tmp_path)
    assert out == tmp_path / "tensorboard" / "gpus"
    acc = _read(out)
    want = {f"{metric}/{node}/gpu{i}" for metric in ("gpu_utilization_pct", "gpu_memory_used_mib", "gpu_power_w")
            for node, i in (("gpu-node-01", 0), ("gpu-node-01", 1), ("gpu-node-02", 0))}
    assert set(acc.Tags()["scalars"]) == want
    util = acc.Scalars("gpu_utilization_pct/gpu-node-01/gpu0")
    assert [(e.step, e.value) for e in util] == [(0, 90.0), (5, 100.0), (10, 95.0)]  # seconds since the first sample
    assert [e.value for e in acc.Scalars("gpu_utilization_pct/gpu-node-01/gpu1")] == [70.0, 60.0]  # [N/A] skipped
    assert [e.step for e in acc.Scalars("gpu_memory_used_mib/gpu-node-02/gpu0")] == [2, 7]  # one clock for all nodes
    assert acc.Scalars("gpu_power_w/gpu-node-01/gpu0")[1].value == pytest.approx(260.25)
    first = datetime(2026, 12, 6, 10, 0, 0, 120000, tzinfo=UTC).timestamp()  # the sampler runs under TZ=UTC
    assert util[0].wall_time == pytest.approx(first, abs=1e-3)
    # brought home again: written afresh, not twice
    gpu_events.write(tmp_path)
    assert len(list(out.glob("events.out.tfevents.*"))) == 1
    assert len(_read(out).Scalars("gpu_utilization_pct/gpu-node-01/gpu0")) == 3


def test_no_samples_no_gpu_events(tmp_path):
    (tmp_path / "tensorboard").mkdir()
    assert gpu_events.write(tmp_path) is None  # the stand-in GPUs: no nvidia-smi, no gpus-*.csv
    assert not (tmp_path / "tensorboard" / "gpus").exists()
    assert _read(tmp_path / "tensorboard").Tags()["scalars"] == []
    (tmp_path / "gpus-gpu-node-01.csv").write_text("")  # a sampler that never got a reading
    assert gpu_events.write(tmp_path) is None and not (tmp_path / "tensorboard" / "gpus").exists()
