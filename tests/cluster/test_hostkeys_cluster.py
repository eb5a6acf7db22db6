"""Host keys are checked on the local cluster: fab's connections and `fab ssh` accept the
keys `fab local.up` pinned, and refuse a host whose key differs, naming the host, the
expected and the presented fingerprints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ops.ssh import hostkeys, remote
from tests.support.local_cluster import fresh_cluster

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
FAB = [sys.executable, "-m", "fabric"]


def fab_ssh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FAB, "ssh", *args, "--target", "local"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_pinned_keys_are_accepted_and_a_wrong_key_is_refused(tmp_path):
    with fresh_cluster(nodes=2, gpus=1) as (inv, _):
        path = hostkeys.known_hosts_path(inv)
        good = path.read_text()
        pins = hostkeys.read_known_hosts(path)
        assert set(pins) >= {"controller", "gpu-node-01", "gpu-node-02"}

        # The right keys: fab's connections and `fab ssh` (through the jump host) work.
        cl = remote.connect(inv)
        try:
            assert cl.nodes["gpu-node-01"].run("hostname", hide=True).stdout.strip() == "gpu-node-01"
        finally:
            cl.close()
        res = fab_ssh("gpu-node-02", "--command", "hostname")
        assert res.returncode == 0 and res.stdout.strip() == "gpu-node-02", res.stderr
        res = fab_ssh("controller", "--command", "hostname")
        assert res.returncode == 0 and res.stdout.strip() == "controller", res.stderr
        res = fab_ssh("gpu-node-7", "--command", "hostname")
        assert res.returncode == 1
        assert "unknown host 'gpu-node-7'; the hosts of cluster 'local' are: controller, gpu-node-01, " \
               "gpu-node-02" in res.stderr

        # gpu-node-01 pinned to another key (as if someone answered in its place).
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True)
        impostor = (tmp_path / "impostor.pub").read_text().split()
        expected_fp = hostkeys.fingerprint(impostor[1])
        presented_fp = hostkeys.fingerprint(pins["gpu-node-01"][0][1])
        path.write_text(re.sub(r"^(gpu-node-01\S*) ssh-ed25519 \S+", rf"\1 ssh-ed25519 {impostor[1]}", good,
                               flags=re.M))
        cl = remote.connect(inv)
        try:
            assert cl.controller.run("hostname", hide=True).stdout.strip() == "controller"  # still fine
            with pytest.raises(hostkeys.HostKeyError) as err:
                cl.nodes["gpu-node-01"].run("hostname", hide=True)
        finally:
            cl.close()
        msg = str(err.value)
        assert msg.startswith(f"host key of gpu-node-01 (10.213.0.11) does not match the key pinned in {path}")
        assert f"expected {expected_fp} (ssh-ed25519), presented {presented_fp} (ssh-ed25519)" in msg
        assert "do not connect" in msg and "delete its lines from" in msg
        # fab train's steps report it per host; `fab ssh` (OpenSSH) refuses too.
        with pytest.raises(remote.HostError, match="gpu-node-01: HostKeyError: host key of gpu-node-01"):
            cl = remote.connect(inv)
            try:
                remote.each("check", cl.nodes, lambda n, c: c.run("true", hide=True))
            finally:
                cl.close()
        res = fab_ssh("gpu-node-01", "--command", "hostname")
        assert res.returncode != 0 and "gpu-node-01" not in res.stdout
        assert "Host key verification failed" in res.stderr

        # No pinned key at all: refused as well, with what to do.
        path.write_text("".join(ln + "\n" for ln in good.splitlines() if not ln.startswith("gpu-node-02")))
        cl = remote.connect(inv)
        try:
            with pytest.raises(hostkeys.HostKeyError, match="no pinned host key for gpu-node-02 in .*fab local.up"):
                cl.nodes["gpu-node-02"].run("true", hide=True)
        finally:
            cl.close()

        # The right key again: accepted.
        path.write_text(good)
        res = fab_ssh("gpu-node-01", "--command", "hostname")
        assert res.returncode == 0 and res.stdout.strip() == "gpu-node-01", res.stderr
