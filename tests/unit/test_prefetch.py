"""Fetching model and data once (ops/actions/fetch_files.py, ops/actions/prefetch.py) from a real local source: an
HTTP server with byte ranges on loopback, and a directory. Resumed, verified, skipped when there."""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ops.actions import prefetch

SCRIPT = str(prefetch.SCRIPT)


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Files of the served directory, with `Range: bytes=N-` (what a hub's CDN answers)."""

    served: dict[str, int] = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start, status = int(rng[6:-1]), 206
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        self.wfile.write(body)
        RangeHandler.served[path.name] = RangeHandler.served.get(path.name, 0) + len(body)


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {"model.safetensors": os.urandom(5 << 20), "config.json": b'{"a": 1}', "sub/tok.json": b"x" * 1000}
    for name, data in files.items():
        (src / name).write_bytes(data)
    handler = lambda *a, **kw: RangeHandler(*a, directory=str(src), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    RangeHandler.served = {}
    yield f"http://127.0.0.1:{server.server_port}", src, files
    server.shutdown()


def _manifest(url, dest, files, sha=True):
    return prefetch.manifest_of_dir(url, str(dest), {k: len(v) for k, v in files.items()},
                                    {k: hashlib.sha256(v).hexdigest() for k, v in files.items()} if sha else None)


def _fetch(manifest):
    res = subprocess.run([sys.executable, SCRIPT], input=json.dumps(manifest), capture_output=True, text=True,
                         timeout=120)
    done = [json.loads(ln[11:]) for ln in res.stdout.splitlines() if ln.startswith("FETCH_DONE ")]
    ticks = [json.loads(ln[6:]) for ln in res.stdout.splitlines() if ln.startswith("FETCH ")]
    return res, (done[0] if done else None), ticks


def test_fetch_resumes_verifies_and_then_skips(source, tmp_path):
    url, _src, files = source
    dest = tmp_path / "dest"
    big = files["model.safetensors"]
    (dest).mkdir()
    (dest / "model.safetensors.partial").write_bytes(big[: 3 << 20])  # an interrupted earlier fetch
    res, done, ticks = _fetch(_manifest(url, dest, files))
    assert res.returncode == 0, res.stderr
    assert RangeHandler.served["model.safetensors"] == len(big) - (3 << 20)  # only the rest was read
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    assert not list(dest.rglob("*.partial"))
    total = sum(map(len, files.values()))
    assert done == {"skipped": False, "bytes": total - (3 << 20), "total": total, "files": 3}
    assert ticks and ticks[-1]["done"] == total and ticks[-1]["total"] == total
    assert prefetch.describe(ticks[-1], "model").startswith(f"model: {total / 1e9:.2f} of {total / 1e9:.2f} GB at ")

    RangeHandler.served = {}
    res, done, _ = _fetch(_manifest(url, dest, files))
    assert res.returncode == 0 and done["skipped"] is True and RangeHandler.served == {}


def test_a_wrong_or_missing_file_fails_naming_it_and_leaves_nothing_half_done(source, tmp_path):
    url, _src, files = source
    bad = _manifest(url, tmp_path / "d1", files)
    bad["files"][0]["sha256"] = "0" * 64  # config.json (sorted first)
    res, done, _ = _fetch(bad)
    assert res.returncode == 1 and done is None
    assert "fetch error: config.json: sha256 differs" in res.stderr
    assert not (tmp_path / "d1" / "config.json").exists() and not (tmp_path / "d1" / ".complete").exists()

    missing = _manifest(url, tmp_path / "d2", {**files, "absent.bin": b"12"})
    res, done, _ = _fetch(missing)
    assert res.returncode == 1 and "fetch error" in res.stderr and "404" in res.stderr, res.stderr
    assert not (tmp_path / "d2" / ".complete").exists()


def test_a_local_directory_is_a_source_too(source, tmp_path):
    _url, src, files = source
    res, done, _ = _fetch(_manifest(str(src), tmp_path / "d3", files, sha=False))
    assert res.returncode == 0, res.stderr
    assert done["files"] == 3 and (tmp_path / "d3" / "sub" / "tok.json").read_bytes() == files["sub/tok.json"]


def test_progress_lines_become_what_the_user_reads():
    said, result = [], {}
    stream = prefetch._Lines(lambda ln: prefetch.on_line(ln, "model", said.append, result))
    stream.write('FETCH {"done": 3200000000, "total": 8100000000, "rate": 140000000, "left_s": 35.0}\nFETCH_D')
    stream.write('ONE {"skipped": false, "bytes": 8100000000, "total": 8100000000, "files": 3}\n')
    assert said == ["model: 3.20 of 8.10 GB at 140 MB/s, 35 s left"]
    assert result["bytes"] == 8100000000
    with pytest.raises(prefetch.PrefetchError, match="empty"):
        prefetch.manifest_of_dir("/x", "/y", {})
