"""Fetch a manifest of files into a directory once: resumable, verified, skipped when there.

Runs on a cluster host (the controller, into the shared /scratch) with that host's python3 and
the standard library only: fab uploads this file and runs it (ops/actions/prefetch.py). Reads the
manifest as JSON on stdin:

    {"source": "https://host/base" | "/a/local/dir", "dest": "/scratch/models/x",
     "files": [{"path": "model.safetensors", "size": 123, "sha256": "..." (optional)}]}

Prints one `FETCH {...}` JSON line per progress tick (done, total bytes, rate, seconds left) and
a final `FETCH_DONE {...}`; exits 1 with a `fetch error: ...` line naming the file on failure.
A file is downloaded to `<name>.partial` and continued from its size (HTTP Range) after an
interruption; it is renamed into place only when its size (and sha256, where the manifest gives
one) match. `.complete` records the manifest once every file is in place: then nothing is read.

Every name in the manifest comes from an answer fab does not control (the Hub's file list), so each
must stay inside `dest` (`inside`): no "..", no absolute path, no symbolic link on the way. The same
check guards fab's own downloads (ops/finetune/pipeline.py `download`, ops/actions/prefetch.py): it
lives here because this file must run alone on the controller with the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request

CHUNK = 1 << 20
TICK_S = 0.5


class UnsafeName(ValueError):
    """A name from outside (a listing, an API answer) that would leave the folder it is written to."""


def safe_name(name: object, nested: bool = False) -> str:
    """`name` when joining it to a folder stays inside that folder, else UnsafeName naming it.

    A single name (an SFTP listing's entry): not empty, not "." or "..", no "/" or "\\", no NUL or
    other control character. `nested` (a Hub rfilename such as "data/train.parquet"): relative,
    each "/"-separated part such a name."""
    if not isinstance(name, str) or not name:
        raise UnsafeName(f"{name!r}: not a file name")
    if nested and name.startswith("/"):
        raise UnsafeName(f"{name!r}: an absolute path")
    for part in name.split("/") if nested else [name]:
        if part in ("", ".", ".."):
            raise UnsafeName(f"{name!r}: has an empty, '.' or '..' part")
        if "/" in part or "\\" in part:
            raise UnsafeName(f"{name!r}: a path separator in a single name")
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in part):
            raise UnsafeName(f"{name!r}: a control character in the name")
    return name


def inside(dest: str, rel: object) -> str:
    """dest/rel, when `rel` is a safe nested name (safe_name) and no part of dest/rel that already
    exists is a symbolic link (it could point out of dest); else UnsafeName naming `rel`."""
    path = str(dest)
    for part in safe_name(rel, nested=True).split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            raise UnsafeName(f"{rel!r}: {path} is a symbolic link (it could point out of {dest})")
    return path


def _append_nofollow(path: str):
    """`path` opened to append, created if missing; a symbolic link there is refused (ELOOP), not followed."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "ab")


def _digest(manifest: dict) -> str:
    files = sorted((f["path"], f["size"], f.get("sha256")) for f in manifest["files"])
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


class Progress:
    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.start_done = total, done, done
        self.t0 = self.last = time.monotonic()

    def add(self, n: int, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if force or now - self.last >= TICK_S:
            self.last = now
            rate = (self.done - self.start_done) / max(now - self.t0, 1e-6)
            left = (self.total - self.done) / rate if rate > 0 else None
            print("FETCH " + json.dumps({"done": self.done, "total": self.total, "rate": round(rate),
                                         "left_s": None if left is None else round(left, 1)}), flush=True)


def _open(source: str, rel: str, offset: int):
    """A readable stream of `rel` from byte `offset` on (HTTP Range, or a seek into a local file)."""
    if source.startswith(("http://", "https://")):
        req = urllib.request.Request(f"{source.rstrip('/')}/{rel}")
        if offset:
            req.add_header("Range", f"bytes={offset}-")
        resp = urllib.request.urlopen(req, timeout=60)  # noqa: S310 (the manifest names the source)
        if offset and resp.status != 206:
            raise OSError(f"the source ignored the byte range (HTTP {resp.status}); cannot resume")
        return resp
    f = open(os.path.join(source, rel), "rb")  # noqa: SIM115 (closed by the caller)
    f.seek(offset)
    return f


def fetch_one(source: str, dest: str, entry: dict, progress: Progress) -> None:
    rel, size = entry["path"], int(entry["size"])
    final = inside(dest, rel)
    part = inside(dest, rel + ".partial")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > size:  # not a prefix of this file: start again
        os.remove(part)
        progress.add(-have)
        have = 0
    if have < size:
        with _open(source, rel, have) as src, _append_nofollow(part) as out:
            while block := src.read(CHUNK):
                out.write(block)
                progress.add(len(block))
    got = os.path.getsize(part)
    if got != size:
        raise OSError(f"{rel}: {got} bytes arrived, the manifest says {size}; run again to resume")
    if entry.get("sha256") and _sha256(part) != entry["sha256"]:
        os.remove(part)  # a wrong file is not resumed
        raise OSError(f"{rel}: sha256 differs from the manifest's (the copy is removed); run again")
    os.replace(part, final)


def fetch(manifest: dict) -> dict:
    source, dest = manifest["source"], manifest["dest"]
    marker = os.path.join(dest, ".complete")
    digest = _digest(manifest)
    total = sum(int(f["size"]) for f in manifest["files"])
    if os.path.exists(marker) and open(marker).read().strip() == digest:
        return {"skipped": True, "bytes": 0, "total": total, "files": len(manifest["files"])}
    todo, done = [], 0
    for entry in manifest["files"]:
        final = inside(dest, entry["path"])
        if os.path.exists(final) and os.path.getsize(final) == int(entry["size"]):
            done += int(entry["size"])  # in place already (its sha256 was checked when it arrived)
            continue
        part = final + ".partial"
        done += os.path.getsize(part) if os.path.exists(part) else 0
        todo.append(entry)
    progress = Progress(total, done)
    fetched_from = done
    for entry in todo:
        fetch_one(source, dest, entry, progress)
    progress.add(0, force=True)
    tmp = inside(dest, ".complete.tmp")
    if os.path.exists(tmp):
        os.remove(tmp)
    with _append_nofollow(tmp) as f:
        f.write((digest + "\n").encode())
    os.replace(marker + ".tmp", marker)
    return {"skipped": False, "bytes": progress.done - fetched_from, "total": total, "files": len(todo)}


def main() -> int:
    manifest = json.load(sys.stdin)
    try:
        for f in manifest["files"]:  # every name first: nothing is written when one would leave dest
            safe_name(f["path"], nested=True)
        os.makedirs(manifest["dest"], exist_ok=True)
        free = shutil.disk_usage(manifest["dest"]).free
        need = sum(int(f["size"]) for f in manifest["files"]
                   if not os.path.exists(inside(manifest["dest"], f["path"])))
        if free < need:
            raise OSError(f"{manifest['dest']}: {need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free")
        result = fetch(manifest)
    except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
        print(f"fetch error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("FETCH_DONE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
