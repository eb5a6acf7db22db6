"""The bootstrap scripts run for real, as root, inside throw-away mount/UTS/network namespaces with
/etc, /var and /usr behind tmpfs overlays, so the machine itself is not changed (the unit half,
the health check and the skip-step check, is tests/unit/test_bootstrap_scripts.py).
"""

import subprocess
from pathlib import Path

import pytest

from bootstrap import node_layout, render, user_data
from cluster import hostpaths
from cluster.facts import NodeShape
from cluster.platform import LOCAL as LOCAL_PLATFORM
from ops.ssh import hostkeys
from tests.unit.test_bootstrap_render import make_facts
from tests.unit.test_bootstrap_scripts import write_exe

SANDBOX = r"""
set -euo pipefail
mount -t tmpfs tmpfs "$T"
for d in etc var usr; do
  mkdir -p "$T/u/$d" "$T/w/$d"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$T/u/$d,workdir=$T/w/$d" "/$d"
done
rm -rf /etc/munge /var/lib/slurm
ip link set lo up
ip addr add "$IP/32" dev lo
hostname sandbox
cp -r "$FILES"/. /
if [ -n "$PACKAGE_KEY" ]; then  # the munge package's postinst makes a key as it installs
  mkdir -p /etc/munge && head -c 128 /dev/urandom > /etc/munge/munge.key
fi
for i in 1 2; do
  SLURM_GPU_SKIP_STEPS="$SKIP" "$SCRIPT" > "$LOGDIR/run$i.log" 2>&1
  [ -z "$FAB_SYNC" ] || rm -f "$NODE_LOCAL"  # what fab's key sync does after the first boot
done
{
  echo "hostname=$(hostname) etc_hostname=$(cat /etc/hostname)"
  echo "begin_blocks=$(grep -c '^# BEGIN slurm-gpu hosts' /etc/hosts)"
  grep -E '^[0-9]' /etc/hosts | grep -v '^127\.' || true
  stat -c 'stat %n %U:%G %a' /etc/munge /etc/munge/munge.key /var/log/slurm /var/lib/slurm/* \
    "$STATE"/* 2>&1
  [ -e "$HC" ] && stat -c 'stat %n %U:%G %a' "$HC"
  [ -d "$SCRATCH/logs" ] && stat -c 'stat %n %U:%G %a' "$SCRATCH/logs" "$SCRATCH/hf-cache"
  echo "marker_role=$(grep role= "$MARKER")"
} > "$LOGDIR/report"
"""


def run_in_sandbox(tmp_path, facts, role, host, skip, gpus_present=None, expect_ok=True, package_key=False,
                   fab_sync=False):
    """`gpus_present`: indices of the stand-in GPU files a GPU host gets (default all).
    `package_key`: a munge key is there before the first run (the munge package made it);
    `fab_sync`: the node-local key's mark is removed after each run (fab's key sync)."""
    files = tmp_path / "files"
    if role == "gpu":
        for i in range(facts.shape.gpu_count) if gpus_present is None else gpus_present:
            dev = files / f"{facts.gpu_device_prefix}{i}".lstrip("/")
            dev.parent.mkdir(parents=True, exist_ok=True)
            dev.touch()
    for path, text in render.render_files(facts).items():
        dest = files / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        dest.chmod(node_layout.FILE_MODES.get(path, 0o644))
    script = tmp_path / "bootstrap.sh"
    write_exe(script, user_data.bootstrap_script(facts, role))
    (tmp_path / "mnt").mkdir()
    logdir = tmp_path / "out"
    logdir.mkdir()
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "T": str(tmp_path / "mnt"), "FILES": str(files),
        "IP": host.ip, "SKIP": skip, "SCRIPT": str(script), "LOGDIR": str(logdir),
        "STATE": node_layout.STATE_DIR, "MARKER": node_layout.MARKER_PATH, "HC": hostpaths.HEALTHCHECK_PATH,
        "SCRATCH": facts.scratch, "NODE_LOCAL": node_layout.NODE_LOCAL_KEY_MARKER,
        "PACKAGE_KEY": "1" if package_key else "", "FAB_SYNC": "1" if fab_sync else "",
    }
    res = subprocess.run(
        ["unshare", "--mount", "--uts", "--net", "--propagation", "private", "bash", "-c", SANDBOX],
        env=env, capture_output=True, text=True, timeout=120,
    )
    logs = "".join((logdir / f).read_text() for f in ("run1.log", "run2.log") if (logdir / f).exists())
    if not expect_ok:
        assert res.returncode != 0, logs
        return None, logs
    assert res.returncode == 0, res.stdout + res.stderr + logs
    return (logdir / "report").read_text(), logs


def stats(report):
    return {ln.split()[1]: tuple(ln.split()[2:]) for ln in report.splitlines() if ln.startswith("stat ")}


