"""Fetch a manifest of files into a directory once: resumable, verified, skipped when there.

Runs on a cluster host (the controller, into the shared /scratch) with that host's python3 and
the standard library only: fab uploads this file and runs it (ops/actions/prefetch.py). Reads the
manifest as JSON on stdin:

    {"source": "https://host/base" | "/a/local/dir", "dest": "/scratch/hub/models/x",
     "root": "/scratch/hub" (optional: the fetch area above dest),
     "files": [{"path": "model.safetensors", "size": 123, "sha256": "..." (optional)}],
     "token": "hf_..." (optional: the user's Hugging Face token, for a gated or private repository)}

Prints one `FETCH {...}` JSON line per progress tick (done, total bytes, rate, seconds left) and
a final `FETCH_DONE {...}`; exits 1 with a `fetch error: ...` line naming the file on failure.
A file is downloaded to `<name>.partial` and continued from its size (HTTP Range) after an
interruption; it is renamed into place only when its size (and sha256, where the manifest gives
one) match. `.complete` records the manifest once every file is in place: then nothing is read.

Every name in the manifest comes from an answer fab does not control (the Hub's file list), so each
must stay inside `dest` (`safe_name`): no "..", no absolute path. The fetch area is shared with the
jobs (/scratch), so a symbolic link may be planted in it at any time: every folder from the
manifest's `root` (the fetch area, `dest` when absent) down to each file is opened with
O_NOFOLLOW, one step at a time (`_folder`), and every file is opened, renamed and removed relative
to its folder's descriptor, so a link found on the way is refused, never followed. The name check
also guards fab's own downloads (ops/finetune/run_home.py `download`, ops/actions/prefetch.py): it
lives here because this file must run alone on the controller with the standard library.

The token (a gated model's) arrives only on stdin, so no command line (`ps`), environment or file on
this host holds it: it is sent as `Authorization: Bearer` to the manifest's source alone (`open_url`:
a redirect to another host, such as the Hub's CDN with its signed address, goes without it), is
never written, and is masked in every line this program prints (`redact`).
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import os
import stat
import sys
import time
import urllib.error
import urllib.parse
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


def _folder(at: int, parts: list[str], what: str) -> int:
    """A descriptor of the folder `parts` below descriptor `at`, each step made when missing and
    opened with O_NOFOLLOW: a symbolic link (or a file) on the way is UnsafeName naming `what`."""
    fd = os.dup(at)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeName(f"{what!r}: {part} on its way is a symbolic link or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_in(folder: int, name: str, flags: int, what: str) -> int:
    """`name` in `folder` opened with O_NOFOLLOW (and O_NONBLOCK: a planted FIFO cannot hang us); a
    symbolic link or anything but a plain file there is UnsafeName naming `what`."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeName(f"{what!r}: {name} is a symbolic link (it could point out of the folder)") from None
        if exc.errno == errno.ENXIO:
            raise UnsafeName(f"{what!r}: {name} is not a plain file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeName(f"{what!r}: {name} is not a plain file")
    return fd


def _size_in(folder: int, name: str) -> int | None:
    """The size of plain file `name` in `folder`; None when missing or not a plain file (a link)."""
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _digest(manifest: dict) -> str:
    files = sorted((f["path"], f["size"], f.get("sha256")) for f in manifest["files"])
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
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


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port


class _AuthToSameOrigin(urllib.request.HTTPRedirectHandler):
    """Redirects as urllib follows them, except that Authorization goes only to the origin (scheme,
    host, port) it was meant for: urllib copies every header but the body's to the new address
    (urllib/request.py, HTTPRedirectHandler.redirect_request), and the Hub sends a file's bytes from
    another host (a CDN address signed for this one download, which needs no token)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def open_url(url: str, token: str | None = None, headers: dict | None = None, timeout: float = 60):
    """urlopen(url) with `headers`, and `token` as `Authorization: Bearer` to url's origin alone."""
    req = urllib.request.Request(url, headers=headers or {})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.build_opener(_AuthToSameOrigin).open(req, timeout=timeout)


def redact(text: str, token: str | None) -> str:
    """`text` with `token` masked: an error may quote what a server or a library said about it."""
    return text.replace(token, "[token]") if token else text


def _open(source: str, rel: str, offset: int, token: str | None = None):
    """A readable stream of `rel` from byte `offset` on (HTTP Range, or a seek into a local file)."""
    if source.startswith(("http://", "https://")):
        resp = open_url(f"{source.rstrip('/')}/{rel}", token, {"Range": f"bytes={offset}-"} if offset else None)
        if offset and resp.status != 206:
            raise OSError(f"the source ignored the byte range (HTTP {resp.status}); cannot resume")
        return resp
    f = open(os.path.join(source, rel), "rb")  # noqa: SIM115 (closed by the caller)
    f.seek(offset)
    return f


def fetch_one(source: str, dest: int, entry: dict, progress: Progress, token: str | None = None) -> None:
    """One file into the folder of descriptor `dest`, never through a symbolic link (_folder, _open_in)."""
    rel, size = entry["path"], int(entry["size"])
    *dirs, name = safe_name(rel, nested=True).split("/")
    folder = _folder(dest, dirs, rel)
    try:
        part = name + ".partial"
        have = _size_in(folder, part) or 0
        if have > size:  # not a prefix of this file: start again
            os.unlink(part, dir_fd=folder)
            progress.add(-have)
            have = 0
        if have < size:
            with _open(source, rel, have, token) as src, \
                    os.fdopen(_open_in(folder, part, os.O_WRONLY | os.O_APPEND | os.O_CREAT, rel), "ab") as out:
                while block := src.read(CHUNK):
                    out.write(block)
                    progress.add(len(block))
        got = _size_in(folder, part)
        if got != size:
            raise OSError(f"{rel}: {got} bytes arrived, the manifest says {size}; run again to resume")
        if entry.get("sha256") and _sha256(_open_in(folder, part, os.O_RDONLY, rel)) != entry["sha256"]:
            os.unlink(part, dir_fd=folder)  # a wrong file is not resumed
            raise OSError(f"{rel}: sha256 differs from the manifest's (the copy is removed); run again")
        os.replace(part, name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)


def _in_place(dest: int, rel: str) -> tuple[int | None, int | None]:
    """(size of rel, size of rel.partial) under descriptor `dest`; None where missing (or behind a link)."""
    *dirs, name = rel.split("/")
    folder = _folder(dest, dirs, rel)
    try:
        return _size_in(folder, name), _size_in(folder, name + ".partial")
    finally:
        os.close(folder)


def fetch(manifest: dict, dest: int, token: str | None = None) -> dict:
    """The manifest's files into the folder of descriptor `dest` (opened by `open_dest`)."""
    source = manifest["source"]
    digest = _digest(manifest)
    total = sum(int(f["size"]) for f in manifest["files"])
    try:
        with os.fdopen(_open_in(dest, ".complete", os.O_RDONLY, ".complete"), "r") as f:
            if f.read().strip() == digest:
                return {"skipped": True, "bytes": 0, "total": total, "files": len(manifest["files"])}
    except FileNotFoundError:
        pass
    todo, done = [], 0
    for entry in manifest["files"]:
        have, partial = _in_place(dest, entry["path"])
        if have == int(entry["size"]):
            done += have  # in place already (its sha256 was checked when it arrived)
            continue
        done += partial or 0
        todo.append(entry)
    progress = Progress(total, done)
    fetched_from = done
    for entry in todo:
        fetch_one(source, dest, entry, progress, token)
    progress.add(0, force=True)
    try:
        os.unlink(".complete.tmp", dir_fd=dest)  # whatever is there (a link itself, not its target)
    except FileNotFoundError:
        pass
    with os.fdopen(_open_in(dest, ".complete.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, ".complete"), "w") as f:
        f.write(digest + "\n")
    os.replace(".complete.tmp", ".complete", src_dir_fd=dest, dst_dir_fd=dest)
    return {"skipped": False, "bytes": progress.done - fetched_from, "total": total, "files": len(todo)}


def open_dest(manifest: dict) -> int:
    """A descriptor of the manifest's `dest`, reached from its `root` (the fetch area; `dest` itself
    when absent) one folder at a time without following a symbolic link (made where missing)."""
    dest = manifest["dest"]
    root = manifest.get("root") or dest
    rel = os.path.relpath(dest, root)
    if rel != "." and (rel.startswith("../") or rel == ".."):
        raise UnsafeName(f"{dest!r}: not under the fetch area {root}")
    # The area itself (/scratch/hub) belongs to the admin user, so a job can swap it for a link: it is
    # reached from its parent, the scratch root (root-owned, made by the bootstrap), like every folder below.
    parent, area = os.path.split(os.path.normpath(root))
    os.makedirs(parent or ".", exist_ok=True)
    top = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _folder(top, [safe_name(area)] + ([] if rel == "." else safe_name(rel, nested=True).split("/")), dest)
    finally:
        os.close(top)


def main() -> int:
    manifest = json.load(sys.stdin)
    token = manifest.pop("token", None) or None  # stdin alone brings it; from here on, only in memory
    try:
        for f in manifest["files"]:  # every name first: nothing is written when one would leave dest
            safe_name(f["path"], nested=True)
        dest = open_dest(manifest)
        try:
            fs = os.statvfs(dest)
            free = fs.f_bavail * fs.f_frsize
            need = sum(int(f["size"]) for f in manifest["files"] if _in_place(dest, f["path"])[0] is None)
            if free < need:
                raise OSError(f"{manifest['dest']}: {need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free")
            result = fetch(manifest, dest, token)
        finally:
            os.close(dest)
    except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError, KeyError) as exc:
        print(f"fetch error: {redact(str(exc), token)}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # no traceback: a library's words may quote the token  # noqa: BLE001
        print(f"fetch error: {type(exc).__name__}: {redact(str(exc), token)}", file=sys.stderr, flush=True)
        return 1
    print("FETCH_DONE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
