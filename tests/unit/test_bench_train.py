"""benchmarks/bench_train.py: its profile summary (GPU busy time and time by kind of kernel, from profiler
events made by hand, named as an H200 profile of the packed path names them) and a tiny run on CPU."""

from __future__ import annotations

from pathlib import Path
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


def test_tiny_benchmark_runs_each_recipe_at_its_own_logging(capsys, monkeypatch):
    """The benchmark end to end on CPU (tiny Qwen3): the baseline recipe logs as the baseline's script (every 10
    steps), the project's as its config (every step: what fab train runs); a bad --logging-steps is refused;
    the results name the knobs the run was given from the environment."""
    from benchmarks import bench_train

    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "1")
    monkeypatch.delenv("TORCH_BLAS_PREFER_CUBLASLT", raising=False)

    results = bench_train.main(["--device", "cpu", "--tiny", "--workloads", "alpaca-102", "--recipes", "baseline,project",
                                "--examples", "32", "--baseline-steps", "3", "--project-steps", "3", "--warmup-steps", "1",
                                "--no-write"])
    rows = {r["recipe"]: r for r in results["rows"]}
    assert rows["baseline"]["logging_steps"] == 10 and rows["project"]["logging_steps"] == 1
    assert all(r["steps"] == 3 and r["tokens_per_s"] > 0 and "error" not in r for r in rows.values())
    assert rows["project"]["mean_token_accuracy"] is not None  # logged every step
    env = results["environment"]
    assert env["TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"] == "1"
    # The trainer's switches are settings now: each row records the run's choices and who made them.
    assert rows["project"]["choices"]["path"]["value"] == "packed"
    assert rows["project"]["choices"]["activation_checkpointing"]["value"] is False
    assert rows["baseline"]["choices"]["activation_checkpointing"] == {"value": True, "by": "config"}
    assert "TORCH_BLAS_PREFER_CUBLASLT" not in env and "HOME" not in env
    with pytest.raises(SystemExit):
        bench_train.main(["--device", "cpu", "--tiny", "--logging-steps", "0", "--no-write"])
    assert "--logging-steps 0: log every N >= 1 steps" in capsys.readouterr().err


def test_node_bytecode_compiles_what_a_run_imports_without_bytecode(tmp_path):
    """An image without bytecode (PYTHONDONTWRITEBYTECODE=1, sources only) recompiles each import in every
    process; ensure_bytecode finds those modules and compiles their package in place, as pip does on a node."""
    import os
    import sys

    from benchmarks.node_bytecode import ensure_bytecode, probe

    pkg = tmp_path / "site" / "pkgx"
    (pkg / "inner").mkdir(parents=True)
    for f in (pkg / "__init__.py", pkg / "inner" / "__init__.py", pkg / "inner" / "mod.py", pkg / "unused.py"):
        f.write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path / "site")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    code = "import pkgx.inner.mod\n"
    ours = {str(pkg / "__init__.py"), str(pkg / "inner" / "__init__.py"), str(pkg / "inner" / "mod.py")}
    assert ours <= set(probe(code, env, tmp_path)["missing"])  # and the probe itself wrote none
    assert ours <= set(probe(code, env, tmp_path)["missing"])

    done = ensure_bytecode(code, env, tmp_path)
    assert "pkgx" in done["compiled"] and done["missing_before"] >= 3 and done["missing_after"] == 0, done
    assert not ours & set(probe(code, env, tmp_path)["missing"])
    assert list((pkg / "__pycache__").glob(f"unused.*{sys.implementation.cache_tag}*.pyc"))  # the whole package
    again = ensure_bytecode(code, env, tmp_path)
    assert again["compiled"] == [] and again["missing_before"] == 0


def test_time_to_adapters_on_cpu(tmp_path, monkeypatch):
    """The time-to-adapters run end to end (tiny Qwen3, CPU): `python -m training.train` with the baseline's
    config on Alpaca-length rows, its phases in order, the checkpoints it wrote, a cProfile summary."""
    from benchmarks import bench_train

    monkeypatch.delenv("OUT", raising=False)
    results = bench_train.main(["--device", "cpu", "--tiny", "--time-to-adapters", str(tmp_path), "--tta-rows", "64",
                                "--tta-runs", "warm", "--tta-profile", "--no-write"])
    assert results["bytecode"]["missing_after"] == 0
    (row,) = results["time_to_adapters"]
    assert row["rc"] == 0 and row["train_steps"] == 4  # 64 rows, 16 a step
    phases = list(row["phases_s"].values())
    assert phases == sorted(phases) and list(row["phases_s"])[-1] == "adapters_written"
    assert 0 < row["time_to_adapters_s"] == results["time_to_adapters_warm_s"] <= row["process_wall_s"]
    assert row["checkpoints_saved"] == 0  # save_steps 5, and none at the last step
    assert "training/train.py" in Path(row["profile"]).read_text()
    assert (tmp_path / "out-warm" / "adapter_model.safetensors").exists()
