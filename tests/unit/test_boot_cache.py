"""The boot test's cache (boottest/cache.py): one builder per entry. The background prebuild and a
boot test that needs the same entry meet at its lock; the later one waits and reuses what the first
built, and a build that failed halfway is never reused (fast, no root)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Two processes ask for one entry at once; each build takes a second and appends to builds.log.
_ASK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from boottest import cache
    log = Path(sys.argv[2])

    def build(tmp):
        with open(log, "a") as f:
            f.write("build\\n")
        time.sleep(1)
        (tmp / "thing").write_text("made")

    path, built = cache.cached("images", "demo", build)
    print(built, (path / "thing").read_text())
""")


def test_two_builders_of_one_entry_build_it_once(tmp_path):
    env = {"SLURM_GPU_BOOT_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    log = tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", _ASK, str(REPO), str(log)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(o.strip() for o, _ in outs) == ["False made", "True made"]
    assert log.read_text() == "build\n"


def test_a_failed_build_is_not_reused(tmp_path, monkeypatch):
    from boottest import cache

    monkeypatch.setattr(cache, "CACHE", tmp_path)

    def broken(tmp):
        (tmp / "half").write_text("")
        raise RuntimeError("download failed")

    with pytest.raises(RuntimeError):
        cache.cached("apt", "demo", broken)
    path, built = cache.cached("apt", "demo", lambda tmp: (tmp / "whole").write_text(""))
    assert built and sorted(p.name for p in path.iterdir()) == [cache.COMPLETE, "whole"]


@pytest.mark.root
def test_removing_a_halfway_build_leaves_what_was_mounted_in_it(tmp_path):
    """A build stopped halfway can leave a mount in its tree (debootstrap binds /dev): removing the tree
    unmounts first, so the files behind the mount are not deleted through it."""
    from boottest import cache

    outside = tmp_path / "host-dev"
    outside.mkdir()
    (outside / "null").write_text("keep me")
    tree = tmp_path / ".images.tmp"
    (tree / "rootfs" / "dev").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(outside), str(tree / "rootfs" / "dev")], check=True)
    try:
        cache.remove(tree)
    finally:
        subprocess.run(["umount", "--lazy", str(tree / "rootfs" / "dev")], check=False, capture_output=True)
    assert not tree.exists()
    assert (outside / "null").read_text() == "keep me"
