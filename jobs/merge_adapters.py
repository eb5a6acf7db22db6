"""A run's LoRA adapters merged into its base model's weights, rendered into a folder that plain
`transformers` (AutoModelForCausalLM.from_pretrained) and vLLM load without this project: bf16
safetensors (sharded as transformers' save_pretrained does), config.json, generation_config.json, the
tokenizer with its chat template, and the model card README.md that `fab merge` wrote.

Run by jobs/merge.sbatch.j2 on one GPU node, uploaded beside it (as allreduce_check.py is): the training
code of the run's own job folder may be older than this checkout. Offline: the base model is the copy on
/scratch that the run trained on (adapter_config.json's base_model_name_or_path).

The merge is peft's `merge_and_unload()`: W' = W + scale * B @ A per adapted layer (peft/tuners/lora/
layer.py `get_delta_weight`, computed in fp32 on a CPU and rounded to the weights' dtype once), then the
bare transformers model is saved. The last line printed is `MERGED {json}`: the files and their bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

MARKER = "MERGED "
# Files of a tokenizer as save_pretrained writes them: taken from the run's output (the tokenizer the run
# trained with) when it holds one, else from the base model's folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def merge(adapters: Path, out: Path, readme: Path) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((adapters / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.startswith("/") or not Path(base).is_dir():
        raise SystemExit(f"merge: the run's adapter_config.json names base model {base!r}, not a folder on this "
                         "node: the base model the run trained on is gone from /scratch (run `fab train` again)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, str(adapters)).merge_and_unload()
    model = model.to(torch.bfloat16)  # peft keeps adapter weights in fp32; none are left after the merge
    for name in os.listdir(out):  # a merge again: nothing of an earlier one stays beside this one
        path = out / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    model.save_pretrained(out, safe_serialization=True)
    has_own = all((adapters / f).is_file() for f in TOKENIZER_FILES)
    AutoTokenizer.from_pretrained(str(adapters) if has_own else base).save_pretrained(out)
    shutil.copyfile(readme, out / "README.md")
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    return {"base": base, "dtype": "bfloat16", "files": files, "bytes": sum(files.values())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--adapters", type=Path, required=True, help="the run's output folder (adapter_config.json)")
    ap.add_argument("--out", type=Path, required=True, help="the merged model's folder (emptied first)")
    ap.add_argument("--readme", type=Path, required=True, help="the model card, copied in as README.md")
    args = ap.parse_args(argv)
    result = merge(args.adapters, args.out, args.readme)
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