# The project's own bridge range: these tests put addresses only on a private loopback.
# The LOCAL platform: stand-in GPU files, no driver to open.
LOCAL = make_facts("sandbox", "10.213.0.0/24", 2, NodeShape(2, 1000, 2, "l4"), ssh_user="root",
                   scratch="/var/tmp/slurm-gpu-scratch", platform=LOCAL_PLATFORM)


@pytest.mark.cluster
def test_gpu_bootstrap_runs_and_is_idempotent(tmp_path):
    host = LOCAL.gpu_nodes[1]
    report, logs = run_in_sandbox(tmp_path, LOCAL, "gpu", host, "packages nfs scratch training services")
    assert f"hostname={host.name} etc_hostname={host.name}" in report  # named from its IP
    assert "begin_blocks=1" in report  # merged twice, present once
    for h in LOCAL.hosts:
        assert f"{h.ip} {h.name}" in report
    st = stats(report)
    assert st["/etc/munge"] == ("munge:munge", "700")
    assert st["/etc/munge/munge.key"] == ("munge:munge", "400")
    assert st["/var/lib/slurm/slurmd"][0] == "slurm:slurm"
    assert st["/var/log/slurm"][0] == "slurm:slurm"
    assert st[hostpaths.HEALTHCHECK_PATH] == ("root:root", "755")
    assert "marker_role=role=gpu" in report
    assert "step munge" in logs and "skip training" in logs
    assert "made a node-local one" in logs
    # The node-local key is marked: slurmd's drop-in keeps slurmd off until fab's key sync.
    assert st[node_layout.NODE_LOCAL_KEY_MARKER][0] == "root:root"
    assert f"ConditionPathExists=!{node_layout.NODE_LOCAL_KEY_MARKER}" in render.render_slurmd_dropin(LOCAL)
    assert f"GPU check: 2 device files present ({LOCAL.gpu_device_prefix}[0-1])" in logs
    # The host keys are printed as the bootstrap starts (before its first step), in the format
    # fab reads from the console, and they are this host's keys.
    first_run = logs.split("done (")[0]
    assert first_run.index(hostkeys.KEYS_END) < first_run.index("step hostname")
    printed = hostkeys.parse_console_output(first_run)
    on_disk = sorted(tuple(p.read_text().split()[:2]) for p in Path("/etc/ssh").glob("ssh_host_*_key.pub"))
    assert on_disk and sorted(printed) == on_disk


@pytest.mark.cluster
@pytest.mark.parametrize("fab_sync", [False, True], ids=["first-boot", "after-key-sync"])
def test_gpu_bootstrap_marks_the_munge_packages_key_node_local(tmp_path, fab_sync):
    """The munge package makes a key as it installs (Debian's postinst: `mungekey -c`), before
    the bootstrap runs: at first boot that key is the node's own all the same, and slurmd must
    wait for the cluster's (a configless slurmd cannot fetch its config with it). Once fab's key
    sync has removed the mark, running the bootstrap again does not mark the cluster's key."""
    _, logs = run_in_sandbox(tmp_path, LOCAL, "gpu", LOCAL.gpu_nodes[0], "packages nfs scratch training services",
                             package_key=True, fab_sync=fab_sync)
    report = (tmp_path / "out" / "report").read_text()
    assert (node_layout.NODE_LOCAL_KEY_MARKER in stats(report)) is not fab_sync, report
    assert "made a node-local one" not in logs  # the package's key is kept
    assert logs.count("first boot: the munge key is node-local") == 1, logs


@pytest.mark.cluster
def test_gpu_bootstrap_names_a_missing_gpu_and_stops_before_slurmd(tmp_path):
    _, logs = run_in_sandbox(tmp_path, LOCAL, "gpu", LOCAL.gpu_nodes[0], "packages nfs scratch training",
                             gpus_present=[0], expect_ok=False)
    assert f"GPU check: missing {LOCAL.gpu_device_prefix}1 (gres.conf File={LOCAL.gpu_device_prefix}[0-1]" in logs
    assert 'step "gpus" failed' in logs
    assert "step services" not in logs  # slurmd is never started


@pytest.mark.cluster
def test_controller_bootstrap_makes_the_key_once(tmp_path):
    report, logs = run_in_sandbox(tmp_path, LOCAL, "controller", LOCAL.controller, "packages nfs imds services")
    assert "hostname=controller etc_hostname=controller" in report
    st = stats(report)
    assert st["/etc/munge/munge.key"] == ("munge:munge", "400")
    assert st["/var/lib/slurm/slurmctld"] == ("slurm:slurm", "700")
    # What jobs write is the job user's (it ran the jobuser step); the scratch root stays root's, sticky.
    job = f"{LOCAL.job_user}:{LOCAL.job_user}"
    assert st[f"{LOCAL.scratch}/logs"] == (job, "755")
    assert st[f"{LOCAL.scratch}/hf-cache"] == (job, "755")
    # Two runs, one key: the second run keeps it (GPU nodes may already hold it).
    assert logs.count("created the cluster's munge key") == 1
    assert "marker_role=role=controller" in report
