"""benchmarks/bench_train.py: its profile summary (GPU busy time and time by kind of kernel, from profiler
events made by hand, named as an H200 profile of the packed path names them) and a tiny run on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from benchmarks.bench_train import kernel_summary  # noqa: E402


def kernel(name: str, start: float, end: float):  # times in units of 10 us (the profiler's are us)
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start * 10, end=end * 10))


def test_kernels_by_kind_first_match_wins():
    """Inductor's kernels name their fused ops ("_to_copy" among them): they are Inductor's, not copies;
    flash attention's CUTLASS kernels are attention, not matmuls; overlapping kernels count once as busy."""
    events = [kernel("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 0, 100),
              kernel("triton_red_fused__to_copy_mean_mul_native_dropout_pow_rsqrt_0", 100, 130),
              kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bfloat16_t>>",
                     120, 160),
              kernel("Memcpy HtoD (Pinned -> Device)", 200, 210),
              kernel("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 210, 215),
              kernel("void at::native::reduce_kernel<128, 4>", 215, 220),
              kernel("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", 220, 225),
              SimpleNamespace(name="cudaLaunchKernel", device_type=torch.autograd.DeviceType.CPU,
                              time_range=SimpleNamespace(start=0, end=7))]  # us
    prof = SimpleNamespace(events=lambda: events)
    summary = kernel_summary(prof, steps=1, wall=3e-3)
    assert summary["gpu_ms_per_step_by_kind"] == {"gemm": 1.0, "flash_attention (varlen)": 0.4,
                                                  "triton (Inductor fused)": 0.3, "copy/fill": 0.15,
                                                  "other": 0.05, "optimizer": 0.05}
    assert summary["gpu_busy_ms_per_step"] == pytest.approx(1.85)  # 0-160 and 200-225
    assert summary["kernels_per_step"] == 7 and summary["cpu_ms_per_step"] == {"cudaLaunchKernel": 0.01}  # 7 us


def test_tiny_benchmark_runs_each_recipe_at_its_own_logging(capsys):
    """The benchmark end to end on CPU (tiny Qwen3): the seed recipe logs as the seed's script (every 10
    steps), the project's as its config (every step: what fab train runs); a bad --logging-steps is refused."""
    from benchmarks import bench_train

    results = bench_train.main(["--device", "cpu", "--tiny", "--workloads", "alpaca-102", "--recipes", "seed,project",
                                "--examples", "32", "--seed-steps", "3", "--project-steps", "3", "--warmup-steps", "1",
                                "--no-write"])
    rows = {r["recipe"]: r for r in results["rows"]}
    assert rows["seed"]["logging_steps"] == 10 and rows["project"]["logging_steps"] == 1
    assert all(r["steps"] == 3 and r["tokens_per_s"] > 0 and "error" not in r for r in rows.values())
    assert rows["project"]["mean_token_accuracy"] is not None  # logged every step
    with pytest.raises(SystemExit):
        bench_train.main(["--device", "cpu", "--tiny", "--logging-steps", "0", "--no-write"])
    assert "--logging-steps 0: log every N >= 1 steps" in capsys.readouterr().err
