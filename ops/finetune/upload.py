"""`fab train --data ./my.jsonl`: a data file on the user's machine, uploaded once to the cluster's shared storage.

Before any host is touched (`prepare`): the file is read once in 1 MiB pieces, its sha256 and row count taken
as it streams, and its first rows checked with the training code's own format detection and row checks
(training/data.py), so a file of none of the three shapes fails here, naming the columns found.

On the cluster (`ensure_on_cluster`) the file lives at <scratch>/uploads/<sha256>/<name>: a second run with
the same bytes finds it and uploads nothing. A new file streams over SFTP to a temporary name beside it
(paramiko's putfo: 32 KiB reads, so the user's side never holds the file), its size and sha256 are checked
on the controller, and only then is it renamed into place: an interrupted or corrupted upload leaves no file
under its final name, and its temporary file is removed (or, if the connection died, swept by a later upload
once a day old).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shlex
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paramiko.ssh_exception import SSHException

from cluster.errors import UserError
from ops.actions.fetch_files import UnsafeName, safe_name
from ops.say import Say, shown
from training import data as training_data

PIECE = 1 << 20  # bytes read at a time while hashing: the user's side holds one piece, never the file
HEAD_ROWS = 200  # rows checked here before anything is uploaded; the whole file is checked on a node
HEAD_ROW_MAX = 8 << 20  # a longer row is left to the check on the node (the user's side keeps < 200 such rows)
JSON_WHOLE_MAX = 16 << 20  # a .json file is one JSON document, parsed whole (~5x in memory): larger ones as JSON Lines
PROGRESS_MIN_BYTES = 32 << 20  # a progress bar (on a terminal) for files at least this large
UPLOADS = "uploads"  # under the cluster's scratch: <sha256>/<name>
STALE_PARTIAL_MIN = 24 * 60  # a temporary file a killed upload left is removed by a later one after a day
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class UploadError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class LocalData:
    """A local data file as read here: where, its name on the cluster, size, sha256, rows and their format."""

    path: Path
    name: str
    size: int
    sha256: str
    rows: int
    format: str

    def describe(self) -> str:
        return (f"{self.path} ({_size(self.size)}, {self.rows} rows, format {self.format}, "
                f"sha256 {self.sha256[:12]})")

    def record(self, cluster_path: str, uploaded: bool) -> dict:
        """The run record's `data_source` (runs/<job>/run.json)."""
        return {"kind": "local file", "path": str(self.path), "sha256": self.sha256, "bytes": self.size,
                "rows": self.rows, "format": self.format, "cluster_path": cluster_path, "uploaded": uploaded}


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n} bytes"


