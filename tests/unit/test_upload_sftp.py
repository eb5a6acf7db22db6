"""ops/finetune/upload.py against a real OpenSSH server on loopback (sshd with its internal SFTP, fab's own
connection code): a new file is streamed, verified and renamed into <scratch>/uploads/<sha256>/<name>; the
same bytes again are not uploaded; an interrupted or changed upload leaves no file under the final name and
no temporary file. No cluster: the host is this machine's sshd on 127.0.0.1."""

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from ops.finetune import upload
from ops.ssh import remote
from tests.support import inventories
from tests.unit.test_ssh_forwarding import _free_port
from tests.unit.test_upload import alpaca_jsonl

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.root]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on loopback (internal SFTP): {inventory: its file, port, key, scratch}."""
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    host_pub = (d / "host.pub").read_text().split()
    (d / "known_hosts").write_text(f"controller {host_pub[0]} {host_pub[1]}\n")
    (d / "scratch").mkdir()
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    port = _free_port()
    inv = inventories.make("local", cluster_name="t", ssh_user="root", controller=("controller", "127.0.0.1"),
                           gpus_per_node=1, gpu_type="sim", python="/usr/bin/python3",
                           service_cmd="true {action} {service}", known_hosts=str(d / "known_hosts"))
    (d / "inventory.json").write_text(inv.to_json())
    # Started last, and stopped whatever follows: a setup error leaves no sshd behind.
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", "/dev/null", "-p", str(port),
                             "-o", "ListenAddress=127.0.0.1", "-o", f"HostKey={d / 'host'}",
                             "-o", f"AuthorizedKeysFile={d / 'authorized_keys'}",
                             "-o", "PermitRootLogin=prohibit-password", "-o", "Subsystem=sftp internal-sftp",
                             "-o", "StrictModes=no", "-o", f"PidFile={d / 'sshd.pid'}"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "sshd.log", "wb"))  # noqa: SIM115
    try:
        # Ready when its pid file is written (after it has bound the port); one that could not bind
        # (another process took the free port meanwhile) exits, and says so, rather than letting the
        # tests talk to whoever holds the port.
        for _ in range(200):
            if proc.poll() is not None:
                raise RuntimeError(f"sshd on port {port} exited: {(d / 'sshd.log').read_text(errors='replace')}")
            if (d / "sshd.pid").exists():
                break
            time.sleep(0.05)
        yield {"inventory": d / "inventory.json", "port": port, "key": d / "user", "scratch": d / "scratch"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def host(sshd):
    """(connection, scratch folder) of the loopback sshd, reached as fab reaches a controller."""
    cl = remote.connect_file(str(sshd["inventory"]), str(sshd["key"]), sshd["port"])
    try:
        yield cl.controller, sshd["scratch"]
    finally:
        cl.close()


def test_uploaded_once_then_found_by_its_sha256(host, tmp_path):
    c, scratch = host
    path = tmp_path / "my data.jsonl"
    sha = hashlib.sha256(alpaca_jsonl(path, 3000)).hexdigest()
    said: list[str] = []
    where, uploaded = upload.ensure_on_cluster(c, str(scratch), upload.prepare(path), said.append)
    final = scratch / "uploads" / sha / "my_data.jsonl"
    assert (where, uploaded) == (str(final), True)
    assert final.read_bytes() == path.read_bytes() and oct(final.stat().st_mode & 0o777) == "0o644"
    assert any("sha256 verified on the controller" in s for s in said), said
    assert not list((scratch / "uploads").glob(".partial-*"))

    stamp, said = final.stat().st_mtime_ns, []
    again = upload.ensure_on_cluster(c, str(scratch), upload.prepare(path), said.append)
    assert again == (str(final), False) and final.stat().st_mtime_ns == stamp
    assert said == [f"      --data {path}: already on the cluster at {final} (same sha256), not uploaded"]


def test_an_interrupted_upload_leaves_no_file(host, tmp_path):
    c, scratch = host
    path = tmp_path / "interrupted.jsonl"
    alpaca_jsonl(path, 4000)  # several of putfo's 32 KiB writes
    local = upload.prepare(path)
    sent = []

    def ctrl_c(done, total):
        sent.append(done)
        if len(sent) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        upload.ensure_on_cluster(c, str(scratch), local, say=lambda s: None, progress=ctrl_c)
    assert 0 < sent[-1] < local.size
    assert not (scratch / "uploads" / local.sha256).exists()
    assert not list((scratch / "uploads").glob(".partial-*"))


def test_a_file_changed_after_its_check_is_refused_and_removed(host, tmp_path):
    c, scratch = host
    path = tmp_path / "changing.jsonl"
    alpaca_jsonl(path, 100)
    local = upload.prepare(path)
    path.write_bytes(path.read_bytes().replace(b"Say", b"Sag"))  # same size, other bytes
    with pytest.raises(upload.UploadError, match="the upload arrived changed"):
        upload.ensure_on_cluster(c, str(scratch), local, say=lambda s: None)
    assert not (scratch / "uploads" / local.sha256).exists()
    assert not list((scratch / "uploads").glob(".partial-*"))


def test_a_stale_temporary_file_is_swept_by_the_next_upload(host, tmp_path):
    c, scratch = host
    stale = scratch / "uploads" / ".partial-0123456789ab-old.jsonl"
    stale.parent.mkdir(exist_ok=True)
    stale.write_text("left by a killed fab")
    day_ago = time.time() - upload.STALE_PARTIAL_MIN * 60 - 60
    os.utime(stale, (day_ago, day_ago))
    path = tmp_path / "next.jsonl"
    alpaca_jsonl(path, 10)
    upload.ensure_on_cluster(c, str(scratch), upload.prepare(path), say=lambda s: None)
    assert not stale.exists()


def test_the_upload_benchmark_stays_under_its_memory_bound(sshd, tmp_path):
    """benchmarks/bench_upload.py end to end against the loopback sshd, with a small file (SGPU_BENCH_UPLOAD_GB
    sets the size, SGPU_BENCH_UPLOAD_OUT keeps the result: BENCHMARKS.md's figure is this test at 1 GB)."""
    import json
    import sys

    out = os.environ.get("SGPU_BENCH_UPLOAD_OUT") or str(tmp_path / "upload.json")
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench_upload", "--inventory", str(sshd["inventory"]),
                          "--port", str(sshd["port"]), "--identity", str(sshd["key"]), "--scratch",
                          str(sshd["scratch"]), "--size-gb", os.environ.get("SGPU_BENCH_UPLOAD_GB", "0.05"),
                          "--dir", str(tmp_path), "--out", out],
                         cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(Path(out).read_text())
    assert result["uploaded_first"] is True and result["uploaded_second"] is False
    assert result["peak_rss_mb"] < result["limit_mb"] == 256
    assert result["rows"] == result["rows_written"] and result["bytes"] >= 0.05e9
    assert not list(tmp_path.glob("bench-upload-*")) and not (sshd["scratch"] / "uploads" / result["sha256"]).exists()
