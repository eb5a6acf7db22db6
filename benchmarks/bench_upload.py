"""Upload benchmark: a generated JSONL of --size-gb uploaded by `fab train --data FILE`'s own code
(ops/finetune/upload.py: prepare, then ensure_on_cluster) to a running cluster's scratch; records this side's
peak memory (the issue's bound: under 256 MB for a 1 GB file), the hashing and upload rates, and that a second
run of the same file uploads nothing.

    fab local.up --nodes 1 --gpus 1            # (root) or any cluster fab reaches: --target aws
    python -m benchmarks.bench_upload --size-gb 1 --out upload.json

The peak is this process's own high-water resident set (/proc/self/status VmHWM): Python, fab's imports and
the upload together. Not getrusage's maxrss: Linux keeps that across execve, so a benchmark started from a
large process (pytest with torch imported) would report its parent's peak. The generated file and its copy on
the cluster are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ops.actions.options import parse_cluster
from ops.finetune import upload
from ops.ssh.remote import connect_file, open_cluster

LIMIT_MB = 256


def generate(path: Path, size: int) -> int:
    """A JSONL of Alpaca rows of about `size` bytes, written a block of 1000 rows at a time; its row count."""
    row = '{"instruction": "Repeat the number %d in words.", "input": "", "output": "%s"}\n'
    rows, written = 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < size:
            block = "".join(row % (n, f"The number is {n}. " * 8) for n in range(rows, rows + 1000))
            f.write(block)
            rows, written = rows + 1000, written + len(block)
    return rows


def peak_mb() -> float:
    """This process image's peak resident set in MB (VmHWM: kB, per address space, so new at exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no /proc: Linux's KiB, kept across exec


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@contextmanager
def _cluster(args):
    if not args.inventory:
        with open_cluster(parse_cluster(target=args.target, stack=args.stack)) as cl:
            yield cl
        return
    cl = connect_file(args.inventory, args.identity, args.port)
    try:
        yield cl
    finally:
        cl.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--target", default="local")
    ap.add_argument("--stack", default=None)
    ap.add_argument("--inventory", default=None, help="an inventory JSON file instead of --target (a loopback sshd)")
    ap.add_argument("--port", type=int, default=None, help="with --inventory: the controller's SSH port")
    ap.add_argument("--identity", default=None, help="with --inventory: the SSH private key")
    ap.add_argument("--scratch", default=None, help="the shared folder to upload under (default: the inventory's)")
    ap.add_argument("--dir", default=None, help="where to write the generated file (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-upload-", dir=args.dir))
    path = work / "bench.jsonl"
    try:
        with _cluster(args) as cl:
            inv = cl.inventory
            scratch = args.scratch or inv.scratch
            rows = generate(path, int(args.size_gb * 1e9))
            before = peak_mb()  # imports done, file written
            t0 = time.monotonic()
            local = upload.prepare(path)
            t_prepare = time.monotonic() - t0
            lines: list[str] = []
            t0 = time.monotonic()
            remote, uploaded = upload.ensure_on_cluster(cl.controller, scratch, local, lines.append)
            t_upload = time.monotonic() - t0
            t0 = time.monotonic()
            _, again = upload.ensure_on_cluster(cl.controller, scratch, local, lines.append)
            t_again = time.monotonic() - t0
            peak = peak_mb()
            cl.controller.run(f"rm -rf {shlex.quote(remote.rsplit('/', 1)[0])}", hide=True, warn=True, in_stream=False)
    finally:
        path.unlink(missing_ok=True)
        work.rmdir()
    result = {
        "benchmark": "upload", "date": time.strftime("%Y-%m-%d"),
        "target": "loopback sshd" if args.inventory else inv.target,
        "gpu": "none (no GPU takes part: the user's side and the controller)",
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release()},
        "bytes": local.size, "rows": local.rows, "rows_written": rows, "sha256": local.sha256,
        "prepare_s": round(t_prepare, 2), "hash_and_count_mb_s": round(local.size / t_prepare / 1e6, 1),
        "upload_s": round(t_upload, 2), "upload_mb_s": round(local.size / t_upload / 1e6, 1),
        "uploaded_first": uploaded, "uploaded_second": again, "second_run_s": round(t_again, 2),
        "peak_rss_mb_before": round(before, 1), "peak_rss_mb": round(peak, 1), "limit_mb": LIMIT_MB,
        "fab_lines": lines,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = peak < LIMIT_MB and uploaded and not again
    if not ok:
        print(f"FAILED: peak {peak:.0f} MB (limit {LIMIT_MB}), uploaded first {uploaded}, second {again}",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
