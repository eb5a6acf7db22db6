import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# No test reaches the Hugging Face Hub: `fab estimate` and `fab train` read a Hub model's config.json (the fit check,
# ops/cost/fit.py), so every process started from here, `fab` included, asks a closed loopback port instead, and a
# test that needs the Hub starts a stand-in on loopback and sets its own HF_ENDPOINT (tests/unit/test_gated_models.py).
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"


def pytest_configure(config):
    # Several tests press Ctrl-C on `fab` (SIGINT to it, or to this process around a remote command). A
    # runner started in the background by a non-interactive shell (`cmd &`, nohup) hands its children
    # SIGINT ignored, and Python keeps an ignored SIGINT ignored: those tests would see no interrupt at
    # all. Take Python's own handler back; processes started from here then get SIGINT's default action.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    boot = [item for item in items if item.get_closest_marker("boot")]
    if boot:
        # The boot tests run last, and their images, apt repositories and wheelhouses are built in
        # the background meanwhile (boottest/prebuild.py): on a fresh machine some minutes of
        # downloads and debootstraps overlap the other tests instead of adding to the run.
        items[:] = [item for item in items if not item.get_closest_marker("boot")] + boot
    # Cluster tests (and `root` ones) need root. In CI they must run (never a quiet skip); on a
    # developer's non-root machine they are skipped with a reason.
    if os.geteuid() == 0 or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="needs root (network namespaces, root-owned files); run scripts/test.sh as root")
    for item in items:
        if "cluster" in item.keywords or "root" in item.keywords or "boot" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # Once -m, -k and --deselect have had their say: only the boot tests that will run, only as root
    # (they need it), and not after a collection error (nothing runs).
    boot = [item for item in session.items if item.get_closest_marker("boot")]
    if boot and os.geteuid() == 0 and not session.testsfailed and not session.config.option.collectonly:
        _start_prebuild(session.config, boot)


def _start_prebuild(config, boot_items) -> None:
    """Build what the selected boot tests' platforms need, at idle CPU priority: the tests running
    meanwhile keep the machine. In its own session: a Ctrl-C at the terminal does not cut it short."""
    from boottest import cache
    from cluster.targets.boot import BOOT

    names = [p.name for p in BOOT.platforms if any(f"[{p.name}" in item.nodeid for item in boot_items)]
    if not names:
        return
    cache.CACHE.mkdir(parents=True, exist_ok=True)
    log_path = cache.CACHE / "prebuild.log"
    with open(log_path, "w") as log:
        cmd = ["nice", "-n", "19", sys.executable, "-m", "boottest.prebuild", *names]
        config.boot_prebuild = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True), log_path)


def pytest_unconfigure(config):
    # Still running at the end: the boot tests did not run (interrupted, -x, failed early) or did not need
    # it. Stop it (its process group: debootstrap, apt); the next build clears what it left (boottest/cache.py).
    proc, log_path = getattr(config, "boot_prebuild", (None, None))
    if proc is not None and proc.poll() is None:
        print(f"\nstopping the boot test prebuild (its log: {log_path})", file=sys.stderr)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pytest_terminal_summary(terminalreporter, config):
    proc, log_path = getattr(config, "boot_prebuild", (None, None))
    if proc is not None and proc.poll() not in (None, 0):
        terminalreporter.write_line(f"boot test prebuild failed (exit {proc.returncode}); the boot tests built "
                                    f"what they needed themselves. Its log: {log_path}")