def cluster_name(path: Path) -> str:
    """The file's name on the cluster: its own, with anything but letters, digits, '.', '_' and '-' replaced by
    '_' (it reaches shell commands quoted, and never leaves its folder: fetch_files.safe_name)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name).lstrip(".") or "data"
    try:
        return safe_name(name)
    except UnsafeName as exc:  # not reachable after the substitution; kept as the folder's guard
        raise UploadError(f"--data {path}: {exc}; rename the file") from None


def _flag(path: Path) -> str:
    return f"--data {path}"


BLANK_LINE = re.compile(rb"^[ \t\r\f\v]*\n", re.M)
MAYBE_BLANK = re.compile(rb"\n[ \t\r\f\v\n]")  # a line that starts with whitespace or is empty


def _blank_lines(lines: bytes) -> int:
    """How many of `lines` (whole lines) are empty or whitespace: the regex only where one can be (a line that
    starts with whitespace or a newline), since scanning every line start with it is slow."""
    if not (lines[:1] and lines[:1] in b" \t\r\f\v\n") and not MAYBE_BLANK.search(lines):
        return 0
    return len(BLANK_LINE.findall(lines))


def _hash_and_count_lines(path: Path, head: list[bytes]) -> tuple[str, int]:
    """sha256 of the file and its count of non-blank lines, reading PIECE bytes at a time (a row longer than a
    piece is counted without being held); the first HEAD_ROWS non-blank lines (each at most HEAD_ROW_MAX bytes)
    into `head`."""
    h, rows = hashlib.sha256(), 0
    tail, tail_text = b"", False  # the line the last piece ended inside: its start (up to HEAD_ROW_MAX), any text

    def keep(line: bytes) -> None:
        if len(head) < HEAD_ROWS and len(line) <= HEAD_ROW_MAX:
            head.append(line)

    with path.open("rb") as f:
        for piece in iter(lambda: f.read(PIECE), b""):
            h.update(piece)
            first, last = piece.find(b"\n"), piece.rfind(b"\n")
            if first < 0:  # the line goes on
                tail_text = tail_text or bool(piece.strip())
                if len(head) < HEAD_ROWS and len(tail) <= HEAD_ROW_MAX:
                    tail += piece
                continue
            ended = piece[:first]
            if tail_text or ended.strip():
                rows += 1
                keep(tail + ended if len(tail) <= HEAD_ROW_MAX else tail)
            middle = piece[first + 1:last + 1]  # whole lines
            rows += middle.count(b"\n") - _blank_lines(middle)
            if len(head) < HEAD_ROWS:
                for line in middle.split(b"\n"):
                    if line.strip():
                        keep(line)
            tail = piece[last + 1:]
            tail_text = bool(tail.strip())
    if tail_text:
        rows += 1
        keep(tail)
    return h.hexdigest(), rows


def _hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for piece in iter(lambda: f.read(PIECE), b""):
            h.update(piece)
    return h.hexdigest()


def _jsonl_head(path: Path, lines: list[bytes]) -> list:
    rows = []
    for n, raw in enumerate(lines, start=1):
        try:
            rows.append(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UploadError(f"{_flag(path)}: row {n} is not valid JSON ({getattr(exc, 'msg', exc)}); fix or "
                              "remove that line (nothing was uploaded)") from None
    return rows


def _csv_rows(path: Path) -> tuple[list[dict], int]:
    """The first HEAD_ROWS rows of a CSV file (header row: the columns) and its count of rows, streamed."""
    head, rows = [], 0
    try:
        with path.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                rows += 1
                if len(head) < HEAD_ROWS:
                    head.append(row)
    except UnicodeDecodeError:
        raise UploadError(f"{_flag(path)}: not UTF-8 text; save it as UTF-8 (nothing was uploaded)") from None
    except csv.Error as exc:
        raise UploadError(f"{_flag(path)}: not a readable CSV file ({exc}); fix it (nothing was uploaded)") from None
    return head, rows


def _parquet_rows(path: Path) -> tuple[list[dict], int]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        first = next(pf.iter_batches(batch_size=HEAD_ROWS), None)
        return (first.to_pylist() if first is not None else []), pf.metadata.num_rows
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise UploadError(f"{_flag(path)}: cannot read as Parquet ({exc}); check the file "
                          "(nothing was uploaded)") from None


def prepare(path: str | Path) -> LocalData:
    """Read the local data file at `path` (streaming): size, sha256, rows, and the format of its first rows,
    checked by training/data.py. An UploadError names the fix; no host has been touched."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UploadError(f"--data {path}: no such file on this machine; give a data file that exists here "
                          "(JSONL, JSON, CSV or Parquet), a Hub data set ID or an absolute path on the cluster")
    if not path.is_file():
        raise UploadError(f"{_flag(path)}: not a regular file; give one data file (JSONL, JSON, CSV or Parquet)")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UploadError(f"{_flag(path)}: unsupported file type {path.suffix or '(none)'!r}; use one of "
                          f"{', '.join(SUFFIXES)}")
    size = path.stat().st_size
    if suffix == ".jsonl":
        lines: list[bytes] = []
        digest, rows = _hash_and_count_lines(path, lines)
        head = _jsonl_head(path, lines)
    elif suffix == ".json":
        if size > JSON_WHOLE_MAX:
            raise UploadError(f"{_flag(path)}: a .json file over {_size(JSON_WHOLE_MAX)} is read whole to "
                              "check it; save it as JSON Lines (.jsonl: one object per line), which streams")
        digest = _hash(path)
        try:
            head = training_data.READERS[".json"](path)
        except training_data.DataError as exc:
            raise UploadError(f"{exc} (nothing was uploaded)") from None
        rows = len(head)
    else:
        digest = _hash(path)
        head, rows = _csv_rows(path) if suffix == ".csv" else _parquet_rows(path)
    if not head and rows:  # every first row is over HEAD_ROW_MAX: the check on the node reads them
        fmt = "checked on the cluster"
    else:
        try:
            fmt = training_data.check_rows(head[:HEAD_ROWS], str(path)).format
        except training_data.DataError as exc:
            raise UploadError(f"--data {exc} (checked on this machine; nothing was uploaded)") from None
    return LocalData(path=path.resolve(), name=cluster_name(path), size=size, sha256=digest, rows=rows,
                     format=fmt)


def home(scratch: str, data: LocalData) -> str:
    """Where the file lives on the cluster: <scratch>/uploads/<sha256>/<name>."""
    return f"{scratch}/{UPLOADS}/{data.sha256}/{data.name}"


