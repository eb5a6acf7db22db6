"""ops/finetune/upload.py against a real OpenSSH server on loopback (sshd with its internal SFTP, fab's own
connection code): a new file is streamed, verified and renamed into <scratch>/uploads/<sha256>/<name>; the
same bytes again are not uploaded; an interrupted or changed upload leaves no file under the final name and
no temporary file. No cluster: the host is this machine's sshd on 127.0.0.1."""

import hashlib
import os
import subprocess
import time

import pytest

from cluster.inventory import Inventory, Node
from ops.finetune import upload
from ops.ssh import remote
from tests.test_ssh_forwarding import _free_port
from tests.test_upload import alpaca_jsonl

pytestmark = [pytest.mark.root]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """(connection, scratch folder) of a real sshd on loopback, reached as fab reaches a controller."""
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    port = _free_port()
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", "/dev/null", "-p", str(port),
                             "-o", "ListenAddress=127.0.0.1", "-o", f"HostKey={d / 'host'}",
                             "-o", f"AuthorizedKeysFile={d / 'authorized_keys'}",
                             "-o", "PermitRootLogin=prohibit-password", "-o", "Subsystem=sftp internal-sftp",
                             "-o", "StrictModes=no", "-o", f"PidFile={d / 'sshd.pid'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host_pub = (d / "host.pub").read_text().split()
    (d / "known_hosts").write_text(f"controller {host_pub[0]} {host_pub[1]}\n")
    inv = Inventory(target="local", cluster_name="t", ssh_user="root",
                    controller=Node("controller", "127.0.0.1", "controller"), gpu_nodes=(),
                    gpus_per_node=1, gpu_type="sim", nvlink=False, efa=False, python="/usr/bin/python3",
                    service_cmd="true {action} {service}", extra={"known_hosts": str(d / "known_hosts")})
    try:
        for _ in range(100):
            if subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"],
                              stderr=subprocess.DEVNULL).returncode == 0:
                break
            time.sleep(0.1)
        cl = remote.connect(inv, identity=str(d / "user"))
        cl.controller.port = port
        scratch = d / "scratch"
        scratch.mkdir()
        try:
            yield cl.controller, scratch
        finally:
            cl.close()
    finally:
        sshd.terminate()
        sshd.wait(timeout=10)


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
