"""Byte-compiled imports for the time-to-adapters runs, as on a GPU node.

A node installs the training stack with pip (bootstrap's step_training), which byte-compiles every module at
install time, so each job's imports only load bytecode. Some images ship sources only and set
PYTHONDONTWRITEBYTECODE=1 (the GPU machines of BENCHMARKS.md): there every process compiles each
module it imports from source, again and again, which would be timed as the run's own. So before timing,
`ensure_bytecode` finds the modules a run imports that have no bytecode and compiles their packages in
place, as pip would have, and says what it did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

# What `python -m training.train` imports before its first step (the modules loaded later, Qwen3's and the
# optimizer's among them, are in the same packages, and whole packages are compiled).
RUN_IMPORTS = ("import training.train, training.fastpath.trainer, trl, peft, datasets, accelerate\n"
               "from transformers import AutoModelForCausalLM, AutoTokenizer\n")

_PROBE = """
import importlib.util, json, os, sys
files = sorted({f for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))
                and f.endswith(".py") and os.path.isabs(f) and os.path.isfile(f)})
print(json.dumps({"files": len(files),
                  "missing": [f for f in files if not os.path.exists(importlib.util.cache_from_source(f))]}))
"""


def probe(code: str, env: dict, cwd: Path, python: str = sys.executable) -> dict:
    """Run `code` in a fresh interpreter with `env`; the .py files it imported, and those without bytecode
    where that interpreter looks for it (its own PYTHONPYCACHEPREFIX included)."""
    proc = subprocess.run([python, "-c", code + _PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"import probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def package_root(path: str) -> Path:
    """The outermost regular package holding the file (a site-packages entry such as .../torch), or the file
    itself when it is a top-level module."""
    root = Path(path)
    while (root.parent / "__init__.py").exists():
        root = root.parent
    return root


def ensure_bytecode(code: str, env: dict, cwd: Path, python: str = sys.executable) -> dict:
    """Byte-compile, in place, every package holding a module that `code` imports without bytecode.

    Returns what it found and did: modules imported, how many lacked bytecode before and after, and the
    packages compiled. A file that cannot be written (a read-only image) stays missing and is reported."""
    started = time.time()
    before = probe(code, env, cwd, python)
    roots = sorted({str(package_root(f)) for f in before["missing"]})
    if roots:
        # Bytecode is written regardless of PYTHONDONTWRITEBYTECODE: compileall writes it explicitly, as pip does.
        subprocess.run([python, "-m", "compileall", "-q", "-j", "0", *roots], cwd=cwd, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = probe(code, env, cwd, python) if roots else before
    return {"modules": before["files"], "missing_before": len(before["missing"]),
            "missing_after": len(after["missing"]), "compiled": [Path(r).name for r in roots],
            "seconds": round(time.time() - started, 1)}