class UploadBar:
    """A progress bar on a terminal for a large upload (paramiko's putfo callback: bytes sent, total)."""

    def __init__(self, what: str, total: int, out=None):
        self.out = out or sys.stdout
        self.what, self.total, self.t0, self.shown_at = what, total, time.monotonic(), 0.0
        self.on = total >= PROGRESS_MIN_BYTES and self.out.isatty()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.on or (now - self.shown_at < 0.25 and done < total):
            return
        self.shown_at = now
        rate = done / max(now - self.t0, 1e-6)
        width = 30
        bar = "#" * int(width * done / max(total, 1))
        left = f", {(total - done) / rate:.0f} s left" if rate > 0 and done < total else ""
        self.out.write(f"\r      uploading {self.what} [{bar:<{width}}] {done / 1e6:.0f} of {total / 1e6:.0f} MB "
                       f"at {rate / 1e6:.0f} MB/s{left}   ")
        if done >= total:
            self.out.write("\n")
        self.out.flush()


def _run(c, cmd: str):
    return c.run(cmd, hide=True, warn=True, in_stream=False)


def ensure_on_cluster(c, scratch: str, data: LocalData, say: Say,
                      progress: Callable[[int, int], None] | None = None) -> tuple[str, bool]:
    """The file at its home on the cluster (`home`), uploaded over the connection `c` (the controller, as its
    login user) unless it is there already: (path on the cluster, whether it was uploaded now)."""
    final = home(scratch, data)
    q = shlex.quote
    folder, uploads = final.rsplit("/", 1)[0], f"{scratch}/{UPLOADS}"
    have = _run(c, f"stat -c %s {q(final)}")
    if have.ok and have.stdout.strip() == str(data.size):
        say(f"      {_flag(data.path)}: already on the cluster at {final} (same sha256), not uploaded")
        return final, False
    made = _run(c, f"mkdir -p {q(uploads)} && chmod 0755 {q(uploads)} && find {q(uploads)} -maxdepth 1 "
                   f"-name '.partial-*' -mmin +{STALE_PARTIAL_MIN} -delete")
    if not made.ok:
        raise UploadError(f"{_flag(data.path)}: cannot write {uploads} on the controller "
                          f"({shown((made.stderr or '').strip()[-200:])}); check the cluster's scratch")
    tmp = f"{uploads}/.partial-{uuid.uuid4().hex[:12]}-{data.name}"
    say(f"      {_flag(data.path)}: uploading {_size(data.size)} to {final}")
    t0 = time.monotonic()
    try:
        try:  # confirm=False: the size and sha256 are checked below, with a message that says what to do
            with data.path.open("rb") as f:
                c.sftp().putfo(f, tmp, file_size=data.size, callback=progress or UploadBar(data.name, data.size),
                               confirm=False)
        except (OSError, SSHException) as exc:
            raise UploadError(f"{_flag(data.path)}: the upload to the controller failed ({shown(exc)}); run the "
                              "command again (nothing was kept: it starts over)") from None
        check = _run(c, f"stat -c %s {q(tmp)} && sha256sum {q(tmp)}")
        lines = check.stdout.split()
        if not check.ok or len(lines) < 2 or lines[0] != str(data.size) or lines[1] != data.sha256:
            raise UploadError(f"{_flag(data.path)}: the upload arrived changed (size/sha256 on the controller "
                              f"{shown(' '.join(lines[:2]))[:100]}, here {data.size} {data.sha256[:12]}...); did "
                              "the file change while uploading? Run the command again")
        moved = _run(c, f"chmod 0644 {q(tmp)} && mkdir -p {q(folder)} && chmod 0755 {q(folder)} && "
                        f"mv -T {q(tmp)} {q(final)}")
        if not moved.ok:
            raise UploadError(f"{_flag(data.path)}: could not move the upload to {final}: "
                              f"{shown((moved.stderr or '').strip()[-200:])}")
    except BaseException:  # Ctrl-C included: no half-uploaded file stays behind
        try:
            _run(c, f"rm -f {q(tmp)}")
        except Exception:  # noqa: BLE001 - the connection is gone: a later upload sweeps it (STALE_PARTIAL_MIN)
            pass
        raise
    took = max(time.monotonic() - t0, 1e-6)
    say(f"      {_flag(data.path)}: uploaded {_size(data.size)} in {took:.1f} s "
        f"({data.size / took / 1e6:.0f} MB/s), sha256 verified on the controller")
    return final, True
