"""The controller bootstrap's munge step, really run as root in a private mount namespace, makes the
key munge:munge 0400 in a 0700 /etc/munge, and once (the other invariants:
tests/unit/test_security_invariants.py).
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess

import pytest

from bootstrap import node_layout, user_data
from tests.unit.test_security_invariants import _facts, _found, _key_forms


@pytest.fixture(scope="module")
def bootstrap_key(tmp_path_factory):
    """Run the controller bootstrap's munge step for real in a private mount namespace,
    with a temporary directory bound over /etc/munge and /var/lib/slurm (the script's
    fixed paths), twice. Returns (key bytes, stat of key, stat of dir, 2nd-run key)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount namespace, chown munge)")
    tmp = tmp_path_factory.mktemp("munge-root")
    etc, state = tmp / "etc-munge", tmp / "var-lib-slurm"
    etc.mkdir(), state.mkdir()
    script = tmp / "bootstrap.sh"
    script.write_text(user_data.bootstrap_script(_facts(), "controller"))
    skip = " ".join(s for s in node_layout.STEPS["controller"] if s != "munge")
    inner = (f"mkdir -p /etc/munge /var/lib/slurm && mount --bind {etc} /etc/munge && mount --bind {state} /var/lib/slurm && "
             f"SLURM_GPU_SKIP_STEPS='{skip}' bash {script}")
    runs = []
    for _ in range(2):
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "step munge" in r.stdout and "skip services" in r.stdout
        runs.append((etc / "munge.key").read_bytes())
    return runs[0], os.stat(etc / "munge.key"), os.stat(etc), runs[1], r.stdout + r.stderr


@pytest.mark.cluster
def test_controller_bootstrap_makes_the_munge_key_munge_0400_in_0700_dir(bootstrap_key):
    key, key_st, dir_st, again, output = bootstrap_key
    munge = pwd.getpwnam("munge")
    assert len(key) >= 128 and len(set(key)) > 64  # random bytes, mungekey's size or more
    assert (key_st.st_uid, key_st.st_gid) == (munge.pw_uid, munge.pw_gid)
    assert stat.S_IMODE(key_st.st_mode) == 0o400
    assert (dir_st.st_uid, stat.S_IMODE(dir_st.st_mode)) == (munge.pw_uid, 0o700)
    assert again == key  # a second run keeps the cluster's key
    assert not _found(_key_forms(key), output)  # the script never prints it
