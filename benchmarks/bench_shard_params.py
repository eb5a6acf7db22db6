"""Per-rank parameter bytes of the sharded model (training/sharding.py) against the memory model's prediction.

Shards the tiny Qwen3 (training/make_tiny.py; float32, LoRA r16 on q/k/v/o as training/configs/local-tiny.yaml)
over N CPU ranks with gloo, exactly as a sharded run does (`sharding.shard` after PEFT's wrap), and records
each rank's bytes: its parameters' local shards, any unsharded parameter, and its buffers. The prediction is
training/memory_model.py's: (base + adapters) x bytes / N (`base_weights` and the adapters' weights of
`lora_state`) plus the parts every rank keeps whole (`replicated_bytes`: the rotary tables). Issue 43 item 3
asks each rank to be within 10% of it. Runs the same on a GPU machine (`--device cuda`, NCCL).

    python -m benchmarks.bench_shard_params --ranks 4 --out FILE.json   # a JSON result, as BENCHMARKS.md cites
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def worker(model_dir: str, out: str, device: str) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from training import memory_model as mm
    from training import sharding

    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model.to(device), LoraConfig(task_type="CAUSAL_LM", **LORA))
    whole = {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
             "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}
    sharding.shard(model, world)
    mine = sharding.local_bytes(model)
    mine["total"] = mine["sharded"] + mine["replicated"] + mine["buffers"]
    ranks = [None] * world
    dist.all_gather_object(ranks, {"rank": rank, **mine})
    if rank == 0:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        base = mm.parameter_count(config) * 4
        adapters = mm.lora_parameters(config, LORA["r"], LORA["target_modules"]) * 4
        replicated = mm.replicated_bytes(config)
        predicted = (base + adapters) / world + replicated
        for r in ranks:
            r["error"] = r["total"] / predicted - 1
        result = {
            "benchmark": "shard-params", "gpu": "none (CPU ranks, gloo)" if device == "cpu" else
            torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "world_size": world,
            "device": device, "torch": torch.__version__, "model": "tiny Qwen3 (training/make_tiny.py), float32",
            "lora": LORA, "measured_whole": whole,
            "predicted": {"base_bytes": base, "adapter_bytes": adapters, "replicated_bytes": replicated,
                          "per_rank_bytes": predicted,
                          "formula": "(base + adapters) x 4 bytes / world + replicated (memory_model)"},
            "ranks": ranks, "max_abs_error": max(abs(r["error"]) for r in ranks),
            "within_10_percent": all(abs(r["error"]) <= 0.10 for r in ranks)}
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("world_size", "max_abs_error", "within_10_percent")}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", help="a model directory (default: a fresh tiny Qwen3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model, args.out, args.device)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if not model:
            from training.make_tiny import make_tiny

            model = str(make_tiny(Path(tmp), examples=8, seed=0)[0])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               "-m", "benchmarks.bench_shard_params", "--worker", "--model", model, "--out",
               str(Path(args.out).resolve()), "--device", args.device]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
