"""The multi-GPU scaling benchmark's code path on CPU ranks (gloo), launched with the sbatch template's
torchrun line (benchmarks/bench_scaling.py, tiny Qwen3, 1 and then 2 processes).

What it shows: (1) DDP all-reduces the gradients once per optimizer step and bucket, although each rank's
step runs as several packed micro-batches (the token budget forces the split; no_sync holds back the
others); (2) the 2 ranks see disjoint halves of each step's 16 examples, whose union is the 1-rank run's
step; (3) the 2-rank run trains like the 1-rank run: same losses, gradient norms and LoRA weights (the
loss is normalised over both ranks' tokens). A code-path check: no timing is asserted.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

from benchmarks import bench_scaling  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def rows():
    results = bench_scaling.main([
        "--device", "cpu", "--tiny", "--counts", "1,2", "--examples", "48", "--steps", str(STEPS),
        "--warmup-steps", "1", "--logging-steps", "1", "--token-budget", "128", "--bucket-cap-mb", "0.01",
        "--lora-dropout", "0", "--record-examples", "--no-write",
        "--timeout", "150"])  # ranks hung in a collective fail the test instead of stalling CI
    return {r["gpus"]: r for r in results["rows"]}


def test_ranks_and_global_batch(rows):
    assert sorted(rows) == [1, 2]
    for n, row in rows.items():
        assert row["world_size"] == n and row["backend"] == "gloo"
        assert row["ddp"] is True and row["find_unused_parameters"] is False
        assert row["examples_per_step"] == 16 and row["examples_per_rank_step"] == 16 // n
        assert row["gradient_accumulation"] == 1 and row["steps"] == STEPS
        assert row["nccl_info_lines"] == 0  # CPU: gloo, no NCCL
        assert row["tokens_per_s"] > 0 and row["scaling_efficiency"] > 0
    assert rows[1]["scaling_efficiency"] == 1.0
    assert rows[1]["tokens"] == rows[2]["tokens"]  # the same examples in all


def test_one_allreduce_per_bucket_per_optimizer_step(rows):
    for row in rows.values():
        # every rank's every step ran as several micro-batches: without no_sync, each would all-reduce
        assert all(m >= 2 for rank in row["micro_batches_by_step"] for m in rank), row["micro_batches_by_step"]
        assert len(row["buckets_by_step"]) == STEPS
        for step, (indices, calls) in enumerate(zip(row["buckets_by_step"], row["allreduce_calls_by_step"], strict=False)):
            assert indices == list(range(len(indices))), (step, indices)  # each bucket exactly once
            assert calls == len(indices) >= 1
        # DDP re-buckets after its first step; from then on the small bucket cap gives several buckets
        assert all(len(b) == row["allreduce_buckets"] >= 2 for b in row["buckets_by_step"][1:])
        assert row["allreduce_calls"] == sum(len(b) for b in row["buckets_by_step"])
        assert len(set(row["allreduce_calls_per_rank"])) == 1
        assert row["allreduce_ms_per_step"] is not None


def test_ranks_split_each_step_of_the_single_rank_run(rows):
    single = rows[1]["examples_by_rank_step"]
    pair = rows[2]["examples_by_rank_step"]
    assert len(single) == 1 and len(pair) == 2
    seen = set()
    for step in range(STEPS):
        whole = single[0][step]
        a, b = pair[0][step], pair[1][step]
        assert len(whole) == len(set(whole)) == 16
        assert len(a) == len(b) == 8
        assert not set(a) & set(b)
        assert set(a) | set(b) == set(whole)
        assert not seen & set(whole)  # no example twice in the epoch
        seen |= set(whole)


def test_two_ranks_train_like_one(rows):
    one, two = rows[1], rows[2]
    assert len(one["losses"]) == len(two["losses"]) == STEPS
    for a, b in zip(one["losses"] + one["grad_norms"], two["losses"] + two["grad_norms"], strict=False):
        assert b == pytest.approx(a, rel=1e-4)
    assert len(one["grad_norms"]) == STEPS
    assert two["lora_B_abs_sum"][0] == two["lora_B_abs_sum"][1]  # DDP keeps the replicas equal
    assert two["lora_B_abs_sum"][0] == pytest.approx(one["lora_B_abs_sum"][0], rel=1e-4)
    assert one["lora_B_abs_sum"][0] > 0


def test_launch_line_is_the_sbatch_templates():
    """The benchmark launches torchrun with the same options as jobs/finetune.sbatch.j2 renders for
    AWS and the local cluster (one node here)."""
    from tests.unit.test_jobs_render import finetune, inventory

    cmd = bench_scaling.torchrun_command(2, 29500, ["--tiny"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    ours = cmd[3:cmd.index("benchmarks.bench_scaling") - 1]
    for target in ("aws", "local"):
        script = finetune(inventory(target))
        launch = script[script.index("-m torch.distributed.run"):script.index("-m training.train")]
        assert {f.split("=")[0] for f in ours} == set(re.findall(r"(--[a-z_]+)=", launch)), target
    assert "--nnodes=1" in ours and "--nproc_per_node=2" in ours and "--rdzv_backend=c10d" in ours
    assert "--rdzv_endpoint=127.0.0.1:29500" in ours and "--max_restarts=0" in ours


def test_counts_must_divide_the_global_batch_and_fit_the_gpus():
    assert bench_scaling.parse_counts("8,1,2,4", None) == [1, 2, 4, 8]
    assert bench_scaling.parse_counts("1,2,4,8", 2) == [1, 2]  # capped by the GPUs visible
    for bad, gpus in (("3", None), ("0,1", None), ("1,x", None), ("4,8", 2)):
        with pytest.raises(SystemExit):
            bench_scaling.parse_counts(bad, gpus)


def test_fold_sums_ranks_over_the_slowest_rank():
    from ops.actions import nccl

    def rank(tokens, time_s, ms):
        return {"world_size": 2, "distributed_type": "MULTI_GPU", "backend": "nccl", "ddp": True,
                "find_unused_parameters": False, "examples_per_rank_step": 8, "gradient_accumulation": 1,
                "steps": 10, "compiled_layers": 36, "tokens": tokens + 100, "runtime_s": time_s + 1.0,
                "steady": {"steps": 5, "tokens": tokens, "time_s": time_s}, "allreduce_calls": 20,
                "allreduce_calls_by_step": [2] * 10, "buckets_by_step": [[0, 1]] * 10, "bucket_numel": [[0, 5], [1, 5]],
                "allreduce_ms_per_step": ms, "allreduce_last_bucket_ms_per_step": ms / 2, "other_collectives": {},
                "other_collectives_by_step": [{}] * 10, "micro_batches_by_step": [1] * 10, "losses": [2.0],
                "grad_norms": [1.0], "train_loss": 2.0, "peak_mem_gib": 30.0, "examples_by_step": None}

    log = ["host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
           "host:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read"]
    row = bench_scaling.fold(2, [rank(1000, 2.0, 3.0), rank(1200, 2.5, 4.0)], nccl.parse(log), 9.0)
    assert row["tokens_per_s"] == pytest.approx(2200 / 2.5)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(2200 / 2.5 / 2)
    assert row["examples_per_step"] == 16 and row["allreduce_buckets"] == 2
    assert row["allreduce_ms_per_step"] == 4.0 and row["step_ms"] == pytest.approx(500.0)
    assert row["nccl_links"] == {"P2P/CUMEM": 2} and "2 links inside a node" in row["nccl_transport"]


_WORKER_PROBE = """
import os, sys
sys.path.insert(0, os.getcwd())
from benchmarks import bench_scaling
bench_scaling.main(sys.argv[1:])
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
# one line, one write: both ranks share torchrun's stdout, and print() writes each piece on its own
os.write(1, f"rank {os.environ['RANK']} gloo threads {sum(n.startswith(('pt_gloo', 'gloo_')) for n in names)}\\n".encode())
"""


def test_worker_ranks_keep_no_gloo_thread_after_the_run(tmp_path):
    """A worker rank's entry point tears its process group down: no gloo thread is left to abort the rank
    at interpreter exit ("terminate called without an active exception", SIGABRT), as CI once saw."""
    import os
    import subprocess

    probe = tmp_path / "probe.py"
    probe.write_text(_WORKER_PROBE)
    cmd = bench_scaling.torchrun_command(2, bench_scaling.free_port(), [])[:-3] + [
        str(probe), "--worker", "--device", "cpu", "--tiny", "--global-batch", "4", "--examples", "8",
        "--steps", "1", "--warmup-steps", "0", "--logging-steps", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=bench_scaling.REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = sorted(re.findall(r"^rank (\d) gloo threads (\d+)$", proc.stdout, re.M))
    assert counts == [("0", "0"), ("1", "0")], proc.stdout[-3000:]
